"""What one strategy lost in one simulated run, by cause, and the summary over seeds."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

# Where the time goes that is not training on new steps.
LOSSES = (
    "detection",
    "restart",
    "restore",
    "redone",
    "checkpoint",
    "cold_start",
    "manual",
    "straggler",  # steps at a slow GPU's pace: the time they took over the normal pace
)


@dataclass
class Outcome:
    strategy: str
    seed: int
    horizon_s: float
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    interruptions: int = 0
    recoveries_s: list[float] = field(default_factory=list)  # failure -> training again
    steps_redone: int = 0
    spare_exhausted: int = 0  # replacements that found no warm spare
    storage_fallbacks: int = 0  # restores from durable storage (no copy in memory left)
    jobs_failed: int = 0  # the policy's FAIL: restarted by hand
    stragglers: int = 0  # slow-GPU episodes met
    stragglers_moved: int = 0  # ... whose rank was moved to a spare before the episode ended
    idle_gpus: int = 0  # GPUs held ready (spares, standbys) that do not train
    gpus: int = 0  # GPUs that train

    def slow(self, seconds: float, slowdown: float) -> None:
        """`seconds` of steps at `slowdown` times the normal pace."""
        self.lose("straggler", seconds * (1 - 1 / slowdown))

    def lose(self, cause: str, seconds: float) -> None:
        self.lost[cause] += seconds

    def redo(self, seconds: float, step_s: float) -> None:
        """`seconds` of training done again: lost, and the steps they held redone."""
        self.lose("redone", seconds)
        self.steps_redone += math.ceil(seconds / step_s)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the share of the wall-clock spent on new steps."""
        return max(0.0, 1.0 - sum(self.lost.values()) / self.horizon_s)

    @property
    def ettr_per_gpu(self) -> float:
        """ETTR over every GPU the strategy holds (the idle spares and standbys too)."""
        held = self.gpus + self.idle_gpus
        return self.ettr * self.gpus / held if held else self.ettr


def _interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95 % confidence interval (normal)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """One strategy's runs, summed up (what the table and `-o json` show)."""
    ettr, half = _interval([o.ettr for o in outcomes])
    per_gpu, _ = _interval([o.ettr_per_gpu for o in outcomes])
    mttr = sorted(r for o in outcomes for r in o.recoveries_s)
    n = len(outcomes)
    return {
        "strategy": outcomes[0].strategy,
        "seeds": n,
        "ettr": round(ettr, 5),
        "ettr_ci95": round(half, 5),
        "ettr_per_gpu_held": round(per_gpu, 5),
        "idle_gpus": outcomes[0].idle_gpus,
        "interruptions": round(statistics.fmean(o.interruptions for o in outcomes), 1),
        "lost_hours": {k: round(sum(o.lost[k] for o in outcomes) / n / 3600, 2) for k in LOSSES},
        "mttr_s": {
            "p50": round(mttr[len(mttr) // 2], 2) if mttr else None,
            "p90": round(mttr[int(len(mttr) * 0.9)], 2) if mttr else None,
            "max": round(mttr[-1], 2) if mttr else None,
        },
        "steps_redone": round(statistics.fmean(o.steps_redone for o in outcomes), 1),
        "spare_exhausted": round(statistics.fmean(o.spare_exhausted for o in outcomes), 1),
        "storage_fallbacks": round(statistics.fmean(o.storage_fallbacks for o in outcomes), 1),
        "jobs_failed": round(statistics.fmean(o.jobs_failed for o in outcomes), 1),
        "stragglers": round(statistics.fmean(o.stragglers for o in outcomes), 1),
        "stragglers_moved": round(statistics.fmean(o.stragglers_moved for o in outcomes), 1),
    }

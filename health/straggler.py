"""Straggler detection: per-rank compute time against its peers, over sliding windows.

In data-parallel training a slow rank makes every rank's *step* slow (they all wait for it
in the gradient all-reduce), so step time cannot find it. Compute time can: each rank's
time inside the loop body minus the time it waited in collectives. The slow rank computes
longer; its peers wait longer.

Each rank gets a score per window of ``window_steps`` steps: its *best* (shortest) compute
time in the window divided by the median of the *other* ranks' best times (leave-one-out, so
two ranks suffice and one slow rank cannot drag the reference up). The best step, not the
median: a straggler is slow even at its best, while a healthy rank that a busy machine
preempts now and then still has fast steps in between. In the spirit of NVIDIA
resiliency-ext's relative scores, but inverted: 1.0 is normal, 3.0 is three times slower.
A rank is flagged when its score reaches ``threshold`` (and its excess is above timer noise)
in ``consecutive_windows`` consecutive windows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stalwart.health.observations import Budget
from stalwart.health.policy import Action, Decision


@dataclass(frozen=True)
class StragglerConfig:
    threshold: float = 2.0
    window_steps: int = 5
    consecutive_windows: int = 2
    min_excess_s: float = 0.005
    warmup_steps: int = 0  # steps of each generation not judged (the monitor applies it)
    min_duration_s: float = 0.0  # seconds of slow steps before a flag (the monitor applies it)

    @property
    def span(self) -> int:
        """Steps of history one verdict needs."""
        return self.window_steps * self.consecutive_windows


@dataclass(frozen=True)
class StragglerReport:
    scores: dict[int, float] = field(default_factory=dict)  # latest window, per rank
    flagged: tuple[int, ...] = ()
    through_step: int | None = None  # the newest step the verdict covers


def straggler_scores(
    history: Mapping[int, Mapping[int, float]], config: StragglerConfig
) -> tuple[StragglerReport, str]:
    """`history`: rank -> {step: compute seconds}. Only steps every rank has count."""
    if len(history) < 2:
        return StragglerReport(), "fewer than two ranks: nothing to compare"
    common = sorted(set.intersection(*(set(h) for h in history.values())))
    w = config.window_steps
    if len(common) < w:
        return StragglerReport(), f"{len(common)} common steps, a window needs {w}"
    n_windows = min(config.consecutive_windows, len(common) // w)
    steps = common[-n_windows * w :]
    windows = [steps[i * w : (i + 1) * w] for i in range(n_windows)]
    slow_in_all: set[int] | None = None
    scores: dict[int, float] = {}
    for window in windows:
        best = {r: min(h[s] for s in window) for r, h in history.items()}
        ordered = sorted(best.values())
        position = {}  # rank -> an index of its value in `ordered`
        for i, (rank, _) in enumerate(sorted(best.items(), key=lambda kv: kv[1])):
            position[rank] = i
        slow = set()
        for rank, m in best.items():
            ref = median_without(ordered, position[rank])
            score = m / ref if ref > 0 else 1.0
            scores[rank] = round(score, 3)
            if score >= config.threshold and m - ref >= config.min_excess_s:
                slow.add(rank)
        slow_in_all = slow if slow_in_all is None else slow_in_all & slow
    flagged = (
        tuple(sorted(slow_in_all or ()))
        if n_windows == config.consecutive_windows
        else ()  # not enough history for a verdict yet
    )
    report = StragglerReport(scores, flagged, steps[-1])
    if flagged:
        reason = "; ".join(
            f"rank {r} computes {scores[r]:.2f}x its peers' median (best step per window) in "
            f"{n_windows} consecutive windows of {w} steps (threshold {config.threshold})"
            for r in flagged
        )
    else:
        worst = max(scores, key=scores.get)
        reason = f"no straggler (highest score: rank {worst} at {scores[worst]:.2f})"
    return report, reason


def median_without(ordered: list[float], i: int) -> float:
    """The median of `ordered` (sorted) without its element at index `i`, in O(1): the
    leave-one-out reference for every rank costs one sort, not one per rank."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th element once index i is removed
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def straggler_decision(
    flagged: tuple[int, ...],
    policy: str,
    node_of: Mapping[int, str],
    spare_nodes: frozenset[str],
    budget: Budget,
) -> tuple[Decision, str]:
    """What to do about flagged ranks. `spare_nodes`: nodes with a ready spare that are not
    cordoned. A straggler never fails the job: without a way to move it, it is an alert."""
    if not flagged or policy == "none":
        return Decision(Action.NOOP), "no straggler to act on"
    ranks = ", ".join(map(str, flagged))
    if policy == "alert":
        return Decision(Action.NOOP), f"straggler rank(s) {ranks}: alert only (policy alert)"
    slow_nodes = {node_of[r] for r in flagged}
    elsewhere = spare_nodes - slow_nodes
    if len(elsewhere) == 0:
        return (
            Decision(Action.NOOP),
            f"straggler rank(s) {ranks}: alert only, no ready spare on another healthy node",
        )
    if budget.restarts_left == 0:
        return (
            Decision(Action.NOOP),
            f"straggler rank(s) {ranks}: alert only, restart budget spent "
            f"(failure.max_restarts={budget.max_restarts})",
        )
    return (
        Decision(Action.REPLACE, ranks=tuple(flagged), cordon=tuple(sorted(slow_nodes))),
        f"straggler rank(s) {ranks}: move to a spare on another node, cordon "
        + ", ".join(n[:12] for n in sorted(slow_nodes)),
    )

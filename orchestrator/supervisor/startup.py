"""The job's cold start: where the time from the driver's start to the first step went.

The start path is a chain of waits, each ended by a mark (wall clock): the driver's (Ray
up, the supervisor asked for), the supervisor's (started, slots held, workers ready, spares,
preflight, the first generation launched) and the ranks' (rendezvous done, the train loop's
set-up done, step 0's snapshot taken, the first step done: the slowest rank's, as a
recovery's phases are, ledger.py close_recovery). The slowest worker's boot (ready()'s
"boot": process start, imports, the train loop's import, warm-up) splits the wait for the
workers. Each phase is the time from the previous mark to its own, so the phases sum to
`first_step_after_s`; a mark that is missing leaves its time to "other". What ran
alongside the chain (node agents, spares, the supervisor's own process) is in `spans_s`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

# The ranks' timings (heartbeats', outcomes'), in the order the start path reaches them.
RANK_MARKS = (
    ("rendezvous", "rendezvous_done"),
    ("train_setup", "setup_done"),  # the loop's own set-up until ctx.steps()
    ("snapshot0", "restored"),  # a fresh start commits the initial state as step 0
    ("first_step", "first_step_done"),
)
# ready()'s "boot" (orchestrator/worker/actor.py), in order: the phase each one ends.
BOOT_MARKS = (
    ("worker_spawn", "process_started"),  # Ray starting the process (0: a prestarted one)
    ("worker_imports", "init"),  # Python, torch, Ray, stalwart's worker modules
    ("worker_entrypoint", "entrypoint_loaded"),  # the train loop's module
    ("worker_warmup", "ready"),  # the one-time costs paid before the first step
)


def phases_from_marks(
    start: float, marks: Sequence[tuple[str, float | None]]
) -> tuple[dict[str, float], float]:
    """`marks`: (phase, when it ended) in the order the path passed them. Returns the
    phases' seconds (a phase that ended before the previous one took 0 s; the time up to a
    mark after a missing one (None) is "other") and the total, last mark - `start`, which
    they sum to."""
    phases: dict[str, float] = {}
    prev, gap = start, False
    for name, at in marks:
        if at is None:
            gap = True
            continue
        at = max(at, prev)
        key = "other" if gap else name
        phases[key] = phases.get(key, 0.0) + (at - prev)
        prev, gap = at, False
    return phases, prev - start


def slowest_boot(
    boots: Mapping[Any, Mapping[str, float]],
) -> tuple[Any, Mapping[str, float]] | None:
    """The worker whose boot ended last (it is the one the start waited for)."""
    full = {k: b for k, b in boots.items() if b.get("ready") is not None}
    if not full:
        return None
    key = max(full, key=lambda k: full[k]["ready"])
    return key, full[key]


def boot_summary(boots: Mapping[Any, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Each boot step's median and max seconds over the workers (process start -> imports
    done, -> the train loop imported, -> warmed up)."""
    out = {}
    prev_key = "process_started"
    for name, key in BOOT_MARKS[1:]:
        secs = [b[key] - b[prev_key] for b in boots.values() if key in b and prev_key in b]
        if secs:
            out[name] = {
                "median": round(statistics.median(secs), 4),
                "max": round(max(secs), 4),
            }
        prev_key = key
    return out


def startup_breakdown(
    driver: Mapping[str, float],
    marks: Sequence[tuple[str, float | None]],
    timings: Sequence[Mapping[str, float]] | None,
    spans: Mapping[str, tuple[float, float]] = {},
    boots: Mapping[Any, Mapping[str, float]] = {},
) -> dict[str, Any]:
    """result.json's `startup`. `driver`: the driver's marks (started, ray_ready,
    supervisor_requested; none when something else started the supervisor); `marks`: the
    supervisor's chain; `timings`: the first generation's ranks' (None: not every rank has
    stepped); `spans`: what ran alongside, (start, end)."""
    chain: list[tuple[str, float | None]] = []
    if driver:
        chain += [
            ("ray_init", driver.get("ray_ready")),
            ("driver", driver.get("supervisor_requested")),
        ]
    chain += list(marks)
    if timings:
        for phase, key in RANK_MARKS:
            ats = [t.get(key) for t in timings]
            chain.append((phase, max(ats) if None not in ats else None))
    start = driver.get("started") if driver else next((t for _, t in marks if t), time.time())
    phases, total = phases_from_marks(start, chain)
    slowest = slowest_boot(boots)
    return {
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        # None: the first generation never stepped on every rank (the phases stop earlier).
        "first_step_after_s": round(total, 4) if timings else None,
        "spans_s": {k: [round(a - start, 4), round(b - start, 4)] for k, (a, b) in spans.items()},
        "worker_boot_s": boot_summary(boots),
        "slowest_worker": None if slowest is None else slowest[0],
    }


class StartupClock:
    """The supervisor's marks on the start path (pool, preflight and generation mark their
    own); the ledger closes it at the first generation's first step."""

    def __init__(self) -> None:
        self.driver: dict[str, float] = {}
        # This process's start and the clock's (the supervisor's construction).
        self.marks: list[tuple[str, float | None]] = [
            ("supervisor_spawn", process_started()),
            ("supervisor_imports", time.time()),
        ]
        self.spans: dict[str, tuple[float, float]] = {}
        self.boots: dict[Any, dict[str, float]] = {}
        self.generation: int | None = None  # the first generation, once launched
        self.closed: dict[str, Any] | None = None

    def mark(self, phase: str, at: float | None = None) -> None:
        """The wait `phase` ended now (or `at`); a phase marked before keeps its first."""
        if self.closed is None and all(name != phase for name, _ in self.marks):
            self.marks.append((phase, time.time() if at is None else at))

    def span(self, name: str, start: float, end: float | None = None) -> None:
        """Something alongside the chain ran from `start` to `end` (now); a span of that
        name marked before is extended to cover both (all the node agents, all spares)."""
        if self.closed is not None:
            return
        end = time.time() if end is None else end
        old = self.spans.get(name)
        self.spans[name] = (min(start, old[0]), max(end, old[1])) if old else (start, end)

    def spare_ready(self, slot: int | None, boot: Mapping[str, float]) -> None:
        """A spare is ready; the span `spares` covers them from their process start."""
        started = boot.get("process_started") or boot.get("init")
        if started is not None:
            self.span("spares", started, boot.get("ready"))

    def committed(self) -> None:
        """A step was committed: the first one after the launch (step 0 on a fresh start)
        ends the span `first_commit` (the first step does not wait for it)."""
        launch = next((t for name, t in self.marks if name == "launch"), None)
        if launch is not None and "first_commit" not in self.spans:
            self.span("first_commit", launch)

    def workers_ready(self, boots: Mapping[Any, Mapping[str, float]]) -> None:
        """The ranks' workers are ready (their boots by rank): the slowest one's boot
        splits the wait, the rest of it (ready() answered, attached) is worker_attach."""
        self.boots.update({k: dict(b) for k, b in boots.items()})
        slowest = slowest_boot(boots)
        if slowest is not None:
            for phase, key in BOOT_MARKS:
                self.mark(phase, slowest[1].get(key))
        self.mark("worker_attach")

    def boot_seconds(self) -> float | None:
        """The longest boot of the ranks' workers at the start (process start to ready)."""
        secs = [
            b["ready"] - (b.get("process_started") or b["init"])
            for b in self.boots.values()
            if "ready" in b and "init" in b
        ]
        return max(secs) if secs else None

    def launched(self, generation: int) -> None:
        if self.generation is None:
            self.generation = generation
            self.mark("launch")

    def close(self, generation: int, timings: Sequence[Mapping[str, float]], ranks: int):
        """The breakdown, once every one of the first generation's `ranks` (`timings`) took
        a step; None before (or for another generation)."""
        if self.closed is not None or generation != self.generation or len(timings) < ranks:
            return None
        if not all("first_step_done" in t for t in timings):
            return None
        self.closed = startup_breakdown(self.driver, self.marks, timings, self.spans, self.boots)
        return self.closed

    def summary(self) -> dict[str, Any]:
        """The breakdown (as far as the start got, when it never reached a first step)."""
        if self.closed is not None:
            return self.closed
        return startup_breakdown(self.driver, self.marks, None, self.spans, self.boots)


def process_started() -> float | None:
    """This process's start (wall clock), before Python imported anything; None without
    /proc. From the uptime (to 10 ms), not /proc/stat's btime (whole seconds)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None

"""The numbers behind the report's figures: the timeline (throughput, markers, recoveries,
durable checkpoints) and the goodput split, each a pure function of a run's event list (tested on
small synthetic lists), plus the small helpers that read event fields and that the figures use.
The per-rank step times are in orchestrator/observe/rank_times.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.orchestrator.observe.metric_defs import TERMINAL_STATES
from stalwart.orchestrator.observe.metrics import Downtime

PHASES = (
    "detect",
    "decide",
    "abort",
    "replace",
    "rendezvous",
    "reenter",
    "restore",
    "first_step",
    "other",  # what no phase measures: the phases sum to the recovery time
)


@dataclass
class Marker:
    t: float  # seconds since the job started
    kind: str  # fault, failure, straggler, cordon, gpu, resize
    label: str


@dataclass
class Recovery:
    start: float  # the failure (injected fault time when known), seconds since the job started
    end: float  # the first step after the restore (or the end of the job when it gave up)
    label: str  # what failed: "kill_worker r1"
    outcome: str  # recovered, gave up, open (the log ends mid-way)
    generation: int | None = None
    restore_step: int | None = None
    phases: dict[str, float] = field(default_factory=dict)
    detect_known: bool = True

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Timeline:
    t0: float  # unix time of the job's first event
    end: float  # seconds since t0 of the job's end (or of the last event)
    times: list[float] = field(default_factory=list)  # throughput events
    steps: list[int | None] = field(default_factory=list)
    steps_per_s: list[float | None] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    commit_lag: list[float | None] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    persisted: list[dict[str, Any]] = field(default_factory=list)  # t, step, seconds, bytes
    persist_failed: list[dict[str, Any]] = field(default_factory=list)  # t, step
    first_running: float | None = None

    @property
    def has_loss(self) -> bool:
        return any(v is not None for v in self.loss)


def job_start(events: list[Mapping[str, Any]]) -> float:
    return min(e["ts"] for e in events)


def _failure_label(kind: Any, rank: Any) -> str:
    kind = str(kind or "failure")
    return f"{kind} r{rank}" if rank is not None else kind


def timeline(events: list[Mapping[str, Any]]) -> Timeline:
    """Everything the timeline figure shows, in seconds since the job's first event."""
    if not events:
        return Timeline(t0=0.0, end=0.0)
    t0 = job_start(events)
    tl = Timeline(t0=t0, end=max(e["ts"] for e in events) - t0)
    open_faults: list[dict[str, Any]] = []  # injected, not yet tied to a decision
    current: dict[str, Any] | None = None  # the recovery under way

    def close(end: float, outcome: str, rec: Mapping[str, Any] | None = None) -> None:
        nonlocal current
        assert current is not None
        start = current["start"]
        phases: dict[str, float] = {}
        detect_known = True
        generation = restore_step = None
        if rec is not None:
            after = [x for x in as_list(rec.get("recovered_after_s")) if num(x) is not None]
            if after and current["from_fault"]:
                end = start + max(after)
            elif after:
                start = min(start, end - max(after))
            phases = {
                k: float(v)
                for k, v in (rec.get("phases_s") or {}).items()
                if k in PHASES and num(v) is not None
            }
            detected = [num(x) for x in as_list(rec.get("detected_after_s"))]
            decided = [num(x) for x in as_list(rec.get("decided_after_s"))]
            if any(x is not None for x in detected):
                phases["detect"] = max(x for x in detected if x is not None)
            elif detected:
                detect_known = False
            if any(x is not None for x in decided):
                phases["decide"] = max(x for x in decided if x is not None)
            generation = as_int(rec.get("generation"))
            restore_step = as_int(rec.get("restore_step"))
        labels = list(dict.fromkeys(current["labels"])) or ["failure"]
        tl.recoveries.append(
            Recovery(
                start=start,
                end=max(start, end),
                label=", ".join(labels),
                outcome=outcome,
                generation=generation,
                restore_step=restore_step,
                phases=phases,
                detect_known=detect_known,
            )
        )
        current = None

    for e in events:
        t = e["ts"] - t0
        kind = e["type"]
        if kind == "state":
            new = e.get("new")
            if new == "RUNNING" and tl.first_running is None:
                tl.first_running = t
            if new in TERMINAL_STATES:
                tl.end = t
                if current is not None:
                    close(t, "gave up" if new == "FAILED" else str(new).lower())
        elif kind == "throughput":
            tl.times.append(t)
            tl.steps.append(as_int(e.get("step")))
            tl.steps_per_s.append(num(e.get("steps_per_s")))
            tl.loss.append(num(e.get("loss")))
            tl.commit_lag.append(num(e.get("commit_lag_steps")))
        elif kind == "fault_injected":
            at = (num(e.get("at")) or e["ts"]) - t0
            fault = {
                "t": at,
                "rank": e.get("rank"),
                "node": e.get("node_id"),
                "kind": e.get("kind"),
            }
            open_faults.append(fault)
            step = e.get("step", e.get("at_step"))
            label = _failure_label(e.get("kind"), e.get("rank"))
            label += f" @{step}" if step is not None else ""
            tl.markers.append(Marker(at, "fault", label))
        elif kind == "decision":
            if e.get("action") in (None, "noop"):
                continue
            if current is None:
                current = {"start": t, "labels": [], "from_fault": False}
            failures = [f for f in as_list(e.get("failures")) if isinstance(f, Mapping)]
            if any(f.get("kind") != "comm_error" for f in failures):
                # A collective error next to a root cause is its symptom (as in result.json).
                failures = [f for f in failures if f.get("kind") != "comm_error"]
            for f in failures:
                fault = _match_fault(open_faults, f)
                if fault is not None:
                    open_faults.remove(fault)
                    current["start"] = min(current["start"], fault["t"])
                    current["from_fault"] = True
                    current["labels"].append(_failure_label(fault["kind"], fault["rank"]))
                else:
                    label = _failure_label(f.get("kind"), f.get("rank"))
                    current["labels"].append(label)
                    tl.markers.append(Marker(t, "failure", label))
            if not failures:
                current["labels"].append(str(e.get("action")))
        elif kind == "recovered":
            if current is None:
                current = {"start": t, "labels": [], "from_fault": False}
                current["labels"].extend(
                    f"r{r}" for r in as_list(e.get("replaced")) if isinstance(r, int)
                )
            close(t, "recovered", e)
        elif kind == "straggler":
            score = num(e.get("score"))
            label = f"straggler r{e.get('rank')}" + (f" {score:.1f}x" if score else "")
            tl.markers.append(Marker(t, "straggler", label))
        elif kind == "cordoned":
            tl.markers.append(Marker(t, "cordon", f"cordon {str(e.get('node') or '?')[:8]}"))
        elif kind in ("gpu_fatal", "gpu_error"):
            label = f"{kind} {str(e.get('node') or '?')[:8]} gpu {e.get('gpu', '?')}"
            tl.markers.append(Marker(t, "gpu", label))
        elif kind == "resized":
            tl.markers.append(Marker(t, "resize", f"world {e.get('old')}→{e.get('new')}"))
        elif kind == "persisted":
            tl.persisted.append(
                {
                    "t": t,
                    "step": as_int(e.get("step")),
                    "seconds": num(e.get("seconds")),
                    "bytes": num(e.get("bytes")),
                }
            )
        elif kind == "persist_failed":
            tl.persist_failed.append({"t": t, "step": as_int(e.get("step"))})
    if current is not None:
        close(tl.end, "open")
    tl.markers.sort(key=lambda m: m.t)
    return tl


_NODE_KILLS = ("kill_node", "kill_raylet")  # faults whose failures are their node's


def _match_fault(faults: list[dict[str, Any]], failure: Mapping[str, Any]) -> dict | None:
    """The newest open injected fault behind `failure`: same rank, or a node fault on its
    node."""
    for fault in reversed(faults):
        if fault["rank"] == failure.get("rank"):
            return fault
    for fault in reversed(faults):
        if fault["kind"] in _NODE_KILLS and fault["node"] and fault["node"] == failure.get("node"):
            return fault
    return None


@dataclass
class Goodput:
    """The job's wall time split up (seconds) and two goodput ratios (None without state
    events): `whole_job` = productive / wall from the job's first event to its end (start-up
    included); `since_running` = productive / the time since the first RUNNING, the
    exporter's ratio: result.json's `goodput` (`exporter`) when given, else estimated."""

    wall_s: float
    startup_s: float  # before the first RUNNING: scheduling, preflight, ...
    recovering_s: float  # in state RECOVERING
    redone_s: float  # the time of the steps trained again
    productive_s: float
    redone_steps: int
    step_time_s: float | None  # the median step time (1 / median steps per second)
    whole_job: float | None
    since_running: float | None
    exporter: float | None = None  # result.json's goodput
    known: bool = True  # False: no state event says when the job ran

    @property
    def from_exporter(self) -> bool:
        """Whether the split follows the exporter's goodput (else it is estimated)."""
        return self.exporter is not None and self.since_running == self.exporter


def median_step_time(events: Iterable[Mapping[str, Any]]) -> float | None:
    """The median seconds per step over the throughput intervals that made progress."""
    times = [
        1.0 / rate
        for e in events
        if e.get("type") == "throughput"
        for rate in [num(e.get("steps_per_s"))]
        if rate is not None and rate > 0
    ]
    return statistics.median(times) if times else None


def redone_steps(events: list[Mapping[str, Any]]) -> int:
    """Steps trained again after recoveries, estimated from the events (result.json has the
    exact count): per recovery, the newest step seen before it minus its restore step."""
    reached = 0
    total = 0
    for e in events:
        kind = e["type"]
        if kind in ("throughput", "fault_injected"):
            reached = max(reached, as_int(e.get("step")) or 0)
        elif kind == "decision":
            for f in as_list(e.get("failures")):
                if isinstance(f, Mapping):
                    reached = max(reached, as_int(f.get("step")) or 0)
        elif kind == "recovered":
            restore = as_int(e.get("restore_step"))
            restore = 0 if restore is None else restore
            total += max(0, reached - restore)
            reached = restore
    return total


def goodput(
    events: list[Mapping[str, Any]], redone: int | None = None, exporter: float | None = None
) -> Goodput:
    """Split the job's wall time (its first event to its end state, or to the last event):
    start-up = before the first RUNNING, recovering = each recovery from its failure to the
    first step after the restore (at least its RECOVERING state), redone = the
    steps trained again, productive = the rest. With `exporter` (result.json's goodput, as
    orchestrator/observe/metrics.py counted it) productive = `exporter` x the time since RUNNING and
    redone what is left; without, redone = `redone` steps (default: estimated from the
    events) x the median step time."""
    if not events:
        return Goodput(0, 0, 0, 0, 0, 0, None, None, None, exporter, known=False)
    start = job_start(events)
    end = max(e["ts"] for e in events)
    acct = Downtime()  # the exporter's accounts (orchestrator/observe/metrics.py)
    for e in events:
        acct.feed(e)
        if acct.ended is not None:
            end = acct.ended
            break
    first_running = acct.first_running
    recovering = acct.down(end)
    states = [e for e in events if e["type"] == "state"]
    wall = max(0.0, end - start)
    step_time = median_step_time(events)
    steps = redone_steps(events) if redone is None else max(0, int(redone))
    if not states:
        return Goodput(wall, 0, 0, 0, 0, steps, step_time, None, None, exporter, known=False)
    if first_running is None:  # never ran: all of it was start-up
        whole = 0.0 if wall else None
        return Goodput(wall, wall, 0, 0, 0, steps, step_time, whole, None, exporter)
    running = max(0.0, end - first_running)
    up = max(0.0, running - recovering)
    if exporter is not None and running > 0:
        productive = min(up, max(0.0, exporter * running))
        if steps == 0 and up - productive <= 1e-4 * running:
            productive = up  # no step redone: the rest is the 4 digits result.json keeps
        since_running: float | None = exporter
    else:
        productive = up - min(steps * (step_time or 0.0), up)
        since_running = productive / running if running > 0 else None
    return Goodput(
        wall_s=wall,
        startup_s=first_running - start,
        recovering_s=recovering,
        redone_s=up - productive,
        productive_s=productive,
        redone_steps=steps,
        step_time_s=step_time,
        whole_job=productive / wall if wall > 0 else None,
        since_running=since_running,
        exporter=exporter,
    )


# --- reading event fields ---------------------------------------------------------------------
# A field that is missing, of the wrong type or not finite reads as None (or []): one odd field
# leaves a gap in a figure rather than failing the whole report.


def num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list | tuple) else []


def fmt_secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"

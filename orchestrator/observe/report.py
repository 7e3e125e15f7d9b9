"""`stalwart report RUN_DIR`: PNG figures and one HTML page from a finished (or killed) run.

Reads RUN_DIR/events.jsonl (required) and RUN_DIR/result.json (optional: a run killed mid-way
has none) and writes the figures and index.html to RUN_DIR/report/ (or `out_dir`).

This module reads the run, computes the numbers behind the figures (`timeline`, `goodput`,
`heatmap`: pure functions of the event list, tested on small synthetic lists), writes the
page and puts it all together (`build_report`); orchestrator/observe/figures.py draws the
figures (matplotlib, imported only by `build_report`). Nothing here needs Ray or a running
job. See docs/report.md for how to read the figures.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.observe.metrics import TERMINAL_STATES, Downtime

PHASES = ("detect", "decide", "abort", "replace", "rendezvous", "reenter", "restore", "first_step")


class ReportError(Exception):
    """The run directory cannot be reported on (the message says which file and why)."""


@dataclass
class Report:
    """What `build_report` wrote: `files` (the PNGs, then index.html) and `warnings`."""

    out_dir: Path
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Path]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


@dataclass
class RunData:
    run_dir: Path
    events: list[dict[str, Any]]
    result: dict[str, Any] | None
    skipped_lines: list[int] = field(default_factory=list)  # 1-based numbers of bad lines
    warnings: list[str] = field(default_factory=list)


# --- reading ----------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> RunData:
    """Read events.jsonl (malformed lines are skipped and counted; none parsing is an error)
    and result.json (absent is allowed; unreadable is an error)."""
    run = Path(run_dir)
    if not run.exists():
        raise ReportError(f"{run}: no such run directory (expected the --output of stalwart run)")
    if not run.is_dir():
        raise ReportError(f"{run}: not a directory (expected the --output of stalwart run)")
    path = run / "events.jsonl"
    if not path.exists():
        raise ReportError(
            f"{path}: missing (expected one JSON event per line, written by stalwart run)"
        )
    try:
        events, skipped = _read_events(path)
    except OSError as e:
        raise ReportError(f"{path}: cannot read it ({_reason(e)})") from e
    if not events:
        if skipped:
            raise ReportError(
                f"{path}: none of its {len(skipped)} line(s) is a JSON event with a numeric ts "
                f"and a type (first bad line: {skipped[0]})"
            )
        raise ReportError(f"{path}: empty (expected one JSON event per line)")
    events.sort(key=lambda e: (e["ts"], _num(e.get("seq")) or 0))
    notes = []
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        notes.append(
            f"{path.name}: skipped {len(skipped)} malformed line(s) (line {shown}); "
            "expected a JSON object with ts and type on each line"
        )
    result = None
    rpath = run / "result.json"
    if rpath.exists():
        try:
            result = json.loads(rpath.read_text(encoding="utf-8"))
        except OSError as e:
            raise ReportError(f"{rpath}: cannot read it ({_reason(e)})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportError(f"{rpath}: not valid JSON ({e}); expected the run's summary") from e
        if not isinstance(result, dict):
            raise ReportError(f"{rpath}: expected a JSON object (the run's summary)")
    else:
        notes.append("no result.json: the run did not finish")
    return RunData(run, events, result, skipped, notes)


def _read_events(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The events of a JSON-lines file, and the numbers of the lines that are not one."""
    events: list[dict[str, Any]] = []
    skipped: list[int] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                skipped.append(number)
                continue
            ts = _num(event.get("ts")) if isinstance(event, dict) else None
            if ts is None or not isinstance(event.get("type"), str):
                skipped.append(number)
                continue
            event["ts"] = ts
            events.append(event)
    return events, skipped


def _reason(e: OSError) -> str:
    """An OSError's reason without the path the message already names."""
    if e.errno is not None and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


# --- computations -----------------------------------------------------------------------------


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
            after = [x for x in _list(rec.get("recovered_after_s")) if _num(x) is not None]
            if after and current["from_fault"]:
                end = start + max(after)
            elif after:
                start = min(start, end - max(after))
            phases = {
                k: float(v)
                for k, v in (rec.get("phases_s") or {}).items()
                if k in PHASES and _num(v) is not None
            }
            detected = [_num(x) for x in _list(rec.get("detected_after_s"))]
            decided = [_num(x) for x in _list(rec.get("decided_after_s"))]
            if any(x is not None for x in detected):
                phases["detect"] = max(x for x in detected if x is not None)
            elif detected:
                detect_known = False
            if any(x is not None for x in decided):
                phases["decide"] = max(x for x in decided if x is not None)
            generation = _int(rec.get("generation"))
            restore_step = _int(rec.get("restore_step"))
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
            tl.steps.append(_int(e.get("step")))
            tl.steps_per_s.append(_num(e.get("steps_per_s")))
            tl.loss.append(_num(e.get("loss")))
            tl.commit_lag.append(_num(e.get("commit_lag_steps")))
        elif kind == "fault_injected":
            at = (_num(e.get("at")) or e["ts"]) - t0
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
            failures = [f for f in _list(e.get("failures")) if isinstance(f, Mapping)]
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
                    f"r{r}" for r in _list(e.get("replaced")) if isinstance(r, int)
                )
            close(t, "recovered", e)
        elif kind == "straggler":
            score = _num(e.get("score"))
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
                    "step": _int(e.get("step")),
                    "seconds": _num(e.get("seconds")),
                    "bytes": _num(e.get("bytes")),
                }
            )
        elif kind == "persist_failed":
            tl.persist_failed.append({"t": t, "step": _int(e.get("step"))})
    if current is not None:
        close(tl.end, "open")
    tl.markers.sort(key=lambda m: m.t)
    return tl


def _match_fault(faults: list[dict[str, Any]], failure: Mapping[str, Any]) -> dict | None:
    """The newest open injected fault behind `failure`: same rank, or a node fault on its
    node."""
    for fault in reversed(faults):
        if fault["rank"] == failure.get("rank"):
            return fault
    for fault in reversed(faults):
        if fault["kind"] == "kill_node" and fault["node"] and fault["node"] == failure.get("node"):
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
        for rate in [_num(e.get("steps_per_s"))]
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
            reached = max(reached, _int(e.get("step")) or 0)
        elif kind == "decision":
            for f in _list(e.get("failures")):
                if isinstance(f, Mapping):
                    reached = max(reached, _int(f.get("step")) or 0)
        elif kind == "recovered":
            restore = _int(e.get("restore_step"))
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


@dataclass
class Heatmap:
    """Ranks x throughput intervals of median compute seconds per step, kept per column
    (rank -> seconds of the ranks the interval holds: those that made a step, in a job of
    more than 64 ranks only its 64 slowest). `ranks`: every rank held, in order;
    `ranks_total`: the job's rank count; `partial`: no interval holds every rank."""

    ranks: list[int]
    edges: list[float]  # len(columns) + 1 time edges, seconds since the job started
    columns: list[dict[int, float]]
    ranks_total: int = 0
    partial: bool = False
    # Per column: the median over all the job's ranks (the event's compute_median_s), or
    # None; a partial column's ranks are compared with it.
    medians: list[float | None] = field(default_factory=list)
    _ratios: list[dict[int, float]] | None = field(default=None, repr=False, compare=False)

    @property
    def values(self) -> np.ndarray:
        """[row of `ranks`, column] seconds, NaN where the interval does not hold the rank."""
        return self.matrix(self.ranks)

    def matrix(self, ranks: list[int], relative: bool = False) -> np.ndarray:
        """[row of `ranks`, column]: seconds, or with `relative` the `ratios()`; NaN where
        the interval does not hold the rank."""
        row = {r: i for i, r in enumerate(ranks)}
        out = np.full((len(ranks), len(self.columns)), np.nan)
        for c, cells in enumerate(self.ratios() if relative else self.columns):
            for r, v in cells.items():
                if r in row:
                    out[row[r], c] = v
        return out

    def relative(self, ranks: list[int] | None = None) -> np.ndarray:
        return self.matrix(self.ranks if ranks is None else ranks, relative=True)

    def ratios(self) -> list[dict[int, float]]:
        """Per column: rank -> its value over the median of the other ranks' in the column
        (the straggler score's measure: 1 is normal, 2 twice as slow); a rank without a peer
        to compare with is left out. O(R log R) per column. A partial column (its job's
        slowest ranks only) compares them with the median of all the job's ranks when the
        event gives it, else with each other (which understates how slow they are)."""
        if self._ratios is None:
            self._ratios = []
            for c, cells in enumerate(self.columns):
                values = np.fromiter(cells.values(), float, len(cells))
                median = self.medians[c] if c < len(self.medians) else None
                if median and len(cells) < self.ranks_total:
                    peers = np.full(len(cells), median)
                else:
                    peers = median_of_others(values)
                self._ratios.append(
                    {
                        r: float(v / p)
                        for r, v, p in zip(cells, values, peers, strict=True)
                        if p > 0  # NaN (alone) compares False
                    }
                )
        return self._ratios

    def slowest(self, n: int) -> list[int]:
        """The `n` most straggler-like ranks, in rank order: by the highest median of their
        relative time over three consecutive intervals (of those the rank is in), so that
        one odd interval does not count; ties go to the lower rank."""
        if n >= len(self.ranks):
            return list(self.ranks)
        series: dict[int, dict[int, float]] = {}
        for c, cells in enumerate(self.ratios()):
            for r, v in cells.items():
                series.setdefault(r, {})[c] = v
        last = max(0, len(self.columns) - 3)  # the last window's first column
        score: dict[int, float] = {}
        for r, by_column in series.items():
            windows = {w for c in by_column for w in range(max(0, c - 2), min(c, last) + 1)}
            score[r] = max(
                statistics.median(by_column[c] for c in range(w, w + 3) if c in by_column)
                for w in windows
            )
        order = sorted(self.ranks, key=lambda r: (-score.get(r, -math.inf), r))
        return sorted(order[: max(0, n)])


def median_of_others(values: np.ndarray) -> np.ndarray:
    """For each value, the median of all the others (NaN when alone), in O(n log n): in the
    sorted values without the one at sorted position i, position p holds sorted[p] below i
    and sorted[p + 1] from i on."""
    k = values.size
    if k < 2:
        return np.full(k, np.nan)
    order = np.argsort(values, kind="stable")
    s = values[order]
    pos = np.empty(k, dtype=int)
    pos[order] = np.arange(k)

    def at(p: int) -> np.ndarray:
        return np.where(p < pos, s[p], s[p + 1])

    n = k - 1
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def heatmap(events: list[Mapping[str, Any]]) -> Heatmap:
    """Ranks x throughput intervals of median compute seconds per step. Each throughput
    event covers the time since the previous one; events without rank_compute_s (runs
    before it was recorded) are left out; an interval need not hold every rank (a job of
    more than 64 ranks logs the slowest 64 of each)."""
    if not events:
        return Heatmap([], [], [])
    t0 = job_start(events)
    columns: list[tuple[float, float, dict[int, float], float | None]] = []
    prev: float | None = None
    total = 0
    for e in events:
        if e["type"] != "throughput":
            continue
        t = e["ts"] - t0
        per_rank = e.get("rank_compute_s")
        if isinstance(per_rank, Mapping):
            values = {}
            for r, v in per_rank.items():
                rank, seconds = _int(r), _num(v)
                if rank is not None and rank >= 0 and seconds is not None:
                    values[rank] = seconds
            begin = prev if prev is not None else t - 1.0
            columns.append((begin, t, values, _num(e.get("compute_median_s"))))
            total = max(total, _int(e.get("ranks_total")) or 0)
        prev = t
    ranks = sorted({r for _, _, v, _ in columns for r in v})
    if not ranks:
        return Heatmap([], [], [])
    edges = [columns[0][0]]
    cells: list[dict[int, float]] = []
    medians: list[float | None] = []
    for begin, end, values, median in columns:
        if begin > edges[-1] + 1e-9:  # an interval without rank_compute_s: a blank column
            edges.append(begin)
            cells.append({})
            medians.append(None)
        edges.append(end)
        cells.append(values)
        medians.append(median)
    # Partial: the events give the job's rank count and no interval holds that many.
    partial = total > max(len(v) for v in cells)
    return Heatmap(ranks, edges, cells, max(total, len(ranks)), partial, medians)


# --- the page ---------------------------------------------------------------------------------


def _summary_rows(result: Mapping[str, Any] | None, g: Goodput, tl: Timeline) -> list[tuple]:
    rows: list[tuple[str, str]] = []
    r = result or {}
    if result is not None:
        rows.append(("status", str(r.get("status", "?"))))
        rows.append(("steps", f"{r.get('steps_completed', '?')} / {r.get('total_steps', '?')}"))
        if _num(r.get("final_loss")) is not None:
            rows.append(("final loss", f"{r['final_loss']:.4f}"))
        if _num(r.get("wall_seconds")) is not None:
            rows.append(("wall time", f"{r['wall_seconds']:.1f} s"))
        if _num(r.get("training_seconds")) is not None:
            rows.append(("training time", f"{r['training_seconds']:.1f} s"))
        if _num(r.get("steps_per_second")) is not None:
            rows.append(("throughput", f"{r['steps_per_second']:.2f} steps/s"))
        rows.append(("failures", str(len(_list(r.get("failures"))))))
        rows.append(("restarts", str(r.get("restarts", "?"))))
        rows.append(("generations", str(r.get("generations", "?"))))
        rows.append(("steps redone", str(r.get("lost_steps_total", "?"))))
        ck = r.get("checkpoint") or {}
        if _num(ck.get("capture_ms_mean")) is not None:
            snapshots = f"{ck.get('snapshots', '?')}, {ck['capture_ms_mean']:.2f} ms on the step"
            rows.append(("snapshots", snapshots))
        ps = r.get("persist") or {}
        if ps:
            failed = f", {ps['failures']} failed" if ps.get("failures") else ""
            where = f"{len(_list(ps.get('persisted')))} to {ps.get('uri', '?')}{failed}"
            rows.append(("durable checkpoints", where))
        err = r.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            rows.append(("error", str(err["message"])))
    else:
        rows.append(("status", "unknown: no result.json (the run did not finish)"))
        steps = [s for s in tl.steps if s is not None]
        if steps:
            rows.append(("newest step seen", str(max(steps))))
        rows.append(("failures seen", str(len(tl.recoveries))))
    if g.whole_job is not None:
        text = f"{g.whole_job:.1%}: productive / wall from the job's first event to its end"
        rows.append(("goodput, whole job (incl. start-up)", text))
    if g.from_exporter:
        text = f"{g.since_running:.1%}: result.json's goodput (the exporter's productive / wall)"
        rows.append(("goodput since RUNNING (the exporter's)", text))
    elif g.since_running is not None:
        text = f"{g.since_running:.1%}: from the events (result.json has no goodput)"
        rows.append(("goodput since RUNNING (estimated)", text))
    return rows


def _failure_rows(result: Mapping[str, Any] | None) -> list[list[str]]:
    out = []
    for f in _list((result or {}).get("failures")):
        if not isinstance(f, Mapping):
            continue
        out.append(
            [
                str(f.get("kind", "?")),
                str(f.get("rank", "?")),
                str(f.get("step", "?")),
                _secs(_num(f.get("detected_after_s"))),
                _secs(_num(f.get("recovered_after_s"))),
                str(f.get("steps_redone", "?")),
                str(f.get("message") or ""),
            ]
        )
    return out


def render_html(
    name: str,
    result: Mapping[str, Any] | None,
    g: Goodput,
    tl: Timeline,
    images: list[tuple[str, str]],
    notes: list[str],
) -> str:
    e = html.escape
    status = str((result or {}).get("status", "did not finish"))
    title = f"stalwart report: {name} ({status})"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1340px;margin:1em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:.5em 0 1em}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top}"
        "th{background:#f4f4f4}figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}"
        "figcaption{color:#444;max-width:1100px}.warn{color:#a04000}</style>",
        "</head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    for w in notes:
        out.append(f'<p class="warn">{e(w)}</p>')
    out.append("<table>")
    for k, v in _summary_rows(result, g, tl):
        out.append(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>")
    out.append("</table>")
    failures = _failure_rows(result)
    if failures:
        head = ("kind", "rank", "step", "detected after", "recovered after", "redone", "message")
        out.append("<h2>Failures</h2><table><tr>")
        out.extend(f"<th>{e(h)}</th>" for h in head)
        out.append("</tr>")
        for row in failures:
            out.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
        out.append("</table>")
    for file, caption in images:
        out.append(
            f'<figure><img src="{e(file, quote=True)}" alt="{e(file, quote=True)}">'
            f"<figcaption>{e(caption)}</figcaption></figure>"
        )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --- the whole report -------------------------------------------------------------------------


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the figures and index.html for RUN_DIR to `out_dir` (default RUN_DIR/report)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out}: cannot create the report directory ({e})") from e
    result = run.result
    name = str((result or {}).get("name") or run.run_dir.name)
    from orchestrator.observe import figures  # matplotlib: only to draw

    redone = _int((result or {}).get("lost_steps_total"))
    exporter = _num((result or {}).get("goodput"))
    tl = timeline(run.events)
    g = goodput(run.events, redone, exporter)
    hm = heatmap(run.events)
    report = Report(out_dir=out, warnings=list(run.warnings))
    plots = {
        "timeline.png": lambda p: figures.plot_timeline(tl, name, p),
        "step_time_heatmap.png": lambda p: figures.plot_heatmap(hm, tl, name, p),
        "recovery_phases.png": lambda p: figures.plot_recovery_phases(tl, name, p),
        "checkpoints.png": lambda p: figures.plot_checkpoints(tl, result, name, p),
        "goodput.png": lambda p: figures.plot_goodput(g, name, p),
    }
    try:
        for file, _caption in figures.FIGURES:
            report.files.append(plots[file](out / file))
        page = render_html(name, result, g, tl, list(figures.FIGURES), report.warnings)
        index = out / "index.html"
        index.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{out}: cannot write the report ({e})") from e
    report.files.append(index)
    return report


# --- small helpers ----------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def _list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list | tuple) else []


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"

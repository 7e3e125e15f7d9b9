"""`stalwart report RUN_DIR`: PNG figures and one HTML page from a finished (or killed) run.

Reads RUN_DIR/events.jsonl (required) and RUN_DIR/result.json (optional: a run killed mid-way
has none) and writes to RUN_DIR/report/ (or `out_dir`):

- timeline.png: loss and steps/s over time, faults and failures (red), recoveries (green
  spans), stragglers, cordons, GPU faults and durable checkpoints;
- step_time_heatmap.png: each rank's median compute seconds per step over time;
- recovery_phases.png: one stacked bar per recovery, its phases in seconds;
- checkpoints.png: snapshot cost on the step, durable write seconds, commit lag;
- goodput.png: the wall time split into productive, recovering, redone and start-up time;
- index.html: the figures with captions and a summary table.

The computations (`timeline`, `goodput`, `heatmap`) are pure functions of the event list,
apart from the plotting, so they can be tested on small synthetic lists. Nothing here needs
Ray or a running job. See docs/report.md for how to read the figures.
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

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

DPI = 110
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
PHASES = ("detect", "decide", "abort", "replace", "rendezvous", "reenter", "restore", "first_step")
PHASE_COLORS = (
    "#d62728",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#1f77b4",
    "#17becf",
    "#9467bd",
    "#2ca02c",
)
FAULT_COLOR = "#d62728"
RECOVERY_COLOR = "#2ca02c"
STRAGGLER_COLOR = "#ff7f0e"
CORDON_COLOR = "#9467bd"
GPU_COLOR = "#8b0000"
PERSIST_COLOR = "#1f77b4"
NOTE_COLOR = "#555555"
FIGURES = (
    (
        "timeline.png",
        "Loss and training rate over time. Red lines: injected faults (solid) and other "
        "failures (dashed), labelled with kind and rank; green spans: recoveries from the "
        "failure to the first step after the restore (duration labelled); blue triangles: "
        "durable checkpoints; orange/purple: stragglers, cordons; grey: start-up before the "
        "first generation ran.",
    ),
    (
        "step_time_heatmap.png",
        "Top: each rank's median compute time per step (collective waits excluded) in each "
        "~1 s throughput interval. Bottom: the same over the other ranks' median (the "
        "straggler score): a slow rank is a red row. Grey: no step in that interval.",
    ),
    (
        "recovery_phases.png",
        "Where each recovery's time went, from the failure to the first step after the "
        "restore: detect, decide, abort the survivors, replace the lost ranks, rendezvous, "
        "re-enter the train loop, restore the checkpoint, the first step.",
    ),
    (
        "checkpoints.png",
        "Checkpoint costs: the in-memory snapshot's time on the training step (run mean), "
        "each durable checkpoint's write time, and the commit lag (steps a node loss would "
        "redo) over time.",
    ),
    (
        "goodput.png",
        "Where the wall time went. Goodput = productive / wall: productive leaves out the "
        "start-up, the time spent recovering and the time of steps trained again.",
    ),
)


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
    if not path.is_file():
        raise ReportError(
            f"{path}: missing (expected one JSON event per line, written by stalwart run)"
        )
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
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                skipped.append(number)
                continue
            ts = _num(event.get("ts"))
            if ts is None:
                skipped.append(number)
                continue
            event["ts"] = ts
            events.append(event)
    if not events:
        if skipped:
            raise ReportError(
                f"{path}: none of its {len(skipped)} line(s) is a JSON event with a numeric ts "
                f"and a type (first bad line: {skipped[0]})"
            )
        raise ReportError(f"{path}: empty (expected one JSON event per line)")
    events.sort(key=lambda e: (e["ts"], _num(e.get("seq")) or 0))
    warnings = []
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        warnings.append(
            f"{path.name}: skipped {len(skipped)} malformed line(s) (line {shown}); "
            "expected a JSON object with ts and type on each line"
        )
    result = None
    rpath = run / "result.json"
    if rpath.is_file():
        try:
            result = json.loads(rpath.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportError(f"{rpath}: not valid JSON ({e}); expected the run's summary") from e
        if not isinstance(result, dict):
            raise ReportError(f"{rpath}: expected a JSON object (the run's summary)")
    else:
        warnings.append("no result.json: the run did not finish")
    return RunData(run, events, result, skipped, warnings)


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
            if new in TERMINAL:
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
    """The job's wall time split up (seconds). `goodput` = productive / wall (None without
    state events); `running_goodput` leaves out the start-up like the exporter's
    stalwart_productive_seconds_total / stalwart_wall_seconds_total."""

    wall_s: float
    startup_s: float  # before the first RUNNING: scheduling, preflight, ...
    recovering_s: float  # in state RECOVERING
    redone_s: float  # redone steps x the median step time
    productive_s: float
    redone_steps: int
    step_time_s: float | None  # the median step time (1 / median steps per second)
    goodput: float | None
    running_goodput: float | None
    known: bool = True  # False: no state event says when the job ran


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


def goodput(events: list[Mapping[str, Any]], redone: int | None = None) -> Goodput:
    """Split the job's wall time (its first event to its end state, or to the last event)
    like orchestrator/metrics.py's `_goodput`: recovering = time in state RECOVERING,
    redone = `redone` steps (default: estimated from the events) x the median step time,
    productive = the rest after the start-up (before the first RUNNING)."""
    if not events:
        return Goodput(0, 0, 0, 0, 0, 0, None, None, None, known=False)
    start = job_start(events)
    end = max(e["ts"] for e in events)
    first_running = None
    recovering = 0.0
    since = None
    states = [e for e in events if e["type"] == "state"]
    for e in states:
        new = e.get("new")
        if new == "RUNNING" and first_running is None:
            first_running = e["ts"]
        if new == "RECOVERING" and since is None:
            since = e["ts"]
        elif new != "RECOVERING" and since is not None:
            recovering += e["ts"] - since
            since = None
        if new in TERMINAL:
            end = e["ts"]
            break
    if since is not None:
        recovering += end - since
    wall = max(0.0, end - start)
    step_time = median_step_time(events)
    steps = redone_steps(events) if redone is None else max(0, int(redone))
    if not states:
        return Goodput(wall, 0, 0, 0, 0, steps, step_time, None, None, known=False)
    if first_running is None:  # never ran: all of it was start-up
        return Goodput(wall, wall, 0, 0, 0, steps, step_time, 0.0 if wall else None, None)
    startup = first_running - start
    running = max(0.0, end - first_running)
    redone_s = min(steps * (step_time or 0.0), max(0.0, running - recovering))
    productive = max(0.0, running - recovering - redone_s)
    return Goodput(
        wall_s=wall,
        startup_s=startup,
        recovering_s=recovering,
        redone_s=redone_s,
        productive_s=productive,
        redone_steps=steps,
        step_time_s=step_time,
        goodput=productive / wall if wall > 0 else None,
        running_goodput=productive / running if running > 0 else None,
    )


@dataclass
class Heatmap:
    ranks: list[int]
    edges: list[float]  # len(columns) + 1 time edges, seconds since the job started
    values: list[list[float]]  # [rank row][column], NaN where the rank made no step

    def relative(self) -> list[list[float]]:
        """Each value over the median of the other ranks' in its column (the straggler
        score's measure: 1 is normal, 2 twice as slow); NaN without two ranks to compare."""
        out = [[math.nan] * len(row) for row in self.values]
        for c in range(len(self.edges) - 1):
            column = [(r, row[c]) for r, row in enumerate(self.values) if not math.isnan(row[c])]
            for r, v in column:
                peers = [w for q, w in column if q != r]
                if peers and statistics.median(peers) > 0:
                    out[r][c] = v / statistics.median(peers)
        return out


def heatmap(events: list[Mapping[str, Any]]) -> Heatmap:
    """Ranks x throughput intervals of median compute seconds per step. Each throughput
    event covers the time since the previous one; events without rank_compute_s (runs
    before it was recorded) are left out."""
    if not events:
        return Heatmap([], [], [])
    t0 = job_start(events)
    columns: list[tuple[float, float, dict[int, float]]] = []
    prev: float | None = None
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
            columns.append((begin, t, values))
        prev = t
    ranks = sorted({r for _, _, v in columns for r in v})
    if not ranks:
        return Heatmap([], [], [])
    ranks = list(range(max(ranks) + 1))
    edges = [columns[0][0]]
    cells: list[dict[int, float]] = []
    for begin, end, values in columns:
        if begin > edges[-1] + 1e-9:  # an interval without rank_compute_s: a blank column
            edges.append(begin)
            cells.append({})
        edges.append(end)
        cells.append(values)
    return Heatmap(ranks, edges, [[c.get(r, math.nan) for c in cells] for r in ranks])


# --- plotting helpers -------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png", facecolor="white")
    fig.clear()
    return path


def _tex(text: Any) -> str:
    """User text for matplotlib: no mathtext from a `$` in a job name."""
    return str(text).replace("$", r"\$")


def _no_data(ax: Any, message: str) -> None:
    ax.text(
        0.5,
        0.5,
        _tex(message),
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=10,
        color=NOTE_COLOR,
        wrap=True,
        bbox={"boxstyle": "round", "facecolor": "#f4f4f4", "edgecolor": "#cccccc"},
    )


def _stagger(
    ax: Any,
    items: list[tuple[float, str, str]],
    xlim: tuple[float, float],
    base: float = 0.97,
    direction: int = -1,
    levels: int = 5,
    fontsize: float = 8,
) -> int:
    """Label vertical markers (x, text, colour) on `ax` without overlaps: each label goes on
    the first row where it does not overlap another, rows starting at `base` (axes fraction)
    and going down (direction -1) or up (+1) a line at a time; a label near the right edge
    ends at its marker instead of starting there. Returns the rows used."""
    if not items:
        return 0
    x0, x1 = xlim
    span = (x1 - x0) or 1.0
    width_pts = ax.get_figure().get_figwidth() * 72 * ax.get_position().width
    per_char = span * fontsize * 0.62 / max(width_pts, 1.0)
    rows: list[list[tuple[float, float]]] = [[] for _ in range(levels)]
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    line = fontsize * 1.75  # points between rows
    for x, text, color in sorted(items):
        width = (max(len(t) for t in text.splitlines()) + 2) * per_char
        left, right, ha = x, x + width, "left"
        if right > x1:
            left, right, ha = x - width, x, "right"
        chosen = None
        for i, row in enumerate(rows):
            if all(right < a or left > b for a, b in row):
                chosen = i
                break
        if chosen is None:  # all rows busy here: the row whose last label ends first
            chosen = min(range(levels), key=lambda i: max((b for _, b in rows[i]), default=0))
        rows[chosen].append((left, right))
        ax.annotate(
            _tex(text),
            xy=(x, base),
            xycoords=trans,
            xytext=(2 if ha == "left" else -2, direction * chosen * line),
            textcoords="offset points",
            ha=ha,
            va="top" if direction < 0 else "bottom",
            fontsize=fontsize,
            color=color,
            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.85, "lw": 0},
            annotation_clip=False,
            zorder=6,
        )
    return sum(1 for row in rows if row)


_MARKER_STYLE = {
    "fault": (FAULT_COLOR, "-"),
    "failure": (FAULT_COLOR, "--"),
    "straggler": (STRAGGLER_COLOR, ":"),
    "cordon": (CORDON_COLOR, ":"),
    "gpu": (GPU_COLOR, "-."),
    "resize": (NOTE_COLOR, ":"),
}


def _draw_events(ax: Any, tl: Timeline, spans: bool = True) -> None:
    """Failure markers, recovery spans and the start-up shade on one axes (no labels)."""
    if tl.first_running:
        ax.axvspan(0, tl.first_running, color="#dddddd", alpha=0.5, lw=0, zorder=0)
    if spans:
        for r in tl.recoveries:
            color = RECOVERY_COLOR if r.outcome == "recovered" else FAULT_COLOR
            ax.axvspan(r.start, max(r.end, r.start + 1e-3), color=color, alpha=0.25, lw=0)
    for m in tl.markers:
        color, style = _MARKER_STYLE.get(m.kind, (NOTE_COLOR, ":"))
        ax.axvline(m.t, color=color, ls=style, lw=1.3, zorder=4)


def _event_handles(tl: Timeline, checkpoints: bool = True) -> list[Any]:
    """Legend entries for what `_draw_events` (and, with `checkpoints`, the timeline's
    checkpoint ticks) drew: only what is there."""
    kinds = {m.kind for m in tl.markers}
    entries = [
        (
            "fault" in kinds,
            Line2D([], [], color=FAULT_COLOR, label="injected fault (kind, rank, @step)"),
        ),
        (
            "failure" in kinds,
            Line2D([], [], color=FAULT_COLOR, ls="--", label="failure (kind, rank)"),
        ),
        (
            any(r.outcome == "recovered" for r in tl.recoveries),
            Patch(color=RECOVERY_COLOR, alpha=0.35, label="recovery: failure → first step"),
        ),
        (
            any(r.outcome != "recovered" for r in tl.recoveries),
            Patch(color=FAULT_COLOR, alpha=0.35, label="recovery that did not end"),
        ),
        (bool(tl.first_running), Patch(color="#dddddd", label="start-up (before RUNNING)")),
        (
            "straggler" in kinds,
            Line2D([], [], color=STRAGGLER_COLOR, ls=":", label="straggler flagged"),
        ),
        ("cordon" in kinds, Line2D([], [], color=CORDON_COLOR, ls=":", label="node cordoned")),
        ("gpu" in kinds, Line2D([], [], color=GPU_COLOR, ls="-.", label="GPU fault")),
        ("resize" in kinds, Line2D([], [], color=NOTE_COLOR, ls=":", label="world resized")),
        (
            checkpoints and bool(tl.persisted),
            Line2D([], [], color=PERSIST_COLOR, marker="v", ls="", label="durable checkpoint"),
        ),
        (
            checkpoints and bool(tl.persist_failed),
            Line2D([], [], color=FAULT_COLOR, marker="x", ls="", label="durable write failed"),
        ),
    ]
    return [handle for shown, handle in entries if shown]


def _xlim(tl: Timeline) -> tuple[float, float]:
    return (0.0, max(tl.end, max(tl.times, default=0.0), 1.0) * 1.01)


# --- figures ----------------------------------------------------------------------------------


def plot_timeline(tl: Timeline, name: str, path: Path) -> Path:
    fig = _new_figure(12, 7.5)
    ax_loss, ax_rate = fig.subplots(2, 1, sharex=True, height_ratios=(1.1, 1))
    xlim = _xlim(tl)
    fig.suptitle(_tex(f"{name}: loss and throughput over time"), fontsize=13, weight="bold")

    for ax in (ax_loss, ax_rate):
        _draw_events(ax, tl)
        ax.grid(alpha=0.3)
    if tl.has_loss:
        pts = [(t, v) for t, v in zip(tl.times, tl.loss, strict=True) if v is not None]
        ax_loss.plot(*zip(*pts, strict=True), color="black", lw=1.4, marker=".", ms=3)
        lo = min(v for _, v in pts)
        hi = max(v for _, v in pts)
        pad = (hi - lo) * 0.1 or 0.1
        # Head room for the failure labels above the curve.
        ax_loss.set_ylim(lo - pad, hi + (hi - lo + pad) * 0.9)
    else:
        _no_data(
            ax_loss,
            "no loss in the throughput events\n(a run recorded before loss was logged, or a "
            "train loop that reports none)",
        )
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title("training loss", fontsize=10, loc="left")

    rates = [(t, v) for t, v in zip(tl.times, tl.steps_per_s, strict=True) if v is not None]
    top_labels: list[tuple[float, str, str]] = []
    if rates:
        ax_rate.plot(*zip(*rates, strict=True), color="#1f4e79", lw=1.4, drawstyle="steps-pre")
        # A lone interval far above the rest (a rate measured across a generation change)
        # would flatten the curve: the axis stops at 3x the median, those points are noted.
        cap = max(3 * statistics.median(v for _, v in rates), 1e-3)
        top = max(v for _, v in rates)
        if top > cap:
            top = cap
            top_labels += [
                (t, f"↑ {v:.0f} steps/s (off scale)", "#1f4e79") for t, v in rates if v > cap
            ]
        ax_rate.set_ylim(0, top * 1.6 or 1)
    else:
        _no_data(ax_rate, "no throughput events in this run")
    ax_rate.set_ylabel("training rate (steps/s)")
    ax_rate.set_xlabel("seconds since the job started")
    ax_rate.set_title("steps per second (each ~1 s interval)", fontsize=10, loc="left")
    ax_rate.set_xlim(*xlim)
    trans = blended_transform_factory(ax_rate.transData, ax_rate.transAxes)
    for p in tl.persisted:
        ax_rate.plot([p["t"]], [0.985], marker="v", color=PERSIST_COLOR, ms=7, transform=trans)
        if p["step"] is not None:
            top_labels.append((p["t"], f"ckpt {p['step']}", PERSIST_COLOR))
    for p in tl.persist_failed:
        ax_rate.plot([p["t"]], [0.985], marker="x", color=FAULT_COLOR, ms=7, transform=trans)

    fig.canvas.draw()  # positions for the label layout
    _stagger(
        ax_loss,
        [
            (m.t, m.label, _MARKER_STYLE.get(m.kind, (NOTE_COLOR, ""))[0])
            for m in tl.markers
            if m.t <= xlim[1]
        ],
        xlim,
    )
    _stagger(ax_rate, top_labels, xlim, base=0.94, levels=2, fontsize=7)
    _stagger(
        ax_rate,
        [
            (
                r.start,
                f"{'recovered' if r.outcome == 'recovered' else r.outcome} in {_secs(r.duration)}",
                RECOVERY_COLOR if r.outcome == "recovered" else FAULT_COLOR,
            )
            for r in tl.recoveries
        ],
        xlim,
        base=0.03,
        direction=1,
        levels=3,
    )
    handles = _event_handles(tl)
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=max(1, min(4, len(handles))),
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


def plot_heatmap(hm: Heatmap, tl: Timeline, name: str, path: Path) -> Path:
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, NullLocator

    xlim = _xlim(tl)
    if not hm.ranks:
        fig = _new_figure(12, 3.2)
        ax = fig.subplots()
        fig.suptitle(_tex(f"{name}: step time per rank"), fontsize=13, weight="bold")
        _no_data(
            ax,
            "no per-rank step times in the throughput events\n(runs recorded before "
            "rank_compute_s was logged have none)",
        )
        ax.set_yticks([])
        ax.set_xlim(*xlim)
        ax.set_xlabel("seconds since the job started")
        ax.set_ylabel("rank")
        return _save(fig, path)
    fig = _new_figure(12, max(5.0, 2.6 + 0.5 * len(hm.ranks)))
    ax_abs, ax_rel = fig.subplots(2, 1, sharex=True)
    fig.suptitle(_tex(f"{name}: step time per rank"), fontsize=13, weight="bold")
    data = np.array(hm.values, dtype=float)
    finite = data[np.isfinite(data)]
    ms = finite.size == 0 or float(np.nanmax(finite)) < 1.0
    scale, unit = (1000.0, "ms") if ms else (1.0, "s")
    # The colour scale ends at the 98th percentile: one odd interval does not wash out the rest.
    vmax = float(np.percentile(finite, 98)) * scale if finite.size else 1.0
    x = np.array(hm.edges)
    y = np.arange(len(hm.ranks) + 1) - 0.5
    cmap = _colormap("viridis", bad="#d9d9d9")
    mesh = ax_abs.pcolormesh(
        x, y, np.ma.masked_invalid(data * scale), cmap=cmap, vmin=0, vmax=vmax or 1.0
    )
    bar = fig.colorbar(mesh, ax=ax_abs, pad=0.01, extend="max")
    bar.set_label(f"{unit} per step")
    rel = np.array(hm.relative(), dtype=float)
    cmap = _colormap("RdBu_r", bad="#d9d9d9")
    mesh = ax_rel.pcolormesh(
        x, y, np.ma.masked_invalid(rel), cmap=cmap, norm=LogNorm(vmin=1 / 3, vmax=3)
    )
    bar = fig.colorbar(mesh, ax=ax_rel, pad=0.01, extend="both")
    ticks = [1 / 3, 1 / 2, 1, 2, 3]
    bar.ax.yaxis.set_major_locator(FixedLocator(ticks))
    bar.ax.yaxis.set_minor_locator(NullLocator())
    bar.ax.set_yticklabels(["⅓x", "½x", "1x", "2x", "3x"])
    bar.set_label("x peers' median")
    for ax in (ax_abs, ax_rel):
        ax.set_yticks(hm.ranks)
        ax.set_yticklabels([str(r) for r in hm.ranks])
        ax.set_ylim(len(hm.ranks) - 0.5, -0.5)  # rank 0 on top
        ax.set_ylabel("rank")
        for m in tl.markers:
            if m.kind in ("fault", "failure", "straggler"):
                color, style = _MARKER_STYLE[m.kind]
                ax.axvline(m.t, color="white", lw=2.6, zorder=3)
                ax.axvline(m.t, color=color, ls=style, lw=1.4, zorder=4)
    ax_rel.set_xlim(*xlim)
    ax_rel.set_xlabel("seconds since the job started")
    ax_rel.set_title(
        "the same, relative to the other ranks' median in the interval (red: slower than its "
        "peers, blue: faster; the straggler score)",
        fontsize=9,
        loc="left",
    )
    fig.canvas.draw()
    used = _stagger(
        ax_abs,
        [
            (m.t, m.label, _MARKER_STYLE[m.kind][0])
            for m in tl.markers
            if m.kind in ("fault", "failure", "straggler")
        ],
        xlim,
        base=1.0,
        direction=1,
        levels=3,
    )
    ax_abs.set_title(
        "each rank's median compute time per step (collective waits excluded) in each ~1 s "
        "interval; grey: no step in the interval",
        fontsize=9,
        loc="left",
        pad=6 + used * 8 * 1.75,
    )
    return _save(fig, path)


def plot_recovery_phases(tl: Timeline, name: str, path: Path) -> Path:
    recs = tl.recoveries
    fig = _new_figure(12, max(3.4, 2.2 + 0.55 * len(recs)))
    ax = fig.subplots()
    fig.suptitle(_tex(f"{name}: recovery phases per failure"), fontsize=13, weight="bold")
    ax.set_xlabel("seconds from the failure to the first step after the restore")
    if not recs:
        _no_data(ax, "no failures and recoveries in this run")
        ax.set_yticks([])
        return _save(fig, path)
    labels = []
    widest = 0.0
    segments: list[tuple[float, float, str]] = []
    bar_segments: dict[int, list[tuple[float, float, str]]] = {}
    for i, r in enumerate(recs):
        left = 0.0
        segments.clear()
        if r.phases:
            for phase, color in zip(PHASES, PHASE_COLORS, strict=True):
                width = r.phases.get(phase) or 0.0
                if width > 0:
                    ax.barh(i, width, left=left, color=color, edgecolor="white", lw=0.5)
                    segments.append((left, width, phase))
                    left += width
            total = f"Σ {_secs(left)}"
            if not r.detect_known:
                total += " (detect unknown: not injected)"
        else:
            left = r.duration
            ax.barh(i, left, color="#bbbbbb", hatch="//", edgecolor="#777777")
            total = f"{r.outcome} after {_secs(left)} (no phases)"
        widest = max(widest, left)
        bar_segments[i] = list(segments)
        ax.annotate(
            _tex(total),
            xy=(left, i),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
        where = f"gen {r.generation}" if r.generation is not None else r.outcome
        restored = f", restored step {r.restore_step}" if r.restore_step is not None else ""
        labels.append(f"#{i + 1} {r.label}\nt={r.start:.1f} s, {where}{restored}")
    ax.set_yticks(range(len(recs)))
    ax.set_yticklabels([_tex(x) for x in labels], fontsize=8)
    ax.set_ylim(len(recs) - 0.5, -0.5)
    ax.set_xlim(0, max(widest, 1e-3) * 1.35)
    # The seconds of each phase inside its segment, where the segment is wide enough.
    for i, segs in bar_segments.items():
        for left, width, _phase in segs:
            if width >= widest * 1.35 * 0.045:
                ax.text(
                    left + width / 2,
                    i,
                    _secs(width),
                    ha="center",
                    va="center",
                    fontsize=7.5,
                    color="white",
                    weight="bold",
                )
    ax.grid(axis="x", alpha=0.3)
    fig.legend(
        handles=[
            Patch(color=c, label=p.replace("_", " "))
            for p, c in zip(PHASES, PHASE_COLORS, strict=True)
        ],
        loc="outside lower center",
        ncol=len(PHASES),
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


def plot_checkpoints(tl: Timeline, result: Mapping[str, Any] | None, name: str, path: Path):
    fig = _new_figure(12, 9)
    ax_snap, ax_persist, ax_lag = fig.subplots(3, 1, height_ratios=(0.7, 1, 1))
    ax_lag.sharex(ax_persist)
    fig.suptitle(_tex(f"{name}: checkpoint costs"), fontsize=13, weight="bold")
    xlim = _xlim(tl)
    # Room on the right for the label of a checkpoint written at the very end.
    xlim = (xlim[0], xlim[1] + 0.04 * (xlim[1] - xlim[0]))

    ck = (result or {}).get("checkpoint") or {}
    parts = [
        ("capture (training thread)", _num(ck.get("capture_ms_mean"))),
        ("wait (training thread, backpressure)", _num(ck.get("wait_ms_mean"))),
        ("handover (background)", _num(ck.get("handover_ms_mean"))),
    ]
    if any(v is not None for _, v in parts):
        shown = [(k, v or 0.0) for k, v in parts]
        ax_snap.barh(
            range(len(shown)),
            [v for _, v in shown],
            color=["#d62728", "#ff7f0e", "#7f7f7f"],
        )
        top = max(v for _, v in shown) or 1.0
        for i, (_, v) in enumerate(shown):
            ax_snap.annotate(
                f"{v:.2f} ms",
                xy=(v, i),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=9,
            )
        ax_snap.set_yticks(range(len(shown)))
        ax_snap.set_yticklabels([k for k, _ in shown], fontsize=9)
        ax_snap.set_ylim(len(shown) - 0.5, -0.5)
        ax_snap.set_xlim(0, top * 1.25)
        mb = _num(ck.get("bytes_per_snapshot"))
        extra = f"{ck.get('snapshots', '?')} snapshots" + (
            f" of {mb / 1e6:.2f} MB per rank" if mb else ""
        )
        ax_snap.set_title(
            f"in-memory snapshot, mean per snapshot ({extra}; only capture + wait slow the step)",
            fontsize=10,
            loc="left",
        )
    else:
        ax_snap.set_title("in-memory snapshot cost", fontsize=10, loc="left")
        _no_data(
            ax_snap,
            "no snapshot statistics"
            + (" (no result.json: the run did not finish)" if result is None else ""),
        )
        ax_snap.set_yticks([])
    ax_snap.set_xlabel("milliseconds per snapshot")
    ax_snap.grid(axis="x", alpha=0.3)

    _draw_events(ax_persist, tl, spans=True)
    ax_persist.set_title(
        "durable checkpoints: seconds to write each one (shards, then the manifest), drawn when "
        "it completed",
        fontsize=10,
        loc="left",
    )
    if tl.persisted or tl.persist_failed:
        ts = [p["t"] for p in tl.persisted]
        secs = [p["seconds"] or 0.0 for p in tl.persisted]
        width = max(0.6, (xlim[1] - xlim[0]) / 150)
        ax_persist.bar(ts, secs, width=width, color=PERSIST_COLOR, label="persisted", zorder=5)
        top = max(secs, default=0.0) or 1.0
        for p, s in zip(tl.persisted, secs, strict=True):
            mb = f", {p['bytes'] / 1e6:.0f} MB" if p["bytes"] else ""
            ax_persist.annotate(
                f"step {p['step']}{mb}\n{s:.2f} s",
                xy=(p["t"], s),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.85, "lw": 0},
                zorder=6,
            )
        if tl.persist_failed:
            ax_persist.plot(
                [p["t"] for p in tl.persist_failed],
                [0] * len(tl.persist_failed),
                "x",
                color=FAULT_COLOR,
                ms=9,
                mew=2,
                label="write failed",
                clip_on=False,
            )
        ax_persist.set_ylim(0, top * 1.45)
        ax_persist.legend(loc="upper left", fontsize=8)
    else:
        uri = ((result or {}).get("persist") or {}).get("uri")
        _no_data(
            ax_persist,
            "no durable checkpoint written"
            + (f" (to {uri})" if uri else " (checkpoint.persist.uri not set)"),
        )
    ax_persist.set_ylabel("write time (s)")
    ax_persist.grid(alpha=0.3)
    ax_persist.tick_params(labelbottom=True)

    _draw_events(ax_lag, tl, spans=True)
    # A lag below 0 (the committed step read before the newest step caught up) is drawn as 0.
    lag = [(t, max(0.0, v)) for t, v in zip(tl.times, tl.commit_lag, strict=True) if v is not None]
    ax_lag.set_title(
        "commit lag: steps from the committed step to the newest (what a node loss redoes)",
        fontsize=10,
        loc="left",
    )
    if lag:
        ax_lag.plot(*zip(*lag, strict=True), color="#444444", lw=1.3, drawstyle="steps-pre")
        top = max(max(v for _, v in lag) * 1.2, 1)
        ax_lag.set_ylim(-0.04 * top, top)  # a lag of 0 stays visible above the axis
        ax_lag.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _no_data(ax_lag, "no commit lag in the throughput events")
    ax_lag.set_ylabel("commit lag (steps)")
    ax_lag.set_xlabel("seconds since the job started")
    ax_lag.set_xlim(*xlim)
    ax_lag.grid(alpha=0.3)
    handles = _event_handles(tl, checkpoints=False)
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=max(1, min(4, len(handles))),
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


def plot_goodput(g: Goodput, name: str, path: Path) -> Path:
    fig = _new_figure(12, 4.2)
    ax = fig.subplots()
    if not g.known or g.goodput is None:
        fig.suptitle(_tex(f"{name}: goodput unknown"), fontsize=13, weight="bold")
        _no_data(
            ax,
            "no state events: the log does not say when the job ran"
            if not g.known
            else "the job never ran (no RUNNING state)",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return _save(fig, path)
    fig.suptitle(
        _tex(
            f"{name}: goodput {g.goodput:.1%} = productive {g.productive_s:.1f} s / "
            f"wall {g.wall_s:.1f} s"
        ),
        fontsize=13,
        weight="bold",
    )
    step = f"{g.step_time_s:.3f} s" if g.step_time_s else "unknown"
    parts = [
        ("productive", g.productive_s, "#2ca02c"),
        ("recovering (state RECOVERING)", g.recovering_s, "#d62728"),
        (f"redone steps ({g.redone_steps} x median step {step})", g.redone_s, "#ff7f0e"),
        ("start-up (before RUNNING)", g.startup_s, "#aaaaaa"),
    ]
    rows = [("whole job", g.wall_s, parts)]
    running = g.wall_s - g.startup_s
    if running > 0:
        rows.append(("since RUNNING\n(the exporter's view)", running, parts[:3]))
    for i, (_, total, segs) in enumerate(rows):
        left = 0.0
        small_right, below = -100.0, 0
        for _label, secs, color in segs:
            share = secs / total if total else 0.0
            ax.barh(i, share * 100, left=left, height=0.6, color=color, edgecolor="white")
            if share >= 0.06:
                ax.text(
                    left + share * 50,
                    i,
                    f"{share:.1%}\n{secs:.1f} s",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if color != "#aaaaaa" else "black",
                    weight="bold",
                )
            elif share > 0:  # too narrow for its label inside: below the bar, staggered
                text = f"{_label.split(' (')[0]} {share:.1%}"
                width = len(text) * 0.8  # in % of the axis at 8 pt on a 12 in figure
                center = left + share * 50
                # centred under its segment, but inside the axis at either end
                ha, start = "center", center - width / 2
                if center + width / 2 > 100:
                    ha, start = "right", center - width
                elif center - width / 2 < 0:
                    ha, start = "left", center
                below = 0 if start > small_right else below + 1
                small_right = max(small_right, start + width)
                ax.annotate(
                    text,
                    xy=(center, i + 0.3),
                    xytext=(0, -2 - 10 * below),
                    textcoords="offset points",
                    ha=ha,
                    va="top",
                    fontsize=8,
                    color=color if color != "#aaaaaa" else "black",
                )
            left += share * 100
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the wall time (%)")
    ax.set_title(
        f"second bar, without the start-up: goodput {g.running_goodput:.1%} since RUNNING "
        "(what the exporter's stalwart_productive / stalwart_wall seconds give)"
        if g.running_goodput is not None
        else "",
        fontsize=10,
        loc="left",
    )
    fig.legend(
        handles=[
            Patch(color=c, label=f"{label}: {secs:.1f} s ({secs / g.wall_s:.1%} of wall)")
            for label, secs, c in parts
        ],
        loc="outside lower center",
        ncol=2,
        fontsize=9,
        frameon=False,
    )
    return _save(fig, path)


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
            rows.append(
                (
                    "snapshots",
                    f"{ck.get('snapshots', '?')}, {ck['capture_ms_mean']:.2f} ms on the step",
                )
            )
        ps = r.get("persist") or {}
        if ps:
            rows.append(
                (
                    "durable checkpoints",
                    f"{len(_list(ps.get('persisted')))} to {ps.get('uri', '?')}"
                    + (f", {ps['failures']} failed" if ps.get("failures") else ""),
                )
            )
        err = r.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            rows.append(("error", str(err["message"])))
    else:
        rows.append(("status", "unknown: no result.json (the run did not finish)"))
        steps = [s for s in tl.steps if s is not None]
        if steps:
            rows.append(("newest step seen", str(max(steps))))
        rows.append(("failures seen", str(len(tl.recoveries))))
    if g.goodput is not None:
        rows.append(("goodput", f"{g.goodput:.1%} (productive / wall, see the figure)"))
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
    warnings: list[str],
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
    for w in warnings:
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
    redone = _int((result or {}).get("lost_steps_total"))
    tl = timeline(run.events)
    g = goodput(run.events, redone)
    hm = heatmap(run.events)
    report = Report(out_dir=out, warnings=list(run.warnings))
    plots = {
        "timeline.png": lambda p: plot_timeline(tl, name, p),
        "step_time_heatmap.png": lambda p: plot_heatmap(hm, tl, name, p),
        "recovery_phases.png": lambda p: plot_recovery_phases(tl, name, p),
        "checkpoints.png": lambda p: plot_checkpoints(tl, result, name, p),
        "goodput.png": lambda p: plot_goodput(g, name, p),
    }
    try:
        for file, _caption in FIGURES:
            report.files.append(plots[file](out / file))
        page = render_html(name, result, g, tl, list(FIGURES), report.warnings)
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


def _colormap(name: str, bad: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=bad)

"""The figures of `stalwart report` (matplotlib, Agg): one function per PNG, each drawing the
numbers that orchestrator/observe/report.py computes from a run's events. See docs/report.md for how
to read them."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator
from matplotlib.transforms import blended_transform_factory

from orchestrator.observe.report import PHASES, Goodput, Heatmap, Timeline, _num, _secs

DPI = 110
HEATMAP_ROWS = 64  # rank rows the heatmap draws at most: the most straggler-like when more
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
        "straggler score): a slow rank is a red row. Grey: no step in that interval (or, in "
        "a job of more than 64 ranks, not among the interval's slowest). Past 64 ranks, the "
        "64 most straggler-like are drawn.",
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
        "time spent recovering and the time of steps trained again. Top bar: the whole job, "
        "start-up included; bottom bar: since the first RUNNING, the exporter's goodput "
        "(result.json's, when it has one).",
    ),
)
FAULT_COLOR = "#d62728"
RECOVERY_COLOR = "#2ca02c"
STRAGGLER_COLOR = "#ff7f0e"
CORDON_COLOR = "#9467bd"
GPU_COLOR = "#8b0000"
PERSIST_COLOR = "#1f77b4"
NOTE_COLOR = "#555555"


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
    _legend_below(fig, handles)
    return _save(fig, path)


def _legend_below(fig: Figure, handles: list[Any]) -> None:
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=max(1, min(4, len(handles))),
        fontsize=8,
        frameon=False,
    )


def plot_heatmap(hm: Heatmap, tl: Timeline, name: str, path: Path) -> Path:
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
    shown = hm.slowest(HEATMAP_ROWS)
    data = hm.matrix(shown)
    rel = hm.relative(shown)
    n = len(shown)
    # 0.5 in per rank row for a few ranks, less for many: at most HEATMAP_ROWS rows are drawn,
    # so the figure stays well under Agg's limits (~1,900 px tall at most).
    fig = _new_figure(12, max(5.0, 2.6 + min(0.5 * n, 4 + 0.16 * n)))
    ax_abs, ax_rel = fig.subplots(2, 1, sharex=True)
    notes = []
    if n < len(hm.ranks):
        notes.append(
            f"showing the {n} slowest of {hm.ranks_total:,} ranks "
            "(by their relative time, the bottom panel)"
        )
    if hm.partial:
        logged = max(len(cells) for cells in hm.columns)
        against = (
            "the whole job's median"
            if any(m is not None for m in hm.medians)
            else "each other (an older run: no job-wide median logged)"
        )
        notes.append(
            f"each interval logs only its {logged} slowest of the {hm.ranks_total:,} ranks: grey "
            f"also means not among them; the relative time compares them with {against}"
        )
    fig.suptitle(_tex(f"{name}: step time per rank"), fontsize=13, weight="bold")
    finite = data[np.isfinite(data)]
    ms = finite.size == 0 or float(np.max(finite)) < 1.0
    scale, unit = (1000.0, "ms") if ms else (1.0, "s")
    # The colour scale ends at the 98th percentile: one odd interval does not wash out the rest.
    vmax = float(np.percentile(finite, 98)) * scale if finite.size else 1.0
    x = np.array(hm.edges)
    y = np.arange(n + 1) - 0.5
    cmap = _colormap("viridis", bad="#d9d9d9")
    mesh = ax_abs.pcolormesh(
        x, y, np.ma.masked_invalid(data * scale), cmap=cmap, vmin=0, vmax=vmax or 1.0
    )
    bar = fig.colorbar(mesh, ax=ax_abs, pad=0.01, extend="max")
    bar.set_label(f"{unit} per step")
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
        ax.set_yticks(range(n))
        ax.set_yticklabels([str(r) for r in shown], fontsize=10 if n <= 16 else 6.5)
        ax.set_ylim(n - 0.5, -0.5)  # the lowest rank on top
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
        "\n".join(
            [
                "each rank's median compute time per step (collective waits excluded) in each "
                "~1 s interval; grey: no step in the interval",
                *notes,
            ]
        ),
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
    _legend_below(fig, handles)
    return _save(fig, path)


def plot_goodput(g: Goodput, name: str, path: Path) -> Path:
    fig = _new_figure(12, 4.2)
    ax = fig.subplots()
    if not g.known or g.whole_job is None:
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
            f"{name}: goodput {g.whole_job:.1%} over the whole job, incl. start-up "
            f"(productive {g.productive_s:.1f} s / wall {g.wall_s:.1f} s)"
        ),
        fontsize=13,
        weight="bold",
    )
    if g.from_exporter:
        each = f", {g.redone_s / g.redone_steps:.3f} s each" if g.redone_steps else ""
        redone = f"redone steps ({g.redone_steps}{each}, as the exporter priced them)"
    else:
        step = f"{g.step_time_s:.3f} s" if g.step_time_s else "unknown"
        redone = f"redone steps ({g.redone_steps} x median step {step})"
    parts = [
        ("productive", g.productive_s, "#2ca02c"),
        ("recovering (failure to first step after restore)", g.recovering_s, "#d62728"),
        (redone, g.redone_s, "#ff7f0e"),
        ("start-up (before RUNNING)", g.startup_s, "#aaaaaa"),
    ]
    rows = [("whole job,\nincl. start-up", g.wall_s, parts)]
    running = g.wall_s - g.startup_s
    if running > 0:
        which = "the exporter's" if g.from_exporter else "estimated"
        rows.append((f"since RUNNING\n({which})", running, parts[:3]))
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
    if g.since_running is None:
        title = ""
    elif g.from_exporter:
        title = (
            f"second bar: goodput {g.since_running:.1%} since RUNNING, the exporter's "
            "(result.json's goodput: stalwart_productive / stalwart_wall seconds)"
        )
    else:
        title = (
            f"second bar: goodput {g.since_running:.1%} since RUNNING, estimated from the "
            "events (result.json has no goodput)"
        )
    ax.set_title(title, fontsize=10, loc="left")
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


def _colormap(name: str, bad: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=bad)

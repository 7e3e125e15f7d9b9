"""What the report's figures (orchestrator/observe/figures.py, figures_costs.py) draw alike:
a headless figure (matplotlib's Agg canvas, no display needed), its PNG, the colours of failures
and recoveries, their markers and spans on a time axis with a legend of only what is there, and
labels laid out so that they do not overlap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from stalwart.orchestrator.observe.analysis import Timeline

DPI = 110
FAULT_COLOR = "#d62728"
RECOVERY_COLOR = "#2ca02c"
STRAGGLER_COLOR = "#ff7f0e"
CORDON_COLOR = "#9467bd"
GPU_COLOR = "#8b0000"
PERSIST_COLOR = "#1f77b4"
NOTE_COLOR = "#555555"


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png", facecolor="white")
    fig.clear()
    return path


def tex(text: Any) -> str:
    """User text for matplotlib: no mathtext from a `$` in a job name."""
    return str(text).replace("$", r"\$")


def no_data(ax: Any, message: str) -> None:
    ax.text(
        0.5,
        0.5,
        tex(message),
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=10,
        color=NOTE_COLOR,
        wrap=True,
        bbox={"boxstyle": "round", "facecolor": "#f4f4f4", "edgecolor": "#cccccc"},
    )


def stagger_labels(
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
            tex(text),
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


MARKER_STYLE = {
    "fault": (FAULT_COLOR, "-"),
    "failure": (FAULT_COLOR, "--"),
    "straggler": (STRAGGLER_COLOR, ":"),
    "cordon": (CORDON_COLOR, ":"),
    "gpu": (GPU_COLOR, "-."),
    "resize": (NOTE_COLOR, ":"),
}


def draw_events(ax: Any, tl: Timeline, spans: bool = True) -> None:
    """Failure markers, recovery spans and the start-up shade on one axes (no labels)."""
    if tl.first_running:
        ax.axvspan(0, tl.first_running, color="#dddddd", alpha=0.5, lw=0, zorder=0)
    if spans:
        for r in tl.recoveries:
            color = RECOVERY_COLOR if r.outcome == "recovered" else FAULT_COLOR
            ax.axvspan(r.start, max(r.end, r.start + 1e-3), color=color, alpha=0.25, lw=0)
    for m in tl.markers:
        color, style = MARKER_STYLE.get(m.kind, (NOTE_COLOR, ":"))
        ax.axvline(m.t, color=color, ls=style, lw=1.3, zorder=4)


def event_handles(tl: Timeline, checkpoints: bool = True) -> list[Any]:
    """Legend entries for what `draw_events` (and, with `checkpoints`, the timeline's
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


def x_limits(tl: Timeline) -> tuple[float, float]:
    return (0.0, max(tl.end, max(tl.times, default=0.0), 1.0) * 1.01)


def legend_below(fig: Figure, handles: list[Any]) -> None:
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=max(1, min(4, len(handles))),
        fontsize=8,
        frameon=False,
    )

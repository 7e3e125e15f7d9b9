"""The figures of `stalwart report` (matplotlib, Agg), one function per PNG, each drawing the
numbers that orchestrator/observe/analysis.py and rank_times.py compute from a run's events:
`FIGURES` (every PNG of the report, in the page's order, with its caption), the timeline and the
per-rank step-time heatmap here; the cost figures (recovery phases, checkpoints, goodput) in
orchestrator/observe/figures_costs.py. See docs/report.md for how to read them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.ticker import FixedLocator, NullLocator
from matplotlib.transforms import blended_transform_factory

from stalwart.orchestrator.observe.analysis import Timeline, fmt_secs
from stalwart.orchestrator.observe.drawing import (
    FAULT_COLOR,
    MARKER_STYLE,
    NOTE_COLOR,
    PERSIST_COLOR,
    RECOVERY_COLOR,
    draw_events,
    event_handles,
    legend_below,
    new_figure,
    no_data,
    save_png,
    stagger_labels,
    tex,
    x_limits,
)
from stalwart.orchestrator.observe.rank_times import Heatmap

HEATMAP_ROWS = 64  # rank rows the heatmap draws at most: the most straggler-like when more
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


def plot_timeline(tl: Timeline, name: str, path: Path) -> Path:
    fig = new_figure(12, 7.5)
    ax_loss, ax_rate = fig.subplots(2, 1, sharex=True, height_ratios=(1.1, 1))
    xlim = x_limits(tl)
    fig.suptitle(tex(f"{name}: loss and throughput over time"), fontsize=13, weight="bold")

    for ax in (ax_loss, ax_rate):
        draw_events(ax, tl)
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
        no_data(
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
        no_data(ax_rate, "no throughput events in this run")
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
    stagger_labels(
        ax_loss,
        [
            (m.t, m.label, MARKER_STYLE.get(m.kind, (NOTE_COLOR, ""))[0])
            for m in tl.markers
            if m.t <= xlim[1]
        ],
        xlim,
    )
    stagger_labels(ax_rate, top_labels, xlim, base=0.94, levels=2, fontsize=7)
    stagger_labels(
        ax_rate,
        [
            (
                r.start,
                f"{'recovered' if r.outcome == 'recovered' else r.outcome} "
                f"in {fmt_secs(r.duration)}",
                RECOVERY_COLOR if r.outcome == "recovered" else FAULT_COLOR,
            )
            for r in tl.recoveries
        ],
        xlim,
        base=0.03,
        direction=1,
        levels=3,
    )
    handles = event_handles(tl)
    legend_below(fig, handles)
    return save_png(fig, path)


def plot_heatmap(hm: Heatmap, tl: Timeline, name: str, path: Path) -> Path:
    xlim = x_limits(tl)
    if not hm.ranks:
        fig = new_figure(12, 3.2)
        ax = fig.subplots()
        fig.suptitle(tex(f"{name}: step time per rank"), fontsize=13, weight="bold")
        no_data(
            ax,
            "no per-rank step times in the throughput events\n(runs recorded before "
            "rank_compute_s was logged have none)",
        )
        ax.set_yticks([])
        ax.set_xlim(*xlim)
        ax.set_xlabel("seconds since the job started")
        ax.set_ylabel("rank")
        return save_png(fig, path)
    shown = hm.slowest(HEATMAP_ROWS)
    data = hm.matrix(shown)
    rel = hm.relative(shown)
    n = len(shown)
    # 0.5 in per rank row for a few ranks, less for many: at most HEATMAP_ROWS rows are drawn,
    # so the figure stays well under Agg's limits (~1,900 px tall at most).
    fig = new_figure(12, max(5.0, 2.6 + min(0.5 * n, 4 + 0.16 * n)))
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
    fig.suptitle(tex(f"{name}: step time per rank"), fontsize=13, weight="bold")
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
                color, style = MARKER_STYLE[m.kind]
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
    used = stagger_labels(
        ax_abs,
        [
            (m.t, m.label, MARKER_STYLE[m.kind][0])
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
    return save_png(fig, path)


def _colormap(name: str, bad: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=bad)

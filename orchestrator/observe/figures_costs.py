"""The report's cost figures (matplotlib, Agg): where each recovery's time went, what
checkpoints cost, and where the wall time went (goodput). The timeline, the heatmap and the
list of figures are in orchestrator/observe/figures.py; docs/report.md says how to read them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from stalwart.orchestrator.observe.analysis import PHASES, Goodput, Timeline, fmt_secs, num
from stalwart.orchestrator.observe.drawing import (
    FAULT_COLOR,
    PERSIST_COLOR,
    draw_events,
    event_handles,
    legend_below,
    new_figure,
    no_data,
    save_png,
    tex,
    x_limits,
)

PHASE_COLORS = (
    "#d62728",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#1f77b4",
    "#17becf",
    "#9467bd",
    "#2ca02c",
    "#c7c7c7",  # other
)


def plot_recovery_phases(tl: Timeline, name: str, path: Path) -> Path:
    recs = tl.recoveries
    fig = new_figure(12, max(3.4, 2.2 + 0.55 * len(recs)))
    ax = fig.subplots()
    fig.suptitle(tex(f"{name}: recovery phases per failure"), fontsize=13, weight="bold")
    ax.set_xlabel("seconds from the failure to the first step after the restore")
    if not recs:
        no_data(ax, "no failures and recoveries in this run")
        ax.set_yticks([])
        return save_png(fig, path)
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
            total = f"Σ {fmt_secs(left)}"
            if not r.detect_known:
                total += " (detect unknown: not injected)"
        else:
            left = r.duration
            ax.barh(i, left, color="#bbbbbb", hatch="//", edgecolor="#777777")
            total = f"{r.outcome} after {fmt_secs(left)} (no phases)"
        widest = max(widest, left)
        bar_segments[i] = list(segments)
        ax.annotate(
            tex(total),
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
    ax.set_yticklabels([tex(x) for x in labels], fontsize=8)
    ax.set_ylim(len(recs) - 0.5, -0.5)
    ax.set_xlim(0, max(widest, 1e-3) * 1.35)
    # The seconds of each phase inside its segment, where the segment is wide enough.
    for i, segs in bar_segments.items():
        for left, width, _phase in segs:
            if width >= widest * 1.35 * 0.045:
                ax.text(
                    left + width / 2,
                    i,
                    fmt_secs(width),
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
    return save_png(fig, path)


def plot_checkpoints(tl: Timeline, result: Mapping[str, Any] | None, name: str, path: Path):
    fig = new_figure(12, 9)
    ax_snap, ax_persist, ax_lag = fig.subplots(3, 1, height_ratios=(0.7, 1, 1))
    ax_lag.sharex(ax_persist)
    fig.suptitle(tex(f"{name}: checkpoint costs"), fontsize=13, weight="bold")
    xlim = x_limits(tl)
    # Room on the right for the label of a checkpoint written at the very end.
    xlim = (xlim[0], xlim[1] + 0.04 * (xlim[1] - xlim[0]))

    ck = (result or {}).get("checkpoint") or {}
    parts = [
        ("capture (training thread)", num(ck.get("capture_ms_mean"))),
        ("wait (training thread, backpressure)", num(ck.get("wait_ms_mean"))),
        ("handover (background)", num(ck.get("handover_ms_mean"))),
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
        mb = num(ck.get("bytes_per_snapshot"))
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
        no_data(
            ax_snap,
            "no snapshot statistics"
            + (" (no result.json: the run did not finish)" if result is None else ""),
        )
        ax_snap.set_yticks([])
    ax_snap.set_xlabel("milliseconds per snapshot")
    ax_snap.grid(axis="x", alpha=0.3)

    draw_events(ax_persist, tl, spans=True)
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
        no_data(
            ax_persist,
            "no durable checkpoint written"
            + (f" (to {uri})" if uri else " (checkpoint.persist.uri not set)"),
        )
    ax_persist.set_ylabel("write time (s)")
    ax_persist.grid(alpha=0.3)
    ax_persist.tick_params(labelbottom=True)

    draw_events(ax_lag, tl, spans=True)
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
        no_data(ax_lag, "no commit lag in the throughput events")
    ax_lag.set_ylabel("commit lag (steps)")
    ax_lag.set_xlabel("seconds since the job started")
    ax_lag.set_xlim(*xlim)
    ax_lag.grid(alpha=0.3)
    handles = event_handles(tl, checkpoints=False)
    legend_below(fig, handles)
    return save_png(fig, path)


def plot_goodput(g: Goodput, name: str, path: Path) -> Path:
    fig = new_figure(12, 4.2)
    ax = fig.subplots()
    if not g.known or g.whole_job is None:
        fig.suptitle(tex(f"{name}: goodput unknown"), fontsize=13, weight="bold")
        no_data(
            ax,
            "no state events: the log does not say when the job ran"
            if not g.known
            else "the job never ran (no RUNNING state)",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return save_png(fig, path)
    fig.suptitle(
        tex(
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
    return save_png(fig, path)

"""`stalwart simulate --figure PATH`: each strategy's ETTR against the job's GPU count, with
its 95 % interval, in the report's style (orchestrator/observe/drawing.py: matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.orchestrator.observe.drawing import NOTE_COLOR, new_figure, save_png, tex

# Each strategy's colour, stalwart's the report's recovery green.
COLORS = {
    "stalwart": "#2ca02c",
    "restart-storage": "#d62728",
    "gemini": "#9467bd",
    "replica-group": "#1f77b4",
    "standby-switch": "#ff7f0e",
}


def plot_ettr(name: str, points: list[tuple[int, dict[str, Any]]], path: Path) -> Path:
    """`points`: (GPUs, the report of a run at that many) in increasing GPU order."""
    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    gpus = [g for g, _ in points]
    strategies = [s["strategy"] for s in points[0][1]["strategies"]]
    for i, strategy in enumerate(strategies):
        ettr = [out["strategies"][i]["ettr"] * 100 for _, out in points]
        half = [out["strategies"][i]["ettr_ci95"] * 100 for _, out in points]
        color = COLORS.get(strategy, NOTE_COLOR)
        ax.plot(
            gpus,
            ettr,
            marker="o",
            ms=4,
            lw=2 if strategy == "stalwart" else 1.3,
            color=color,
            label=strategy,
        )
        ax.fill_between(
            gpus,
            [e - h for e, h in zip(ettr, half, strict=True)],
            [e + h for e, h in zip(ettr, half, strict=True)],
            color=color,
            alpha=0.15,
        )
    ax.set_xscale("log")
    ax.set_xticks(gpus, [f"{g:,}" for g in gpus], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("effective training time (%)")
    ax.set_ylim(top=100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    days = points[0][1]["days"]
    ax.set_title(tex(f"{name}: ETTR against the job's size ({days:g} days per run)"), fontsize=10)
    return save_png(fig, path)

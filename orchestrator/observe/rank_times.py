"""Per-rank step times: the numbers behind the report's step-time heatmap (ranks x throughput
intervals of median compute seconds per step), each rank's time over its peers' median (the
straggler score's measure) and the most straggler-like ranks, which the heatmap draws when a job
has more ranks than rows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalwart.orchestrator.observe.analysis import as_int, job_start, num


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
                rank, seconds = as_int(r), num(v)
                if rank is not None and rank >= 0 and seconds is not None:
                    values[rank] = seconds
            begin = prev if prev is not None else t - 1.0
            columns.append((begin, t, values, num(e.get("compute_median_s"))))
            total = max(total, as_int(e.get("ranks_total")) or 0)
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

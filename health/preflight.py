"""Preflight judgment: which nodes failed or are far slower than their peers.

Each node runs a matmul timing and a small all-reduce with a neighbour before it trains
(orchestrator side). This module only judges the numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PreflightResult:
    node: str
    matmul_s: float | None  # seconds for the timed matmuls; None: did not finish
    allreduce_s: float | None = None  # seconds for the neighbour all-reduce, if run
    error: str | None = None


def judge_preflight(
    results: Mapping[str, PreflightResult],
    max_slowdown: float,
    reference_s: float | None = None,
) -> tuple[dict[str, str], str]:
    """Nodes to cordon, with why. A node fails if its check errored or did not finish, or
    if its matmul or all-reduce took more than `max_slowdown` times the other nodes' median.
    `reference_s`: the matmul time of healthy nodes already in the job (for a replacement
    node checked alone); without it, the median of `results` is the reference.
    """
    bad: dict[str, str] = {}
    for node, r in results.items():
        if r.error is not None or r.matmul_s is None:
            bad[node] = f"preflight failed: {r.error or 'did not finish'}"
    ok = {n: r for n, r in results.items() if n not in bad}
    for metric in ("matmul_s", "allreduce_s"):
        values = {n: getattr(r, metric) for n, r in ok.items() if getattr(r, metric) is not None}
        for node, v in values.items():
            # Against the other nodes (leave-one-out), so two nodes suffice.
            others = [x for n, x in values.items() if n != node]
            if metric == "matmul_s" and reference_s is not None:
                ref = reference_s
            elif others:
                ref = statistics.median(others)
            else:
                continue
            if ref > 0 and v > max_slowdown * ref:
                why = (
                    f"{metric.removesuffix('_s')} took {v * 1000:.1f} ms, "
                    f"{v / ref:.1f}x its peers' {ref * 1000:.1f} ms "
                    f"(health.preflight.max_slowdown={max_slowdown})"
                )
                bad[node] = f"{bad[node]}; {why}" if node in bad else why
    if not bad:
        return {}, f"{len(results)} node(s) passed preflight"
    return bad, "; ".join(f"node {n[:12]}: {why}" for n, why in sorted(bad.items()))

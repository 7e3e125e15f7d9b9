"""bench/metrics_cost.py runs, and measures what it says: the series of a small job."""

from __future__ import annotations

import pytest

from bench.metrics_cost import GPUS_PER_NODE, measure

pytestmark = pytest.mark.timeout(60)


def test_a_small_job_is_measured_with_every_rank_and_gpu_series():
    r = measure(16, repeats=1)
    assert r["ranks"] == 16 and r["nodes"] == 16 // GPUS_PER_NODE
    assert r["refresh_s"] > 0 and r["scrape_render_s"] > 0 and r["scrape_bytes"] > 0
    # 5 per-rank gauges per rank, 5 gauges per GPU, and more: the series grow with both.
    assert r["series"] > 5 * 16 + 5 * 16
    bigger = measure(32, repeats=1)
    assert bigger["series"] > r["series"]

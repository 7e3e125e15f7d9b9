"""The control-plane benchmark's pure helpers (bench/control_plane.py); no Ray is started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import control_plane as cp

REPO = Path(__file__).resolve().parents[2]


def test_percentile_interpolates_like_numpy():
    assert cp.percentile([], 50) is None
    assert cp.percentile([3.0], 99) == 3.0
    assert cp.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert cp.percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert cp.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert cp.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_split_thirds_by_time():
    samples = [(float(t), float(t)) for t in range(9)]
    first, middle, last = cp.split_thirds(samples, 0.0, 9.0)
    assert first == [0.0, 1.0, 2.0]
    assert middle == [3.0, 4.0, 5.0]
    assert last == [6.0, 7.0, 8.0]


def test_slope():
    assert cp.slope([(0.0, 1.0)]) is None
    assert cp.slope([(1.0, 1.0), (1.0, 2.0)]) is None
    assert cp.slope([(0.0, 1.0), (1.0, 1.5), (2.0, 2.0)]) == pytest.approx(0.5)


def test_lag_steady_does_not_grow():
    samples = [(float(t), 1.0 + 0.01 * (t % 3)) for t in range(60)]
    lag = cp.lag_summary(samples, 0.0, 60.0, interval_s=1.0)
    assert not lag["grows"] and not lag["stuck_at_end"]
    assert lag["first_third"]["n"] == 20 and lag["last_third"]["n"] == 20
    assert lag["p50_s"] == pytest.approx(1.01)


def test_lag_growing_by_more_than_an_interval_grows():
    samples = [(float(t), 1.0 + 0.1 * t) for t in range(60)]
    lag = cp.lag_summary(samples, 0.0, 60.0, interval_s=1.0)
    assert lag["grows"]
    assert lag["slope_s_per_s"] == pytest.approx(0.1)


def test_lag_without_reports_in_last_third_or_stuck_grows():
    early = [(float(t), 1.0) for t in range(20)]
    assert cp.lag_summary(early, 0.0, 60.0, 1.0)["grows"]
    steady = [(float(t), 1.0) for t in range(60)]
    stuck = cp.lag_summary(steady, 0.0, 60.0, 1.0, since_last_poll_s=30.0)
    assert stuck["stuck_at_end"] and stuck["grows"]
    assert not cp.lag_summary(steady, 0.0, 60.0, 1.0, since_last_poll_s=1.5)["grows"]


def test_detection_summary_counts_misses_against_the_limit():
    d = cp.detection_summary([3.5, 4.0, 4.5], limit_s=6.0)
    assert d["detected"] == 3 and d["missed"] == 0 and d["within_limit"]
    assert d["p50_s"] == 4.0 and d["max_s"] == 4.5
    missed = cp.detection_summary([3.5, None], limit_s=6.0)
    assert missed["missed"] == 1 and not missed["within_limit"]
    assert not cp.detection_summary([3.5, 7.0], limit_s=6.0)["within_limit"]
    assert not cp.detection_summary([], limit_s=6.0)["within_limit"]


def test_plan_stragglers_first_then_node_losses():
    plan = cp.plan_injections(60.0, 5, 1.0, 3.0, 10)
    kinds = [p["kind"] for p in plan]
    assert kinds == ["straggler"] * 5 + ["node_loss"] * 5
    times = [p["at"] for p in plan]
    assert times == sorted(times)
    last_straggler = max(p["at"] for p in plan if p["kind"] == "straggler")
    first_loss = min(p["at"] for p in plan if p["kind"] == "node_loss")
    # every straggler gets its whole limit (2 x the window span) before any recovery
    assert first_loss - (last_straggler + 1) >= 2 * 10
    assert plan[-1]["at"] + 6.0 <= 60.0


def test_node_losses_spread_over_a_poll_interval():
    plan = cp.plan_injections(60.0, 5, 1.0, 3.0, 10, interval_s=1.0)
    phases = sorted(round(p["at"] % 1.0, 3) for p in plan if p["kind"] == "node_loss")
    assert phases == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert all(p["at"] % 1.0 == 0 for p in plan if p["kind"] == "straggler")


def test_plan_refuses_a_run_too_short():
    with pytest.raises(ValueError, match="at least"):
        cp.plan_injections(20.0, 5, 1.0, 3.0, 10)
    assert cp.plan_injections(5.0, 0, 1.0, 3.0, 10) == []


def test_targets_spread_and_never_share_a_node():
    for nodes in (10, 32, 128, 2048):
        losses, ranks = cp.pick_targets(nodes, 5, 8)
        slow_nodes = [r // 8 for r in ranks]
        assert len(set(losses)) == 5 and len(set(slow_nodes)) == 5
        assert not set(losses) & set(slow_nodes)
        assert all(0 <= n < nodes for n in losses + slow_nodes)
    with pytest.raises(ValueError):
        cp.pick_targets(9, 5, 8)


def test_goal_needs_every_part():
    lag_ok, lag_bad = {"grows": False}, {"grows": True}
    ok, bad = {"within_limit": True}, {"within_limit": False}
    assert cp.goal_verdict(lag_ok, ok, ok)["held"]
    assert cp.goal_verdict(lag_ok, ok, None)["held"]  # straggler detection off
    assert not cp.goal_verdict(lag_bad, ok, ok)["held"]
    assert not cp.goal_verdict(lag_ok, bad, ok)["held"]
    assert not cp.goal_verdict(lag_ok, ok, bad)["held"]


def test_recent_steps_mirror_the_worker():
    text = (REPO / "orchestrator" / "worker" / "context.py").read_text()
    assert int(re.search(r"^RECENT_STEPS = (\d+)", text, re.M).group(1)) == cp.RECENT_STEPS

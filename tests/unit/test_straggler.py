"""health/straggler.py: leave-one-out compute-time scores and what to do about stragglers."""

from __future__ import annotations

import random

import pytest

from stalwart.health.observations import Budget
from stalwart.health.policy import Action, Decision
from stalwart.health.straggler import (
    StragglerConfig,
    StragglerReport,
    straggler_decision,
    straggler_scores,
)

CFG = StragglerConfig(
    threshold=1.5
)  # threshold 1.5, 5-step windows, 2 consecutive, 5 ms min excess
BASE_S = 0.02


def history(
    ranks: int, steps: int, slow: dict[int, float] | None = None, slow_from: int = 0
) -> dict[int, dict[int, float]]:
    """rank -> {step: compute seconds}; ranks in `slow` are that many times slower from
    `slow_from` on."""
    slow = slow or {}
    return {
        r: {s: BASE_S * (slow.get(r, 1.0) if s >= slow_from else 1.0) for s in range(steps)}
        for r in range(ranks)
    }


def budget(used: int = 0, max_restarts: int | None = 10) -> Budget:
    return Budget(
        restarts_used=used, max_restarts=max_restarts, user_errors_seen=0, user_error_retries=0
    )


# --- config -----------------------------------------------------------------------------------


def test_default_config_and_span():
    assert StragglerConfig(2.0, 5, 2, 0.005) == StragglerConfig()
    assert CFG.span == 10
    assert StragglerConfig(window_steps=7, consecutive_windows=3).span == 21


# --- straggler_scores: not enough to judge ------------------------------------------------------


@pytest.mark.parametrize("hist", [{}, {0: {s: 1.0 for s in range(50)}}])
def test_fewer_than_two_ranks(hist):
    report, reason = straggler_scores(hist, CFG)
    assert report == StragglerReport()
    assert reason == "fewer than two ranks: nothing to compare"


def test_fewer_common_steps_than_a_window():
    report, reason = straggler_scores(history(4, 4, {3: 3.0}), CFG)
    assert report == StragglerReport()
    assert report.through_step is None
    assert reason == "4 common steps, a window needs 5"


def test_rank_without_any_step_leaves_no_common_steps():
    hist = history(3, 20, {2: 3.0})
    hist[1] = {}
    report, reason = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert reason == "0 common steps, a window needs 5"


# --- straggler_scores: a slow rank --------------------------------------------------------------


def test_healthy_equal_ranks_score_one():
    report, reason = straggler_scores(history(4, 10), CFG)
    assert report.scores == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert report.flagged == ()
    assert report.through_step == 9
    assert reason == "no straggler (highest score: rank 0 at 1.00)"


def test_slow_rank_among_four_is_flagged_after_two_full_windows():
    report, reason = straggler_scores(history(4, 10, {3: 3.0}), CFG)
    assert report.flagged == (3,)
    assert report.scores == {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}
    assert report.through_step == 9
    assert reason == (
        "rank 3 computes 3.00x its peers' median (best step per window) in 2 consecutive "
        "windows of 5 steps (threshold 1.5)"
    )


def test_slow_rank_with_only_one_window_of_history_is_not_flagged():
    # Slow from the start, but only one window so far: a verdict needs two.
    report, reason = straggler_scores(history(4, 9, {3: 3.0}), CFG)
    assert report.flagged == ()
    assert report.scores[3] == 3.0  # it is scored, just not judged yet
    assert report.through_step == 8
    assert reason == "no straggler (highest score: rank 3 at 3.00)"


def test_rank_that_turns_slow_is_flagged_within_span_steps_but_not_after_one_window():
    # Healthy for 20 steps, then rank 3 is 3x slower; evaluate after every step.
    slow_from = 20
    full = history(4, 40, {3: 3.0}, slow_from=slow_from)
    first_flag = None
    for last in range(40):
        hist = {r: {s: t for s, t in h.items() if s <= last} for r, h in full.items()}
        report, _ = straggler_scores(hist, CFG)
        if report.flagged:
            assert report.flagged == (3,)
            first_flag = last if first_flag is None else first_flag
        elif first_flag is not None:
            pytest.fail(f"flag dropped at step {last} after first raised at {first_flag}")
    slow_steps_at_flag = first_flag - slow_from + 1
    # Not with one slow window's worth of steps; at the latest with two full windows.
    assert CFG.window_steps < slow_steps_at_flag <= CFG.span


def test_one_slow_window_then_recovery_is_not_flagged():
    # Slow in the older window only: a blip, not a straggler.
    hist = history(4, 10)
    for s in range(5):
        hist[2][s] = BASE_S * 4
    report, reason = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert report.scores[2] == 1.0  # the latest window is healthy
    assert "no straggler" in reason


def test_slow_only_in_the_latest_window_is_not_flagged():
    hist = history(4, 10)
    for s in range(5, 10):
        hist[1][s] = BASE_S * 4
    report, _ = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert report.scores[1] == 4.0


def test_only_the_newest_span_of_steps_is_judged():
    # Slow long ago, healthy for the last two windows.
    hist = history(4, 30, {0: 5.0})
    for s in range(20, 30):
        hist[0][s] = BASE_S
    report, _ = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert report.through_step == 29


def test_two_ranks_leave_one_out_reference():
    # With two ranks each rank's reference is the other one alone.
    report, reason = straggler_scores(history(2, 10, {1: 2.0}), CFG)
    assert report.flagged == (1,)
    assert report.scores == {0: 0.5, 1: 2.0}
    assert reason.startswith("rank 1 computes 2.00x")


def test_one_slow_rank_does_not_drag_the_reference_up():
    # Leave-one-out: the fast ranks' reference is the median of the others, which with
    # 8 ranks stays at the healthy value; nobody healthy scores below 1.
    report, _ = straggler_scores(history(8, 10, {5: 10.0}), CFG)
    assert report.flagged == (5,)
    assert report.scores[5] == 10.0
    assert all(report.scores[r] == 1.0 for r in range(8) if r != 5)


def test_two_slow_ranks_both_flagged_in_rank_order():
    report, reason = straggler_scores(history(6, 10, {4: 3.0, 1: 2.0}), CFG)
    assert report.flagged == (1, 4)
    assert reason.startswith("rank 1 computes 2.00x")
    assert "; rank 4 computes 3.00x" in reason


def test_threshold_is_inclusive():
    # Binary-exact times so the ratio is exactly 1.5.
    hist = {r: {s: 0.25 for s in range(10)} for r in range(4)}
    hist[0] = {s: 0.375 for s in range(10)}
    report, _ = straggler_scores(hist, CFG)
    assert report.scores[0] == 1.5
    assert report.flagged == (0,)
    hist[0] = {s: 0.37 for s in range(10)}
    assert straggler_scores(hist, CFG)[0].flagged == ()


def test_custom_threshold_and_window():
    cfg = StragglerConfig(threshold=4.0, window_steps=3, consecutive_windows=3)
    assert straggler_scores(history(4, 9, {2: 3.0}), cfg)[0].flagged == ()
    assert straggler_scores(history(4, 9, {2: 5.0}), cfg)[0].flagged == (2,)
    assert straggler_scores(history(4, 8, {2: 5.0}), cfg)[0].flagged == ()  # two windows


def test_median_ignores_a_single_outlier_step_per_window():
    hist = history(4, 10)
    hist[0][2] = BASE_S * 50  # one GC pause in each window
    hist[0][7] = BASE_S * 50
    report, _ = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert report.scores[0] == 1.0


def test_min_excess_suppresses_tiny_absolute_differences():
    # 3x slower, but only 2 ms per step: timer noise, not a straggler.
    hist = {r: {s: 0.001 for s in range(10)} for r in range(4)}
    hist[3] = {s: 0.003 for s in range(10)}
    report, reason = straggler_scores(hist, CFG)
    assert report.scores[3] == 3.0
    assert report.flagged == ()
    assert reason == "no straggler (highest score: rank 3 at 3.00)"
    # The same ratio with a 20 ms excess is flagged.
    hist = {r: {s: 0.01 for s in range(10)} for r in range(4)}
    hist[3] = {s: 0.03 for s in range(10)}
    assert straggler_scores(hist, CFG)[0].flagged == (3,)


def test_min_excess_zero_flags_any_ratio():
    hist = {r: {s: 0.001 for s in range(10)} for r in range(4)}
    hist[3] = {s: 0.003 for s in range(10)}
    cfg = StragglerConfig(min_excess_s=0.0)
    assert straggler_scores(hist, cfg)[0].flagged == (3,)


def test_only_steps_common_to_all_ranks_count():
    # Rank 3 has run ahead: its extra steps are slow, but nobody else has them yet.
    hist = history(4, 10)
    for s in range(10, 20):
        hist[3][s] = BASE_S * 10
    report, _ = straggler_scores(hist, CFG)
    assert report.flagged == ()
    assert report.through_step == 9
    assert report.scores[3] == 1.0


def test_gaps_are_skipped_and_windows_use_common_steps():
    # Rank 0 missed steps 3 and 7 (not reported); the others did not.
    hist = history(3, 12, {1: 3.0})
    del hist[0][3], hist[0][7]
    report, _ = straggler_scores(hist, CFG)
    assert report.flagged == (1,)
    assert report.through_step == 11
    # Each rank's first six steps: only {0, 1, 2, 4, 5} are common, one window's worth.
    first_six = {r: {s: h[s] for s in list(h)[:6]} for r, h in hist.items()}
    report, _ = straggler_scores(first_six, CFG)
    assert report.flagged == ()
    assert report.through_step == 5


def test_zero_reference_scores_one():
    hist = {0: {s: 0.0 for s in range(10)}, 1: {s: 0.0 for s in range(10)}}
    hist[1] = {s: 0.5 for s in range(10)}
    report, _ = straggler_scores(hist, CFG)
    assert report.scores[1] == 1.0  # no meaningful ratio against zero
    assert report.flagged == ()


def test_history_is_not_mutated():
    hist = history(4, 12, {3: 3.0})
    before = {r: dict(h) for r, h in hist.items()}
    straggler_scores(hist, CFG)
    assert hist == before


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_healthy_noisy_run_is_never_flagged(ranks):
    # 500 steps of lognormal noise, judged after every step with the default config.
    rng = random.Random(20_240_601 + ranks)
    hist: dict[int, dict[int, float]] = {r: {} for r in range(ranks)}
    flags = []
    highest = 0.0
    for step in range(500):
        for r in range(ranks):
            hist[r][step] = BASE_S * rng.lognormvariate(0.0, 0.15)
        report, _ = straggler_scores(hist, StragglerConfig())
        if report.flagged:
            flags.append((step, report.flagged))
        if report.scores:
            highest = max(highest, *report.scores.values())
    assert flags == []
    # The noise is real: single windows do score well above 1 (with two ranks even above
    # the threshold now and then); the consecutive-window rule keeps them unflagged.
    assert highest > 1.1


def test_noisy_run_with_a_real_straggler_is_flagged():
    rng = random.Random(7)
    hist: dict[int, dict[int, float]] = {r: {} for r in range(4)}
    first = None
    for step in range(100):
        for r in range(4):
            factor = 3.0 if (r == 2 and step >= 50) else 1.0
            hist[r][step] = BASE_S * factor * rng.lognormvariate(0.0, 0.15)
        report, _ = straggler_scores(hist, CFG)
        assert set(report.flagged) <= {2}
        if report.flagged and first is None:
            first = step
    assert first is not None
    assert 50 + CFG.window_steps <= first <= 50 + CFG.span - 1


# --- straggler_decision -------------------------------------------------------------------------

NODE_OF = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


def test_nothing_flagged_is_noop():
    decision, reason = straggler_decision((), "replace", NODE_OF, frozenset({"node-c"}), budget())
    assert decision == Decision(Action.NOOP)
    assert reason == "no straggler to act on"


def test_policy_none_is_noop():
    decision, reason = straggler_decision((3,), "none", NODE_OF, frozenset({"node-c"}), budget())
    assert decision == Decision(Action.NOOP)
    assert reason == "no straggler to act on"


def test_policy_alert_is_noop_with_the_ranks_in_the_reason():
    decision, reason = straggler_decision((1, 3), "alert", NODE_OF, frozenset({"node-c"}), budget())
    assert decision == Decision(Action.NOOP)
    assert reason == "straggler rank(s) 1, 3: alert only (policy alert)"


def test_policy_replace_moves_the_rank_and_cordons_its_node():
    decision, reason = straggler_decision((3,), "replace", NODE_OF, frozenset({"node-c"}), budget())
    assert decision == Decision(Action.REPLACE, ranks=(3,), cordon=("node-b",))
    assert decision.cordon == ("node-b",)
    assert isinstance(decision.cordon, tuple)
    assert reason == "straggler rank(s) 3: move to a spare on another node, cordon node-b"


def test_replace_several_ranks_cordons_each_node_once_sorted():
    node_of = {0: "node-z", 1: "node-a", 2: "node-z", 3: "node-m"}
    decision, reason = straggler_decision(
        (0, 1, 2), "replace", node_of, frozenset({"node-m"}), budget()
    )
    assert decision.action is Action.REPLACE
    assert decision.ranks == (0, 1, 2)
    assert decision.cordon == ("node-a", "node-z")
    assert reason.endswith("cordon node-a, node-z")


def test_replace_shortens_long_node_ids_in_the_reason():
    slow_node = "b" * 40
    decision, reason = straggler_decision(
        (0,), "replace", {0: slow_node}, frozenset({"spare"}), budget()
    )
    assert decision.cordon == (slow_node,)
    assert reason.endswith("cordon " + "b" * 12)


def test_spare_only_on_the_slow_node_is_alert_only():
    decision, reason = straggler_decision((3,), "replace", NODE_OF, frozenset({"node-b"}), budget())
    assert decision == Decision(Action.NOOP)
    assert reason == "straggler rank(s) 3: alert only, no ready spare on another healthy node"


def test_no_spare_at_all_is_alert_only():
    decision, reason = straggler_decision((3,), "replace", NODE_OF, frozenset(), budget())
    assert decision == Decision(Action.NOOP)
    assert "no ready spare on another healthy node" in reason


def test_spare_on_a_healthy_node_besides_the_slow_one_is_enough():
    decision, _ = straggler_decision(
        (3,), "replace", NODE_OF, frozenset({"node-b", "node-a"}), budget()
    )
    assert decision.action is Action.REPLACE
    assert decision.cordon == ("node-b",)


def test_budget_exhausted_is_alert_only_never_fail():
    decision, reason = straggler_decision(
        (3,), "replace", NODE_OF, frozenset({"node-c"}), budget(used=5, max_restarts=5)
    )
    assert decision == Decision(Action.NOOP)
    assert decision.action is not Action.FAIL
    assert reason == (
        "straggler rank(s) 3: alert only, restart budget spent (failure.max_restarts=5)"
    )


def test_unlimited_budget_replaces():
    decision, _ = straggler_decision(
        (3,), "replace", NODE_OF, frozenset({"node-c"}), budget(used=99, max_restarts=None)
    )
    assert decision.action is Action.REPLACE


def test_scores_feed_the_decision():
    report, _ = straggler_scores(history(4, 10, {2: 3.0}), CFG)
    decision, _ = straggler_decision(
        report.flagged, "replace", NODE_OF, frozenset({"node-c"}), budget()
    )
    assert decision == Decision(Action.REPLACE, ranks=(2,), cordon=("node-b",))

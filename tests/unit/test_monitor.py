"""orchestrator/supervisor/monitor.py: HealthMonitor turns agent reports into observations for
health/."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from stalwart.health.liveness import Hang
from stalwart.health.straggler import StragglerReport
from stalwart.health.xid import GpuReading, GpuVerdict
from stalwart.orchestrator.spec import HealthSpec, StragglerSpec
from stalwart.orchestrator.supervisor.monitor import HealthMonitor

FAST_S = 0.02  # a healthy rank's compute seconds per step
SLOW_S = 0.06  # a straggler's: 3x, well over threshold 2.0 and min_excess_s


def monitor(**health: Any) -> HealthMonitor:
    """A monitor without the straggler warm-up and minimum duration unless a test sets them:
    most tests here are about the verdict's steps, and those would shift them all."""
    s = health.get("straggler", StragglerSpec())
    for field in ("warmup_steps", "min_duration_s"):
        if field not in s.model_fields_set:
            s = s.model_copy(update={field: 0})
    health["straggler"] = s
    return HealthMonitor(HealthSpec(**health))


def beat(
    pid: int,
    step: int,
    at: float,
    recent: list[tuple[int, float, float]] | None = None,
    collective_since: float | None = None,
    gpu_index: int | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    """What a worker's `_beat` sends (the keys the monitor reads), plus the agent's
    `received_at`."""
    return {
        "pid": pid,
        "step": step,
        "received_at": at,
        "sent_at": at - 0.01,
        "collective_since": collective_since,
        "gpu_index": gpu_index,
        "recent": list(recent or []),
        "generation": generation,
    }


def recent(steps: range, compute: float, cycle: float | None = None) -> list[tuple]:
    return [(s, compute, compute + 0.01 if cycle is None else cycle) for s in steps]


def two_ranks(m: HealthMonitor, now: float) -> None:
    m.start_generation({0: ("node-a", 100), 1: ("node-b", 101)}, now)


def feed(m: HealthMonitor, steps: range, at: float, slow: dict[int, float] | None = None) -> None:
    """One beat per rank carrying `steps`; ranks in `slow` compute that many seconds."""
    slow = slow or {}
    for rank, r in m.ranks.items():
        m.beat(rank, beat(r.pid, steps[-1] + 1, at, recent(steps, slow.get(rank, FAST_S))))


# --- beats --------------------------------------------------------------------------------------


def test_start_generation_registers_ranks_as_just_stepped(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100), 1: ("node-b", 101)}, clock())
    views = {v.rank: v for v in m.rank_views()}
    assert set(views) == {0, 1}
    assert views[1].node == "node-b"
    assert views[0].step == 0
    assert views[0].step_changed_at == clock.now
    assert views[0].beat_at == clock.now
    assert views[0].collective_since is None
    assert m.history == {0: {}, 1: {}}
    assert m.wall == {0: {}, 1: {}}


def test_step_change_is_dated_by_the_agents_receipt(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(0, beat(100, 3, at=clock.now + 5.0))
    [v] = m.rank_views()
    assert v.step == 3
    assert v.step_changed_at == clock.now + 5.0  # received_at, not sent_at
    assert v.beat_at == clock.now + 5.0


def test_same_step_refreshes_the_beat_but_not_step_changed_at(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(0, beat(100, 3, at=1_010.0))
    m.beat(0, beat(100, 3, at=1_020.0, collective_since=1_019.5))
    [v] = m.rank_views()
    assert v.step_changed_at == 1_010.0
    assert v.beat_at == 1_020.0
    assert v.collective_since == 1_019.5
    m.beat(0, beat(100, 3, at=1_021.0))  # out of the collective again
    assert m.rank_views()[0].collective_since is None


def test_beat_from_another_pid_is_ignored(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    stale = beat(99, 7, at=1_050.0, recent=recent(range(7), FAST_S), gpu_index=2)
    m.beat(0, stale)  # a replaced process's late heartbeat
    [v] = m.rank_views()
    assert (v.step, v.step_changed_at, v.beat_at) == (0, clock.now, clock.now)
    assert m.history == {0: {}}
    assert m.wall == {0: {}}
    assert m.ranks_on_gpu("node-a", 2) == []


def test_beat_for_an_unknown_rank_is_ignored(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(5, beat(100, 1, at=1_001.0))
    assert [v.rank for v in m.rank_views()] == [0]


def test_recent_steps_fill_history_and_wall(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(0, beat(100, 3, 1_001.0, [(1, 0.02, 0.05), (2, 0.03, 0.06)]))
    m.beat(0, beat(100, 4, 1_002.0, [(2, 0.03, 0.06), (3, 0.04, 0.07)]))  # overlaps
    assert m.history[0] == {1: 0.02, 2: 0.03, 3: 0.04}
    assert m.wall[0] == {1: 0.05, 2: 0.06, 3: 0.07}


def test_history_and_wall_are_trimmed_to_four_spans(clock):
    m = monitor(straggler=StragglerSpec(window_steps=2, consecutive_windows=1))
    assert m.straggler_cfg.span == 2
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(0, beat(100, 6, 1_001.0, recent(range(6), FAST_S)))
    assert sorted(m.history[0]) == list(range(6))
    m.beat(0, beat(100, 12, 1_002.0, recent(range(6, 12), FAST_S)))
    assert sorted(m.history[0]) == list(range(4, 12))  # the newest 4 * span steps
    assert sorted(m.wall[0]) == list(range(4, 12))


def test_start_generation_forgets_the_previous_one(clock):
    m = monitor()
    two_ranks(m, clock())
    feed(m, range(10), 1_001.0, slow={1: SLOW_S})
    assert m.stragglers()[0].flagged == (1,)
    assert m.last_scores
    m.start_generation({0: ("node-c", 200), 1: ("node-d", 201)}, clock.advance(5))
    assert m.history == {0: {}, 1: {}}
    assert m.last_scores == {}
    assert m.ranks_on("node-a") == []
    assert m.ranks_on("node-c") == [0]
    # The new generation replays steps 0..9 (restored from an older checkpoint): they are
    # judged afresh, not skipped as already evaluated.
    feed(m, range(10), clock.now + 1, slow={1: SLOW_S})
    report, _ = m.stragglers()
    assert report.flagged == (1,)
    assert report.through_step == 9


# --- nodes --------------------------------------------------------------------------------------


def test_node_is_watched_only_after_its_first_answer(clock):
    m = monitor(heartbeat_timeout_s=3.0)
    m.node_asked("a", clock())
    assert m.nodes == {}
    clock.advance(100)
    assert m.lost_nodes(clock()) == ([], "all nodes answering")
    m.agent_died("a")
    m.ray_states({"a": False})
    assert m.lost_nodes(clock())[0] == []  # nothing is known of an unwatched node
    m.node_answered("a")
    assert "a" in m.nodes
    assert m.lost_nodes(clock())[0] == []


def test_silence_counts_from_the_oldest_unanswered_request(clock):
    m = monitor(heartbeat_timeout_s=3.0)
    m.node_answered("a")
    t0 = clock()
    m.node_asked("a", t0)
    m.node_asked("a", clock.advance(2.0))  # a later request does not restart the count
    assert m.nodes["a"].unanswered_since == t0
    assert m.lost_nodes(t0 + 2.9)[0] == []
    lost, reason = m.lost_nodes(t0 + 3.0)
    assert lost == ["a"]
    assert "agent silent for 3.0 s" in reason


def test_an_answer_resets_the_silence(clock):
    m = monitor(heartbeat_timeout_s=3.0)
    m.node_answered("a")
    m.node_asked("a", clock())
    clock.advance(2.5)
    m.node_answered("a")
    assert m.nodes["a"].unanswered_since is None
    assert m.lost_nodes(clock.advance(10.0))[0] == []
    t1 = clock()
    m.node_asked("a", t1)
    assert m.lost_nodes(t1 + 2.9)[0] == []
    assert m.lost_nodes(t1 + 3.0)[0] == ["a"]


def test_dead_agent_is_lost_at_once(clock):
    m = monitor()
    m.node_answered("a")
    m.node_answered("b")
    m.agent_died("b")
    assert m.lost_nodes(clock()) == (["b"], "node b: its agent died")


def test_ray_states_mark_watched_nodes_dead_and_alive(clock):
    m = monitor()
    m.node_answered("a")
    m.node_answered("b")
    m.ray_states({"a": False, "zzz": False})
    assert "zzz" not in m.nodes
    assert m.lost_nodes(clock()) == (["a"], "node a: Ray marked it dead")
    m.ray_states({"b": True})  # "a" not mentioned: unchanged
    assert m.lost_nodes(clock())[0] == ["a"]
    m.ray_states({"a": True})
    assert m.lost_nodes(clock())[0] == []


def test_an_answer_does_not_revive_a_dead_agent(clock):
    m = monitor()
    m.node_answered("a")
    m.agent_died("a")
    m.node_answered("a")
    assert m.lost_nodes(clock())[0] == ["a"]


def test_forget_node_stops_watching_it(clock):
    m = monitor(heartbeat_timeout_s=3.0)
    m.node_answered("a")
    m.node_asked("a", clock())
    m.forget_node("a")
    m.forget_node("never-seen")
    assert m.lost_nodes(clock.advance(60))[0] == []
    m.node_asked("a", clock())
    assert m.nodes == {}


# --- hangs --------------------------------------------------------------------------------------


def test_no_hang_while_steps_advance(clock):
    m = monitor(hang_timeout_s=300.0, heartbeat_timeout_s=3.0)
    two_ranks(m, clock())
    for i in range(1, 5):
        now = clock.advance(100)
        m.beat(0, beat(100, i, now))
        m.beat(1, beat(101, i, now))
    assert m.hang(clock()) == (None, "steps advancing")


def test_hang_names_the_culprit_and_everyone_waiting_for_it(clock):
    m = monitor(hang_timeout_s=300.0, heartbeat_timeout_s=3.0)
    t0 = clock()
    m.start_generation({r: (f"node-{r}", 100 + r) for r in range(3)}, t0)
    for r in range(3):
        m.beat(r, beat(100 + r, 1, t0 + 10))
    # Ranks 0 and 2 stepped 50 s ago and wait in the all-reduce; rank 1 froze at step 1.
    for r in (0, 2):
        m.beat(r, beat(100 + r, 2, t0 + 350, collective_since=t0 + 350.5))
    now = t0 + 400
    for r in (0, 2):
        m.beat(r, beat(100 + r, 2, now - 0.5, collective_since=t0 + 350.5))
    m.beat(1, beat(101, 1, now - 0.5))
    hang, reason = m.hang(now)
    assert hang == Hang(culprits=(1,), waiting=(0, 2), stalled_for_s=390.0)
    assert reason.startswith("rank(s) 1 made no step for 390.0 s")


def test_every_rank_frozen_in_a_collective_is_a_stuck_collective(clock):
    m = monitor(hang_timeout_s=300.0, heartbeat_timeout_s=3.0)
    t0 = clock()
    two_ranks(m, t0)
    for r, pid in ((0, 100), (1, 101)):
        m.beat(r, beat(pid, 4, t0 + 1, collective_since=t0 + 1))
        m.beat(r, beat(pid, 4, t0 + 320, collective_since=t0 + 1))
    hang, reason = m.hang(t0 + 321)
    assert hang == Hang(culprits=(), waiting=(0, 1), stalled_for_s=320.0)
    assert "the collective is stuck" in reason


def test_hang_ignores_ranks_whose_beats_stopped(clock):
    # A replaced process's beats are dropped, so its rank's heartbeat goes stale: lost, not hung.
    m = monitor(hang_timeout_s=300.0, heartbeat_timeout_s=3.0)
    t0 = clock()
    two_ranks(m, t0)
    m.beat(0, beat(100, 1, t0 + 1, collective_since=t0 + 1))
    m.beat(0, beat(100, 1, t0 + 400, collective_since=t0 + 1))
    m.beat(1, beat(999, 1, t0 + 400))  # another pid: does not count as a beat of rank 1
    hang, _ = m.hang(t0 + 401)
    assert hang == Hang(culprits=(), waiting=(0,), stalled_for_s=400.0)


def test_hang_uses_the_spec_timeouts(clock):
    t0 = clock()
    for timeout, hung in ((50.0, True), (70.0, False)):
        m = monitor(hang_timeout_s=timeout, heartbeat_timeout_s=3.0)
        m.start_generation({0: ("node-a", 100)}, t0)
        m.beat(0, beat(100, 1, t0 + 60))
        m.beat(0, beat(100, 1, t0 + 120))
        assert (m.hang(t0 + 121)[0] is not None) is hung
    m = monitor(hang_timeout_s=50.0, heartbeat_timeout_s=0.5)
    m.start_generation({0: ("node-a", 100)}, t0)
    m.beat(0, beat(100, 1, t0 + 60))
    m.beat(0, beat(100, 1, t0 + 120))
    assert m.hang(t0 + 121) == (None, "no fresh heartbeats")


# --- stragglers ---------------------------------------------------------------------------------


def test_straggler_policy_none_disables_detection(clock):
    m = monitor(straggler=StragglerSpec(policy="none"))
    two_ranks(m, clock())
    feed(m, range(20), clock.now + 1, slow={1: SLOW_S})
    report, reason = m.stragglers()
    assert report == StragglerReport()
    assert reason == "straggler detection off (health.straggler.policy=none)"
    assert m.last_scores == {}


def test_one_rank_has_nothing_to_compare(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    feed(m, range(20), clock.now + 1)
    assert m.stragglers() == (StragglerReport(), "fewer than two ranks: nothing to compare")


def test_no_steps_no_verdict(clock):
    m = monitor()
    two_ranks(m, clock())
    assert m.stragglers() == (StragglerReport(), "no steps yet")
    assert m.flagged_since == {}


def test_healthy_ranks_are_not_flagged_and_scores_are_kept(clock):
    m = monitor()
    two_ranks(m, clock())
    feed(m, range(10), clock.now + 1)
    report, reason = m.stragglers()
    assert report.flagged == ()
    assert report.through_step == 9
    assert report.scores == {0: 1.0, 1: 1.0}
    assert reason.startswith("no straggler")
    assert m.last_scores == {0: 1.0, 1: 1.0}
    # A call without new steps repeats the last verdict (a quiet poll is not a recovery).
    assert m.stragglers() == (report, reason)
    assert m.last_scores == {0: 1.0, 1: 1.0}


def test_verdict_at_the_first_step_that_supports_it(clock):
    # Default: 2 windows of 5 steps. The data supports a verdict at step 9; the second report
    # brings steps 5..14 at once: the verdict is as of step 14, and flagged_since says the
    # flag rests on data through step 9.
    m = monitor()
    two_ranks(m, clock())
    feed(m, range(5), clock.now + 1, slow={1: SLOW_S})
    report, reason = m.stragglers()
    assert report.flagged == ()  # one window is not enough
    assert report.through_step == 4
    feed(m, range(5, 15), clock.now + 2, slow={1: SLOW_S})
    report, reason = m.stragglers()
    assert report.flagged == (1,)
    assert report.through_step == 14
    assert m.flagged_since == {1: 9}
    assert report.scores[1] == pytest.approx(3.0)
    assert "rank 1 computes 3.00x" in reason
    assert m.last_scores == report.scores
    # No new step: the same verdict, the flag not cleared (no flapping alerts).
    assert m.stragglers() == (report, reason)
    assert m.flagged_since == {1: 9}
    # The rank recovers: the flag clears once the windows are fast again.
    feed(m, range(15, 25), clock.now + 3)
    report, _ = m.stragglers()
    assert report.flagged == () and m.flagged_since == {}


def test_verdict_at_the_first_supporting_step_when_one_beat_brings_many_steps(clock):
    # A worker's beat carries up to 32 recent steps (orchestrator/worker/context.py RECENT_STEPS),
    # more than one verdict's span (10 steps). Rank 1 is slow from step 0: steps 0..9 are
    # the first two windows that support the verdict, so it covers step 9.
    m = monitor()
    two_ranks(m, clock())
    feed(m, range(20), clock.now + 1, slow={1: SLOW_S})
    report, _ = m.stragglers()
    assert report.flagged == (1,)
    assert report.through_step == 19
    assert m.flagged_since == {1: 9}


def test_the_warm_up_of_each_generation_is_not_judged(clock):
    # Rank 1 is slow in the first 10 steps only (a process still starting beside it): the
    # default warm-up (10 steps) hides them; it is not flagged.
    m = monitor(straggler=StragglerSpec(warmup_steps=10))
    two_ranks(m, clock())
    feed(m, range(10), clock.now + 1, slow={1: SLOW_S})
    report, reason = m.stragglers()
    assert report == StragglerReport()
    assert reason == "warm-up: steps before 10 are not judged (health.straggler.warmup_steps=10)"
    feed(m, range(10, 30), clock.now + 2)
    report, _ = m.stragglers()
    assert report.flagged == () and report.through_step == 29 and m.flagged_since == {}
    # A straggler after the warm-up is found as usual, at the first step that supports it.
    feed(m, range(30, 40), clock.now + 3, slow={1: SLOW_S})
    assert m.stragglers()[0].flagged == (1,) and m.flagged_since == {1: 39}
    # A new generation (here restored at step 35) has a warm-up of its own.
    two_ranks(m, clock.now + 4)
    feed(m, range(35, 45), clock.now + 5, slow={1: SLOW_S})
    report, reason = m.stragglers()
    assert report.flagged == () and reason.startswith("warm-up: steps before 45 ")
    feed(m, range(45, 55), clock.now + 6, slow={1: SLOW_S})
    assert m.stragglers()[0].flagged == (1,) and m.flagged_since == {1: 54}


def test_a_flag_needs_min_duration_s_of_slow_steps(clock):
    # A step's time is the median of the ranks' cycles here 0.05 s (0.03 and 0.07): the
    # first verdict (step 9) rests on 10 steps, 0.5 s; with min_duration_s=0.98 the flag
    # comes when the run of slow verdicts spans 1.0 s: 10 more steps, at step 19.
    m = monitor(straggler=StragglerSpec(min_duration_s=0.98))
    two_ranks(m, clock())
    feed(m, range(12), clock.now + 1, slow={1: SLOW_S})
    assert m.stragglers()[0].flagged == (1,)  # the verdict ...
    assert m.flagged_since == {}  # ... not yet a flag
    feed(m, range(12, 20), clock.now + 2, slow={1: SLOW_S})
    m.stragglers()
    assert m.flagged_since == {1: 19}


def test_a_short_burst_is_never_flagged(clock):
    # Rank 1 is slow for 12 steps only (verdicts spanning 0.6 s), then fast: no flag.
    m = monitor(straggler=StragglerSpec(min_duration_s=1.0))
    two_ranks(m, clock())
    feed(m, range(12), clock.now + 1, slow={1: SLOW_S})
    m.stragglers()
    feed(m, range(12, 40), clock.now + 2)
    m.stragglers()
    assert m.flagged_since == {}
    # A later slowdown counts from its own start.
    feed(m, range(40, 50), clock.now + 3, slow={1: SLOW_S})
    m.stragglers()
    assert m.flagged_since == {}


def test_warm_up_is_on_by_default():
    assert HealthSpec().straggler.warmup_steps == 10
    assert HealthMonitor(HealthSpec()).straggler_cfg.warmup_steps == 10
    assert HealthSpec().straggler.min_duration_s == 3.0


def test_only_steps_every_rank_reported_are_judged(clock):
    m = monitor()
    two_ranks(m, clock())
    m.beat(0, beat(100, 10, clock.now + 1, recent(range(10), FAST_S)))
    m.beat(1, beat(101, 5, clock.now + 1, recent(range(5), SLOW_S)))
    report, _ = m.stragglers()
    assert report.flagged == ()
    assert report.through_step == 4
    m.beat(1, beat(101, 10, clock.now + 2, recent(range(5, 10), SLOW_S)))
    report, _ = m.stragglers()
    assert report.flagged == (1,)
    assert report.through_step == 9


def test_verdict_at_step_zero_is_followed_by_step_one(clock):
    # One window of one step: the data supports a verdict at step 0 already; step 0 counts
    # as a step like any other (not as "no verdict").
    m = monitor(straggler=StragglerSpec(window_steps=1, consecutive_windows=1))
    two_ranks(m, clock())
    feed(m, range(2), clock.now + 1, slow={1: SLOW_S})
    report, _ = m.stragglers()
    assert (report.flagged, report.through_step) == ((1,), 1)
    assert m.flagged_since == {1: 0}
    feed(m, range(2, 6), clock.now + 2, slow={1: SLOW_S})
    report, _ = m.stragglers()
    assert (report.flagged, report.through_step) == ((1,), 5)
    assert m.flagged_since == {1: 0}


def test_steps_per_s_is_one_over_the_median_cycle_in_the_range(clock):
    m = monitor()
    two_ranks(m, clock())
    for rank, r in m.ranks.items():
        cycles = [(s, FAST_S, 1.0) for s in range(1, 6)] + [(s, FAST_S, 0.25) for s in range(6, 11)]
        if rank == 1:
            cycles[-1] = (10, FAST_S, 5.0)  # one slow cycle does not move the median
        m.beat(rank, beat(r.pid, 11, clock.now + 1, cycles))
    assert m.steps_per_s(10, 5) == 4.0  # steps 6..10
    assert m.steps_per_s(5, 5) == 1.0  # steps 1..5
    assert m.steps_per_s(8, 5) == 4.0  # steps 4..8: six of ten cycles are 0.25 s
    assert m.steps_per_s(6, 5) == 1.0  # steps 2..6: the lower end is exclusive
    assert m.steps_per_s(6, 1) == 4.0  # step 6 alone
    assert m.steps_per_s(100, 5) is None
    assert m.steps_per_s(0, 0) is None


def test_steps_per_s_is_rounded(clock):
    m = monitor()
    m.start_generation({0: ("node-a", 100)}, clock())
    m.beat(0, beat(100, 3, clock.now + 1, [(1, FAST_S, 0.3), (2, FAST_S, 0.3)]))
    assert m.steps_per_s(2, 2) == 3.333


def test_ranks_on_a_node_and_on_a_gpu(clock):
    m = monitor()
    m.start_generation({0: ("a", 100), 1: ("b", 101), 2: ("a", 102), 3: ("a", 103)}, clock())
    assert m.ranks_on("a") == [0, 2, 3]
    assert m.ranks_on("b") == [1]
    assert m.ranks_on("c") == []
    assert m.ranks_on_gpu("a", 0) == []  # no GPU known before the first beat
    for rank, gpu in ((0, 0), (1, 0), (2, 1), (3, None)):
        m.beat(rank, beat(100 + rank, 1, clock.now + 1, gpu_index=gpu))
    assert m.ranks_on_gpu("a", 0) == [0]
    assert m.ranks_on_gpu("a", 1) == [2]
    assert m.ranks_on_gpu("b", 0) == [1]
    assert m.ranks_on_gpu("b", 1) == []


# --- GPUs ---------------------------------------------------------------------------------------


def gpu(node: str = "n1", index: int = 0, at: float = 1_000.0, **kw: Any) -> dict[str, Any]:
    """A report entry as an agent sends it: a GpuReading as a dict, its Xids a list."""
    d = asdict(GpuReading(node, index, at, **kw))
    d["xids"] = list(d["xids"])
    return d


def test_healthy_gpus():
    m = monitor()
    verdict, reason = m.gpu_readings("n1", [gpu(index=0), gpu(index=1)])
    assert verdict == GpuVerdict()
    assert reason == "all GPUs healthy"
    assert set(m.gpus) == {("n1", 0), ("n1", 1)}


def test_latest_reading_is_kept_with_xids_as_a_tuple():
    m = monitor()
    m.gpu_readings("n1", [gpu(temperature_c=60.0)])
    m.gpu_readings("n1", [gpu(at=1_002.0, temperature_c=61.0, xids=[13])])
    r = m.gpus[("n1", 0)]
    assert r == GpuReading("n1", 0, 1_002.0, xids=(13,), temperature_c=61.0)


def test_fatal_and_application_xids():
    m = monitor()
    verdict, reason = m.gpu_readings("n1", [gpu(index=0, xids=[79]), gpu(index=1, xids=[13])])
    assert verdict.fatal == {("n1", 0): "Xid 79: GPU has fallen off the bus"}
    assert list(verdict.application) == [("n1", 1)]
    assert verdict.info == {}
    assert "fatal on node n1 gpu 0" in reason


def test_info_findings_are_reported_once():
    m = monitor(gpu={"max_temperature_c": 90.0})
    hot = gpu(temperature_c=97.0)
    verdict, _ = m.gpu_readings("n1", [hot])
    assert verdict.info == {("n1", 0): "temperature 97 C > 90 C"}
    verdict, reason = m.gpu_readings("n1", [hot])
    assert verdict.info == {}
    assert "temperature 97 C" in reason  # the reason still describes the reading
    verdict, _ = m.gpu_readings("n1", [gpu(temperature_c=99.0)])  # a different finding
    assert verdict.info == {("n1", 0): "temperature 99 C > 90 C"}
    # Another GPU's identical finding is its own.
    verdict, _ = m.gpu_readings("n1", [gpu(index=1, temperature_c=99.0)])
    assert verdict.info == {("n1", 1): "temperature 99 C > 90 C"}


def test_existing_ecc_count_is_the_baseline_not_a_fault():
    m = monitor()
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=4)])
    assert verdict.fatal == {}
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=4)])
    assert verdict.fatal == {}


def test_ecc_rise_is_fatal_once_then_the_new_baseline():
    m = monitor()
    m.gpu_readings("n1", [gpu(ecc_uncorrected=4), gpu(index=1, ecc_uncorrected=0)])
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=5), gpu(index=1, ecc_uncorrected=0)])
    assert verdict.fatal == {("n1", 0): "uncorrectable ECC errors rose to 5"}
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=5)])
    assert verdict.fatal == {}
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=7)])
    assert verdict.fatal == {("n1", 0): "uncorrectable ECC errors rose to 7"}


def test_ecc_baseline_is_per_gpu():
    m = monitor()
    m.gpu_readings("n1", [gpu(ecc_uncorrected=0)])
    # GPU 1 and another node's GPU 0 are first seen with errors already counted.
    verdict, _ = m.gpu_readings("n1", [gpu(ecc_uncorrected=0), gpu(index=1, ecc_uncorrected=9)])
    assert verdict.fatal == {}
    verdict, _ = m.gpu_readings("n2", [gpu("n2", 0, ecc_uncorrected=3)])
    assert verdict.fatal == {}
    verdict, _ = m.gpu_readings("n2", [gpu("n2", 0, ecc_uncorrected=4)])
    assert verdict.fatal == {("n2", 0): "uncorrectable ECC errors rose to 4"}


def test_a_lasting_fatal_finding_is_reported_once_and_again_after_a_clean_reading():
    m = monitor()
    first, _ = m.gpu_readings("n1", [gpu(lost=True)])
    assert list(first.fatal) == [("n1", 0)]
    again, _ = m.gpu_readings("n1", [gpu(lost=True)])
    assert again.fatal == {}  # still lost: not news
    m.gpu_readings("n1", [gpu()])  # reads clean
    back, _ = m.gpu_readings("n1", [gpu(lost=True)])
    assert list(back.fatal) == [("n1", 0)]


def test_an_application_xid_after_a_clean_reading_is_news_again():
    m = monitor()
    assert list(m.gpu_readings("n1", [gpu(xids=(13,))])[0].application) == [("n1", 0)]
    m.gpu_readings("n1", [gpu()])
    assert list(m.gpu_readings("n1", [gpu(xids=(13,))])[0].application) == [("n1", 0)]


def test_a_backlog_is_judged_over_its_newest_two_spans_only(clock):
    # 40 steps arrive at once (span 10): only steps 20..39 are evaluated, so the call's
    # cost is bounded; the flag then rests on the first evaluated step that supports it.
    m = monitor()
    two_ranks(m, clock())
    m.history = {r: {} for r in m.ranks}
    for rank, r in m.ranks.items():
        steps = [(s, SLOW_S if rank == 1 else FAST_S, 0.1) for s in range(40)]
        for s0 in range(0, 40, 20):
            m.beat(rank, beat(r.pid, s0 + 20, clock.now + 1, steps[s0 : s0 + 20]))
    report, _ = m.stragglers()
    assert report.flagged == (1,) and report.through_step == 39
    assert m.flagged_since == {1: 20}


def _all_asked(m: HealthMonitor, nodes: str, at: float) -> float:
    """`nodes` watched (each answered once), then each asked at `at` and silent since."""
    for node in nodes:
        m.node_answered(node)
    for node in nodes:
        m.node_asked(node, at)
    return at


def test_every_node_silent_at_once_is_the_supervisors_own_link_until_the_isolated_timeout(
    clock,
):
    """A partition of the supervisor's node: every agent falls silent together while the
    ranks train on among themselves. None is lost before health.isolated_timeout_s; one
    node silent alone is lost after the heartbeat timeout as ever; a node Ray marks dead
    is lost at once."""
    m = monitor(heartbeat_timeout_s=3.0, isolated_timeout_s=30.0)
    t0 = _all_asked(m, "abc", clock())
    lost, reason = m.lost_nodes(t0 + 10.0)
    assert lost == [] and reason.startswith("every node silent for 10.0 s at once")
    assert "health.isolated_timeout_s=30" in reason and m.isolated_for(t0 + 10.0) == 10.0
    assert m.lost_nodes(t0 + 30.0)[0] == ["a", "b", "c"]  # then they are
    m.node_answered("a")  # one answers: the others are silent on their own
    assert m.isolated_for(t0 + 10.0) is None
    assert m.lost_nodes(t0 + 10.0)[0] == ["b", "c"]
    m.node_answered("b")
    m.node_answered("c")
    for node in "abc":
        m.node_asked(node, t0 + 20.0)
    m.ray_states({"c": False})  # Ray's own table: no waiting for that one
    assert m.lost_nodes(t0 + 25.0)[0] == ["a", "b", "c"]


def test_an_isolated_timeout_of_zero_treats_them_as_any_silent_node(clock):
    m = monitor(heartbeat_timeout_s=3.0, isolated_timeout_s=0.0)
    _all_asked(m, "ab", clock())
    assert m.lost_nodes(clock.advance(3.0))[0] == ["a", "b"]


def test_once_the_supervisors_link_is_back_a_node_still_silent_gets_its_own_timeout(clock):
    """After a spell of every node silent, the first to answer ends it; the others (their
    connections resending what the cut held back on TCP's backoff, up to about the spell's
    length after the heal) count their silence from the spell's length after then."""
    m = monitor(heartbeat_timeout_s=3.0, isolated_timeout_s=30.0)
    t0 = _all_asked(m, "ab", clock())
    assert m.lost_nodes(t0 + 12.0)[0] == []  # isolated
    m.node_answered("a")
    m.restart_silence(t0 + 12.0, grace_s=12.0)  # what the supervisor does when it ends
    assert m.isolated_for(t0 + 14.0) is None
    assert m.lost_nodes(t0 + 26.9)[0] == []
    assert m.lost_nodes(t0 + 27.0)[0] == ["b"]


def test_nodes_cut_a_moment_apart_are_one_spell(clock):
    """A partition reaches the nodes one after another: the last one silent for a third of
    the heartbeat timeout when the first passes it is the same spell."""
    m = monitor(heartbeat_timeout_s=3.0, isolated_timeout_s=30.0)
    for node in "abc":
        m.node_answered(node)
    t0 = clock()
    m.node_asked("a", t0)
    m.node_asked("b", t0 + 0.5)
    m.node_asked("c", t0 + 1.9)  # silent 1.1 s when a passes 3 s
    assert m.isolated_for(t0 + 3.0) == 3.0
    assert m.lost_nodes(t0 + 3.0)[0] == []
    m.node_answered("c")
    m.node_asked("c", t0 + 2.5)  # one that answered half a second ago is not quiet
    assert m.isolated_for(t0 + 3.0) is None
    assert m.lost_nodes(t0 + 3.0)[0] == ["a"]

"""health/hang_timeout.py and the monitor's part in it: with no health.hang_timeout_s the
hang timeout follows the job's own steps (a multiple of the longest, with a floor), a
generation's first step and copy waits get the startup allowance, and a rank still busy on
its CPU past the step timeout is not hung. Fake clock, no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.health.hang_timeout import HangPolicy, HangTimeouts, derive
from stalwart.health.liveness import Hang, hung_ranks
from stalwart.health.observations import RankView
from stalwart.orchestrator.spec import HealthSpec
from stalwart.orchestrator.supervisor.monitor import HealthMonitor

pytestmark = pytest.mark.timeout(30)

POLICY = HangPolicy()  # floor 20 s, 5x, startup 300 s, busy limit 1800 s, 5 steps
NOW = 10_000.0
BEAT = 3.0


def test_before_enough_steps_the_startup_allowance_applies_and_says_so():
    t = derive(POLICY, None, 0)
    assert (t.step_s, t.startup_s, t.derived) == (300.0, 300.0, True)
    assert t.why.startswith("not derived yet (0 of health.hang.min_steps=5 steps seen)")
    assert derive(POLICY, 0.1, 4).step_s == 300.0


def test_fast_steps_get_the_floor_and_slow_ones_a_multiple_of_the_longest():
    fast = derive(POLICY, 0.31, 5)
    assert fast.step_s == 20.0
    assert fast.why == ("health.hang.floor_s=20 (5 x the longest step seen, 0.31 s, is less)")
    slow = derive(POLICY, 12.0, 50)
    assert slow.step_s == 60.0 and slow.why == "5 x the longest step seen (12.00 s)"
    # Steps of minutes: the first-step and busy allowances never fall under the step's.
    huge = derive(POLICY, 400.0, 50)
    assert huge.step_s == huge.startup_s == huge.busy_limit_s == 2000.0


def view(rank: int, frozen_s: float, **kw: Any) -> RankView:
    return RankView(rank, "node-a", 10, NOW - frozen_s, NOW - 0.5, **kw)


def test_which_timeout_a_rank_gets():
    t = derive(POLICY, 0.2, 10)
    assert t.for_rank(view(0, 1)) == 20.0
    assert t.for_rank(view(0, 1, stepped=False)) == 300.0  # its generation's first step
    assert t.for_rank(view(0, 1, copies_since=NOW - 1)) == 60.0  # backpressure
    assert t.for_rank(view(0, 1, busy=True)) == 1800.0
    # Busy inside a collective (spinning on it) is waiting, with the step's timeout.
    assert t.for_rank(view(0, 1, busy=True, collective_since=NOW - 1)) == 20.0
    # Fixed by the spec: one timeout for all of them.
    fixed = HangTimeouts.fixed(7.0)
    assert {
        fixed.for_rank(view(0, 1, **kw)) for kw in ({}, {"stepped": False}, {"busy": True})
    } == {7.0}


def test_an_idle_rank_is_hung_after_the_floor_and_a_busy_one_is_not():
    t = derive(POLICY, 0.2, 10)
    waiting = view(1, 25, collective_since=NOW - 24)
    hang, why = hung_ranks([view(0, 25), waiting], NOW, t, BEAT)
    assert hang == Hang((0,), (1,), 25.0)
    assert why.startswith(
        "rank(s) 0 made no step for 25.0 s (hang timeout 20.0 s: health.hang.floor_s=20"
    )
    # The same rank using its CPU (an evaluation): the others wait for it, nobody is hung.
    busy = view(0, 25, busy=True)
    assert hung_ranks([busy, waiting], NOW, t, BEAT) == (
        None,
        "ranks frozen inside a collective while others still step: waiting",
    )
    hang, why = hung_ranks([view(0, 1801, busy=True)], NOW, t, BEAT)
    assert hang is not None and "busy on its CPU, health.hang.busy_limit_s=1800" in why


def test_a_first_step_gets_the_startup_allowance_and_copy_waits_their_own():
    t = derive(POLICY, 0.2, 10)
    assert hung_ranks([view(0, 250, stepped=False)], NOW, t, BEAT) == (None, "steps advancing")
    hang, why = hung_ranks([view(0, 301, stepped=False)], NOW, t, BEAT)
    assert hang is not None and "its generation's first step, health.hang.startup_s=300" in why
    copying = [view(r, 50, copies_since=NOW - 50) for r in range(2)]
    assert hung_ranks(copying, NOW, t, BEAT) == (None, "steps advancing")
    copying = [view(r, 61, copies_since=NOW - 61) for r in range(2)]
    hang, why = hung_ranks(copying, NOW, t, BEAT)
    assert hang is not None and "replication is stuck" in why
    assert "waiting for its checkpoint copies, health.hang.copies_s=60" in why
    # Ranks in a collective behind the ones waiting for copies are not a stuck collective
    # while those still wait within their allowance.
    behind = [view(0, 50, copies_since=NOW - 50), view(1, 50, collective_since=NOW - 49)]
    assert hung_ranks(behind, NOW, t, BEAT)[0] is None


# --- the monitor --------------------------------------------------------------------------


def beat(step: int, at: float, recent: list[tuple], cpu: float | None = None) -> dict[str, Any]:
    return {
        "pid": 100,
        "step": step,
        "received_at": at,
        "recent": recent,
        "collective_since": None,
        "train_cpu_s": cpu,
    }


def test_the_monitor_derives_from_steps_after_each_generations_first(clock):
    m = HealthMonitor(HealthSpec())
    t0 = clock()
    m.start_generation({0: ("node-a", 100)}, t0)
    assert m.hang_timeouts().step_s == 300.0
    # The first step compiled for 9 s: left out. Then 0.1-0.3 s steps.
    m.beat(0, beat(1, t0 + 9, [(0, 9.0, 9.0)]))
    m.beat(0, beat(4, t0 + 10, [(0, 9.0, 9.0), (1, 0.1, 0.1), (2, 0.1, 0.3), (3, 0.1, 0.2)]))
    assert (m.longest_step_s, m.steps_seen) == (0.3, 3)
    assert m.hang_timeouts().step_s == 300.0  # 3 of 5 steps
    m.beat(0, beat(6, t0 + 11, [(4, 0.1, 0.2), (5, 0.1, 5.0)]))
    assert (m.longest_step_s, m.steps_seen) == (5.0, 5)
    assert m.hang_timeouts().step_s == 25.0
    # A new generation replays steps 4-5 after its first (3, restore and re-entry): the
    # replays are not counted again, and its first step is left out however long.
    m.start_generation({0: ("node-a", 100)}, t0 + 20)
    m.beat(0, beat(6, t0 + 40, [(3, 30.0, 30.0), (4, 0.1, 0.2), (5, 0.1, 0.2)]))
    assert (m.longest_step_s, m.steps_seen) == (5.0, 5)
    # The spec's value wins over all of it.
    fixed = HealthMonitor(HealthSpec(hang_timeout_s=4.0))
    assert fixed.hang_timeouts() == HangTimeouts.fixed(4.0)


def _stepped_monitor(clock) -> tuple[HealthMonitor, float]:
    m = HealthMonitor(HealthSpec())
    t0 = clock()
    m.start_generation({0: ("node-a", 100)}, t0)
    m.beat(0, beat(11, t0 + 2, [(s, 0.1, 0.1) for s in range(11)], cpu=1.0))
    return m, t0 + 2


def test_a_rank_that_stops_using_its_cpu_is_hung_after_the_floor(clock):
    m, t = _stepped_monitor(clock)
    for i in range(1, 25):  # beats every second, step 11 never finishes, no CPU used
        m.beat(0, beat(11, t + i, [], cpu=1.0))
    hang, why = m.hang(t + 24)
    assert hang is not None and hang.culprits == (0,) and "hang timeout 20.0 s" in why


def test_a_rank_busy_on_its_cpu_is_not_hung_until_the_busy_limit(clock):
    m, t = _stepped_monitor(clock)
    for i in range(1, 60):  # an evaluation: half a core, step 11 for a minute
        m.beat(0, beat(11, t + i, [], cpu=1.0 + 0.5 * i))
    assert m.hang(t + 59) == (None, "steps advancing")
    # It stops using the CPU (a deadlock in the evaluation): hung once its beats show it.
    for i in range(60, 75):
        m.beat(0, beat(11, t + i, [], cpu=1.0 + 0.5 * 59))
    hang, _ = m.hang(t + 74)
    assert hang is not None and hang.culprits == (0,)

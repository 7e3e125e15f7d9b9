"""health/liveness.py hung_ranks: culprits, ranks waiting for them, stuck collectives."""

from __future__ import annotations

from stalwart.health.hang_timeout import HangTimeouts
from stalwart.health.liveness import Hang, hung_ranks
from stalwart.health.observations import RankView

NOW = 5_000.0
BEAT = 3.0  # heartbeat timeout
HANG = HangTimeouts.fixed(60.0)  # health.hang_timeout_s


def rank(
    r: int,
    stepped_s_ago: float,
    in_collective_s: float | None = None,
    beat_age_s: float = 0.2,
) -> RankView:
    """A rank that last stepped `stepped_s_ago`, in a collective for `in_collective_s` (None:
    not in one), whose latest heartbeat is `beat_age_s` old."""
    return RankView(
        rank=r,
        node=f"node-{r % 2}",
        step=42,
        step_changed_at=NOW - stepped_s_ago,
        beat_at=NOW - beat_age_s,
        collective_since=None if in_collective_s is None else NOW - in_collective_s,
    )


def test_culprit_outside_a_collective_and_recent_steppers_waiting_for_it():
    # Rank 2 froze in its own step; the others finished a step since, then entered the
    # all-reduce rank 2 never joins. They are not frozen yet, but they wait for rank 2.
    ranks = [
        rank(0, stepped_s_ago=1.0, in_collective_s=0.9),
        rank(1, stepped_s_ago=5.0, in_collective_s=4.9),
        rank(2, stepped_s_ago=61.0),
        rank(3, stepped_s_ago=0.5, in_collective_s=0.4),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(2,), waiting=(0, 1, 3), stalled_for_s=61.0)
    assert reason == (
        "rank(s) 2 made no step for 61.0 s (health.hang_timeout_s=60.0) outside any "
        "collective; rank(s) 0, 1, 3 wait for them"
    )


def test_ranks_outside_a_collective_that_still_step_are_neither_culprits_nor_waiting():
    ranks = [
        rank(0, stepped_s_ago=120.0),  # the culprit
        rank(1, stepped_s_ago=2.0),  # busy computing, not in a collective
        rank(2, stepped_s_ago=2.0, in_collective_s=1.0),
    ]
    hang, _ = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(0,), waiting=(2,), stalled_for_s=120.0)


def test_several_culprits_stall_for_the_shortest_freeze():
    ranks = [
        rank(0, stepped_s_ago=200.0),
        rank(1, stepped_s_ago=90.0),
        rank(2, stepped_s_ago=3.0, in_collective_s=2.0),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(0, 1), waiting=(2,), stalled_for_s=90.0)
    assert reason.startswith("rank(s) 0, 1 made no step for 90.0 s")


def test_frozen_in_a_collective_while_another_rank_advances_is_waiting_not_hung():
    ranks = [
        rank(0, stepped_s_ago=100.0, in_collective_s=99.0),
        rank(1, stepped_s_ago=100.0, in_collective_s=99.0),
        rank(2, stepped_s_ago=10.0),  # slow, but still stepping: not hung yet
    ]
    assert hung_ranks(ranks, NOW, HANG, BEAT) == (
        None,
        "ranks frozen inside a collective while others still step: waiting",
    )


def test_frozen_in_a_collective_while_another_just_entered_one_is_waiting():
    ranks = [
        rank(0, stepped_s_ago=100.0, in_collective_s=99.0),
        rank(1, stepped_s_ago=1.0, in_collective_s=0.5),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang is None
    assert reason.endswith(": waiting")


def test_every_beating_rank_frozen_in_a_collective_is_a_stuck_collective():
    ranks = [
        rank(0, stepped_s_ago=75.0, in_collective_s=74.0),
        rank(1, stepped_s_ago=80.0, in_collective_s=79.0),
        rank(2, stepped_s_ago=90.0, in_collective_s=89.0),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(), waiting=(0, 1, 2), stalled_for_s=75.0)
    assert reason == (
        "all 3 beating ranks have waited in a collective for 75.0 s "
        "(health.hang_timeout_s=60.0): the collective is stuck"
    )


def test_stale_culprit_is_ignored_and_the_rest_is_a_stuck_collective():
    # Rank 0 would be the culprit, but its heartbeats stopped: it is lost, not hung.
    ranks = [
        rank(0, stepped_s_ago=300.0, beat_age_s=BEAT),
        rank(1, stepped_s_ago=70.0, in_collective_s=69.0),
        rank(2, stepped_s_ago=70.0, in_collective_s=69.0),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(), waiting=(1, 2), stalled_for_s=70.0)
    assert "the collective is stuck" in reason


def test_stale_stepping_rank_does_not_make_the_others_wait():
    # Rank 2 last beat long ago (just after a step): it does not count as advancing.
    ranks = [
        rank(0, stepped_s_ago=70.0, in_collective_s=69.0),
        rank(1, stepped_s_ago=70.0, in_collective_s=69.0),
        rank(2, stepped_s_ago=10.0, beat_age_s=9.0),
    ]
    hang, _ = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(), waiting=(0, 1), stalled_for_s=70.0)


def test_stale_rank_in_a_collective_is_not_listed_as_waiting():
    ranks = [
        rank(0, stepped_s_ago=100.0),
        rank(1, stepped_s_ago=100.0, in_collective_s=99.0),
        rank(2, stepped_s_ago=100.0, in_collective_s=99.0, beat_age_s=30.0),
    ]
    hang, _ = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(0,), waiting=(1,), stalled_for_s=100.0)


def test_only_stale_ranks_is_no_hang():
    ranks = [rank(r, stepped_s_ago=500.0, beat_age_s=BEAT + r) for r in range(3)]
    assert hung_ranks(ranks, NOW, HANG, BEAT) == (None, "no fresh heartbeats")

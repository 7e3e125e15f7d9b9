"""health/liveness.py: lost nodes (silent, dead agent, dead in Ray) and hung ranks."""

from __future__ import annotations

import pytest

from stalwart.health.hang_timeout import HangTimeouts
from stalwart.health.liveness import Hang, hung_ranks, lost_nodes
from stalwart.health.observations import NodeView, RankView

NOW = 1_000.0
BEAT = 3.0  # heartbeat timeout
HANG = HangTimeouts.fixed(300.0)  # health.hang_timeout_s


def node(name: str, silent_s: float | None = None, **kw) -> NodeView:
    """`silent_s`: how long its oldest report request has gone unanswered (None: none)."""
    return NodeView(name, unanswered_since=None if silent_s is None else NOW - silent_s, **kw)


def rank(
    r: int,
    frozen_s: float = 0.0,
    beat_age_s: float = 0.5,
    in_collective: bool = False,
    node_name: str = "node-a",
) -> RankView:
    return RankView(
        rank=r,
        node=node_name,
        step=10,
        step_changed_at=NOW - frozen_s,
        beat_at=NOW - beat_age_s,
        collective_since=NOW - frozen_s + 0.01 if in_collective else None,
    )


# --- lost_nodes -------------------------------------------------------------------------------


def test_no_nodes_nothing_lost():
    assert lost_nodes([], NOW, BEAT) == ([], "all nodes answering")


def test_answering_nodes_are_not_lost():
    lost, reason = lost_nodes([node("a", silent_s=0.0), node("b", silent_s=2.9)], NOW, BEAT)
    assert lost == []
    assert reason == "all nodes answering"


def test_silent_node_is_lost_at_the_timeout():
    lost, reason = lost_nodes([node("a", silent_s=1.0), node("b", silent_s=3.0)], NOW, BEAT)
    assert lost == ["b"]
    assert "node b: agent silent for 3.0 s" in reason
    assert "health.heartbeat_timeout_s=3.0" in reason


def test_silence_just_below_the_timeout_is_not_lost():
    lost, _ = lost_nodes([node("a", silent_s=2.999)], NOW, BEAT)
    assert lost == []


def test_node_with_no_unanswered_request_is_never_silent():
    # A supervisor that asked nobody (busy in a recovery) must not see every node as lost.
    assert NodeView("a").unanswered_since is None
    assert lost_nodes([NodeView("a"), node("b")], NOW + 10**6, BEAT) == (
        [],
        "all nodes answering",
    )


def test_silence_is_measured_from_the_oldest_unanswered_request():
    nodes = [NodeView("a", unanswered_since=NOW - 4.0), NodeView("b", unanswered_since=NOW)]
    assert lost_nodes(nodes, NOW, BEAT)[0] == ["a"]
    assert lost_nodes(nodes, NOW + 3.0, BEAT)[0] == ["a", "b"]


def test_node_dead_in_ray_is_lost_even_if_it_just_reported():
    lost, reason = lost_nodes([node("a", ray_alive=False)], NOW, BEAT)
    assert lost == ["a"]
    assert reason == "node a: Ray marked it dead"


def test_node_with_dead_agent_is_lost_even_if_it_just_reported():
    lost, reason = lost_nodes([node("a", agent_dead=True)], NOW, BEAT)
    assert lost == ["a"]
    assert reason == "node a: its agent died"


def test_ray_dead_is_the_reason_given_over_a_dead_agent_and_silence():
    nodes = [node("a", silent_s=60, agent_dead=True, ray_alive=False)]
    lost, reason = lost_nodes(nodes, NOW, BEAT)
    assert lost == ["a"]
    assert reason == "node a: Ray marked it dead"


def test_dead_agent_is_the_reason_given_over_silence():
    lost, reason = lost_nodes([node("a", silent_s=60, agent_dead=True)], NOW, BEAT)
    assert lost == ["a"]
    assert reason == "node a: its agent died"


def test_several_lost_nodes_sorted_with_one_reason_each():
    nodes = [
        node("c", silent_s=10.0),
        node("a", agent_dead=True),
        node("b"),
        node("d", ray_alive=False),
    ]
    lost, reason = lost_nodes(nodes, NOW, BEAT)
    assert lost == ["a", "c", "d"]
    assert reason.split("; ") == [
        "node a: its agent died",
        "node c: agent silent for 10.0 s (health.heartbeat_timeout_s=3.0)",
        "node d: Ray marked it dead",
    ]


def test_long_node_ids_are_shortened_in_the_reason_only():
    long_id = "f" * 40
    lost, reason = lost_nodes([node(long_id, ray_alive=False)], NOW, BEAT)
    assert lost == [long_id]
    assert reason == f"node {'f' * 12}: Ray marked it dead"


def test_timeout_is_a_parameter():
    nodes = [node("a", silent_s=5.0)]
    assert lost_nodes(nodes, NOW, 10.0)[0] == []
    assert lost_nodes(nodes, NOW, 5.0)[0] == ["a"]


# --- hung_ranks -------------------------------------------------------------------------------


def test_no_ranks_is_no_hang():
    assert hung_ranks([], NOW, HANG, BEAT) == (None, "no fresh heartbeats")


def test_advancing_ranks_are_not_hung():
    ranks = [rank(0, frozen_s=1.0), rank(1, frozen_s=299.9)]
    assert hung_ranks(ranks, NOW, HANG, BEAT) == (None, "steps advancing")


def test_ranks_without_fresh_heartbeats_are_not_hung_but_lost():
    ranks = [rank(0, frozen_s=1_000.0, beat_age_s=3.0), rank(1, frozen_s=1_000.0, beat_age_s=50)]
    assert hung_ranks(ranks, NOW, HANG, BEAT) == (None, "no fresh heartbeats")


def test_one_rank_outside_a_collective_is_the_culprit_the_others_wait():
    ranks = [
        rank(0, frozen_s=400.0, in_collective=True),
        rank(1, frozen_s=400.0),  # stuck in its own step
        rank(2, frozen_s=400.0, in_collective=True),
        rank(3, frozen_s=400.0, in_collective=True),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(1,), waiting=(0, 2, 3), stalled_for_s=400.0)
    assert reason == (
        "rank(s) 1 made no step for 400.0 s (health.hang_timeout_s=300.0) outside any "
        "collective; rank(s) 0, 2, 3 wait for them"
    )


def test_hang_exactly_at_the_timeout_counts():
    hang, _ = hung_ranks([rank(0, frozen_s=300.0)], NOW, HANG, BEAT)
    assert hang is not None
    assert hang.culprits == (0,)
    assert hang.waiting == ()


def test_culprit_without_waiters_has_no_wait_clause():
    hang, reason = hung_ranks([rank(2, frozen_s=301.0)], NOW, HANG, BEAT)
    assert hang == Hang((2,), (), 301.0)
    assert "wait for them" not in reason
    assert reason.startswith("rank(s) 2 made no step for 301.0 s")


def test_everyone_in_a_collective_means_the_collective_is_stuck():
    ranks = [rank(r, frozen_s=350.0, in_collective=True) for r in range(3)]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang(culprits=(), waiting=(0, 1, 2), stalled_for_s=350.0)
    assert reason == (
        "all 3 beating ranks have waited in a collective for 350.0 s "
        "(health.hang_timeout_s=300.0): the collective is stuck"
    )


def test_a_single_frozen_rank_is_hung_while_others_advance():
    ranks = [rank(0, frozen_s=1.0), rank(1, frozen_s=500.0), rank(2, frozen_s=2.0)]
    hang, _ = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang((1,), (), 500.0)


def test_silent_rank_is_left_out_of_the_hang():
    # Rank 3 stopped beating: it is lost, not hung; the rest are judged without it.
    ranks = [
        rank(0, frozen_s=400.0, in_collective=True),
        rank(1, frozen_s=400.0, in_collective=True),
        rank(3, frozen_s=400.0, beat_age_s=10.0),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang == Hang((), (0, 1), 400.0)
    assert "the collective is stuck" in reason


def test_stalled_for_is_the_shortest_frozen_time():
    ranks = [rank(0, frozen_s=320.0), rank(1, frozen_s=450.0, in_collective=True)]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang.stalled_for_s == pytest.approx(320.0)
    assert "320.0 s" in reason


def test_culprits_and_waiters_are_sorted():
    ranks = [
        rank(5, frozen_s=400.0),
        rank(1, frozen_s=400.0),
        rank(4, frozen_s=400.0, in_collective=True),
        rank(0, frozen_s=400.0, in_collective=True),
    ]
    hang, reason = hung_ranks(ranks, NOW, HANG, BEAT)
    assert hang.culprits == (1, 5)
    assert hang.waiting == (0, 4)
    assert reason.startswith("rank(s) 1, 5 made no step")


def test_timeouts_are_parameters():
    ranks = [rank(0, frozen_s=10.0, beat_age_s=1.0)]
    assert hung_ranks(ranks, NOW, HangTimeouts.fixed(5.0), BEAT)[0] == Hang((0,), (), 10.0)
    assert hung_ranks(ranks, NOW, HangTimeouts.fixed(20.0), BEAT)[0] is None
    assert hung_ranks(ranks, NOW, HangTimeouts.fixed(5.0), 1.0) == (None, "no fresh heartbeats")


def test_hang_is_frozen():
    with pytest.raises(AttributeError):
        Hang((0,), (), 1.0).culprits = (1,)


def test_a_rank_waiting_for_its_copies_is_waiting_not_a_culprit():
    """checkpoint.max_lag_steps: a rank held at a step boundary until its checkpoint copies
    reach the peers is not hung (the links are the cause); all of them so: replication is
    stuck, and said so."""
    copying = RankView(2, "node-a", 10, NOW - 400, NOW - 0.5, copies_since=NOW - 399)
    hang, why = hung_ranks(
        [rank(0, frozen_s=400), rank(1, 400, in_collective=True), copying], NOW, HANG, BEAT
    )
    assert hang is not None and hang.culprits == (0,) and hang.waiting == (1, 2), why
    all_copying = [
        RankView(r, "node-a", 10, NOW - 400, NOW - 0.5, copies_since=NOW - 399) for r in range(3)
    ]
    hang, why = hung_ranks(all_copying, NOW, HANG, BEAT)
    assert hang is not None and hang.culprits == () and "replication is stuck" in why

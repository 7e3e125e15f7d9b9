"""Gemini group placement of shard copies: the plan and its failure guarantee."""

from __future__ import annotations

import itertools

import pytest

from stalwart.ckpt.replicas import effective, groups, peers

pytestmark = pytest.mark.timeout(60)


def _nodes(n: int) -> list[str]:
    return [f"node{i:02d}" for i in range(n)]


def test_groups_of_replicas_nodes_with_the_remainder_in_the_last_group():
    assert groups(_nodes(6), 2) == [
        ["node00", "node01"],
        ["node02", "node03"],
        ["node04", "node05"],
    ]
    assert groups(_nodes(5), 2) == [["node00", "node01"], ["node02", "node03", "node04"]]
    assert groups(_nodes(7), 3) == [
        ["node00", "node01", "node02"],
        ["node03", "node04", "node05", "node06"],
    ]


def test_every_party_computes_the_same_plan_whatever_the_order():
    nodes = _nodes(9)
    assert peers(nodes, 3) == peers(list(reversed(nodes)), 3) == peers(set(nodes), 3)


def test_replicas_one_keeps_no_copies():
    assert peers(_nodes(3), 1) == {"node00": [], "node01": [], "node02": []}
    assert effective(_nodes(3), 1) == 1


def test_fewer_nodes_than_replicas_is_one_group_and_fewer_copies():
    assert groups(_nodes(2), 3) == [["node00", "node01"]]
    assert effective(_nodes(2), 3) == 2
    assert effective(_nodes(1), 2) == 1
    assert peers(_nodes(1), 2) == {"node00": []}
    assert groups([], 2) == [] and peers([], 2) == {} and effective([], 2) == 0


def test_bad_replica_count_is_refused():
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        groups(_nodes(3), 0)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("n", range(1, 11))
def test_losing_any_replicas_minus_one_nodes_leaves_a_copy_of_every_shard(n, replicas):
    nodes = _nodes(n)
    plan = peers(nodes, replicas)
    holders = {node: {node, *plan[node]} for node in nodes}  # whose shards -> who holds them
    for node in nodes:
        assert len(holders[node]) >= effective(nodes, replicas)
    if n < replicas:
        return  # fewer nodes than copies: losing all of them loses everything
    for lost in itertools.combinations(nodes, replicas - 1):
        for owner, where in holders.items():
            assert where - set(lost), f"{owner}'s shards lost with {lost}"


def test_a_copy_is_never_on_its_own_node_and_groups_are_symmetric():
    plan = peers(_nodes(8), 3)
    for node, others in plan.items():
        assert node not in others
        for other in others:
            assert node in plan[other]


# --- the mesh: nodes holding the same shard (HSDP's replicas) in different groups ---------


def test_nodes_holding_the_same_shard_go_to_different_groups():
    # One rank per node, mesh [[0, 1], [2, 3]] placed A:0 B:2 C:1 D:3: A and B hold the
    # same shard (replicas along the replicate dimension), so do C and D.
    holds = {"A": {"s0"}, "B": {"s0"}, "C": {"s1"}, "D": {"s1"}}
    assert groups(["A", "B", "C", "D"], 2) == [["A", "B"], ["C", "D"]]
    assert groups(["A", "B", "C", "D"], 2, holds) == [["A", "C"], ["B", "D"]]
    assert peers(["D", "C", "B", "A"], 2, holds)["A"] == ["C"]


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("replicas", [2, 3])
def test_the_mesh_aware_groups_keep_the_guarantee(n, replicas):
    nodes = [f"n{i}" for i in range(n)]
    holds = {node: {f"s{i % 2}"} for i, node in enumerate(nodes)}  # two shards, alternating
    out = groups(nodes, replicas, holds)
    assert sorted(x for g in out for x in g) == sorted(nodes)  # a partition
    assert all(len(g) >= min(replicas, n) for g in out)
    plan = peers(nodes, replicas, holds)
    for lost in itertools.combinations(nodes, min(replicas, n) - 1):
        for node in lost:  # its shards: a copy on a peer that is not lost
            assert any(p not in lost for p in plan[node]), (lost, node, plan[node])


def test_shards_are_kept_apart_where_the_nodes_allow_it_only():
    # Three nodes of one shard and one of another: a group of two must pair two alike.
    holds = {"A": {"s0"}, "B": {"s0"}, "C": {"s0"}, "D": {"s1"}}
    out = groups(["A", "B", "C", "D"], 2, holds)
    assert out == [["A", "D"], ["B", "C"]]

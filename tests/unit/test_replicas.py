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

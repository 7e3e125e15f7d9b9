"""Checkpoint tiers on a real multi-node local Ray: peer replicas in memory, the restore
chain. The oracle is the model digest of the failure-free run of the same spec."""

from __future__ import annotations

import copy

import pytest

from tests.component.conftest import make_baseline, make_runner, small_spec
from tests.component.multinode import WORKER_NODE_CPUS, MultiNode

pytestmark = [pytest.mark.component, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def multinode():
    mn = MultiNode()
    try:
        yield mn
    finally:
        mn.shutdown()


@pytest.fixture(scope="module")
def _clean_runs():
    return {}


@pytest.fixture
def crun(multinode, tmp_path):
    multinode.ensure_worker_nodes(3)
    return make_runner(multinode.address, tmp_path)


@pytest.fixture
def cbaseline(crun, _clean_runs):
    return make_baseline(crun, _clean_runs)


def events_of(result, kind):
    return [e for e in result["events"] if e["type"] == kind]


def test_kill_node_with_two_replicas_restores_from_peer_memory(crun, cbaseline):
    every = 10
    spec = small_spec(
        steps=60,
        checkpoint={"every_steps": every, "replicas": 2},
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 35}],
    )
    result = crun(spec)
    assert result["status"] == "succeeded", result["error"]
    [plan] = events_of(result, "replica_plan")[:1]
    assert plan["copies"] == 2
    [lost] = events_of(result, "node_lost")
    assert events_of(result, "restart_from_scratch") == []
    gen2 = events_of(result, "generation")[1]
    # The lost node's ranks restore from a peer's memory, the others from their own.
    assert set(map(int, gen2["restored_remotely"])) == set(lost["ranks"])
    assert set(gen2["restored_remotely"].values()) == {"peer"}
    assert gen2["restore_tiers"] == {"memory": 4 - len(lost["ranks"]), "peer": len(lost["ranks"])}
    [recovered] = events_of(result, "recovered")
    assert recovered["restore_tiers"] == gen2["restore_tiers"]
    # At most every_steps steps redone: the step-30 snapshot had its copies by step 35.
    assert gen2["restore_step"] == 30
    for f in result["failures"]:
        assert f["steps_redone"] <= every, f
    assert result["replication"]["copies"] == 2
    assert result["replication"]["errors"] == 0 or result["replication"]["sent_bytes"] > 0
    assert result["model_digest"] == cbaseline(spec)["model_digest"]


def test_one_replica_loses_the_node_shards_and_starts_over_exactly(crun, cbaseline):
    spec = small_spec(
        steps=40,
        checkpoint={"every_steps": 1, "replicas": 1},
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 15}],
    )
    result = crun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert events_of(result, "replica_plan")[0]["copies"] == 1
    [scratch] = events_of(result, "restart_from_scratch")
    assert "checkpoint.replicas=1" in scratch["reason"]
    assert result["replication"]["sent_bytes"] == 0
    assert result["model_digest"] == cbaseline(spec)["model_digest"]


def test_commit_waits_for_the_copies_and_memory_stays_bounded(crun):
    """Per-step snapshots with replicas=2: the committed step follows training closely, and
    no node keeps more than the retained commits plus a few newest steps per rank."""
    spec = small_spec(steps=80, checkpoint={"every_steps": 1, "replicas": 2})
    result = crun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["committed_step"] is not None and result["committed_step"] >= 70
    lags = [e["commit_lag_steps"] for e in events_of(result, "throughput")]
    assert lags and all(lag is not None for lag in lags[1:])
    assert result["replication"]["sent_bytes"] > 0 and result["replication"]["errors"] == 0
    # Each node holds its own ranks' shards and copies of its group's other ranks: per rank
    # the 2 retained commits, the 3 newest, the step being replicated and copies not yet
    # committed (the lag). Bounded, far from the 80 steps x 4 ranks kept without trimming.
    held = result["replication"]["shards_held"]
    assert held and all(n <= 4 * 10 for n in held.values()), held


def _two_nodes_spec(**changes):
    """2 ranks, one per node (2 CPUs each): one replica group of both nodes."""
    return small_spec(
        workers=2,
        resources={"cpu": WORKER_NODE_CPUS},
        **changes,
    )


def _without_persist(spec):
    clean = copy.deepcopy(spec)
    clean["checkpoint"].pop("persist", None)
    return clean


def test_kill_node_and_drop_replicas_restore_from_durable_storage(
    multinode, crun, cbaseline, tmp_path
):
    # Ranks on two nodes (one replica group); a third node takes rank 0's replacement.
    uri = tmp_path / "durable"
    spec = _two_nodes_spec(
        steps=80,
        checkpoint={
            "every_steps": 1,
            "replicas": 2,
            "persist": {"uri": str(uri), "every_steps": 10, "keep_last": 2},
        },
        chaos__faults=[
            {"kind": "drop_replicas", "rank": 1, "at_step": 55},
            {"kind": "kill_node", "rank": 0, "at_step": 55},
        ],
    )
    result = crun(spec)
    assert result["status"] == "succeeded", result["error"]
    persisted = [e["step"] for e in events_of(result, "persisted")]
    assert persisted and all(s % 10 == 0 for s in persisted), persisted
    # Neither node's memory has a complete step: rank 0's node is gone, rank 1's was wiped.
    assert events_of(result, "restart_from_scratch") == []
    gen2 = events_of(result, "generation")[1]
    assert gen2["restore_tiers"] == {"durable": 2}
    assert 10 <= gen2["restore_step"] <= 50 and gen2["restore_step"] % 10 == 0
    assert gen2["restore_step"] in persisted
    # Only a step being written when the faults hit may fail (its node died or was wiped).
    assert all(e["step"] >= 50 for e in events_of(result, "persist_failed"))
    # keep_last=2: two complete checkpoints on storage, every one with its manifest.
    steps = sorted(p.name for p in (uri / spec["name"]).iterdir())
    assert len(steps) <= 3, steps  # 2 complete + possibly one being written at the end
    complete = [s for s in steps if (uri / spec["name"] / s / "manifest.json").exists()]
    assert len(complete) == 2, steps
    multinode.ensure_worker_nodes(3)  # the lost node's place, for the baseline's 2 ranks
    assert result["model_digest"] == cbaseline(_without_persist(spec))["model_digest"]

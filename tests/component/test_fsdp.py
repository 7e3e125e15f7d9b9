"""FSDP2 and HSDP under stalwart on a real multi-node local Ray with gloo: the loops of
examples/fsdp/ (fully_shard per block and on the root, AdamW, gradient clipping) recover in
process from faults inside the collectives of one mesh dimension, a hang, a lost node and a
kill during that recovery, and end with the failure-free model.

One job per layout carries every fault, in order (docs/chaos.md: several faults in one job
where that tests the same thing): a kill right after the rank issued its part of a
reduce-scatter (its peers are in the middle of it); a hang just before an all-gather (the
other ranks wait in it: on HSDP a subgroup's, on the shard dimension); the loss of rank 0's
node; a kill of another rank while that loss is being recovered (it restores)."""

from __future__ import annotations

import pytest

from tests.component.conftest import events_of, small_spec

pytestmark = [pytest.mark.component, pytest.mark.timeout(420)]

FAULTS = [
    {"kind": "kill_worker", "rank": 1, "at_step": 6, "in_collective": "reduce_scatter"},
    {"kind": "hang", "rank": 2, "at_step": 13, "in_collective": "all_gather"},
    {"kind": "kill_node", "rank": 0, "at_step": 22, "after_commit": True},
    {"kind": "kill_worker", "rank": 3, "at_step": 22, "during": "restore"},
]


def fsdp_spec(**changes) -> dict:
    return small_spec(
        name="fsdp",
        entrypoint="stalwart.examples.fsdp.train:train_loop",
        steps=32,
        health__hang_timeout_s=4.0,
        failure__max_restarts=6,
        **changes,
    )


@pytest.mark.parametrize("shard", [4, 2], ids=["fsdp2-4", "hsdp-2x2"])
def test_sharded_loop_recovers_bit_exact_from_collective_faults_hang_and_node_loss(
    shard, multinode, mrun, mbaseline
):
    spec = fsdp_spec(config__shard=shard, chaos__faults=FAULTS)
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    kinds = [(f["kind"], f["rank"]) for f in result["failures"]]
    assert kinds[:3] == [("worker_died", 1), ("hung", 2), ("node_lost", 0)], kinds
    assert ("worker_died", 3) in kinds[3:], kinds  # killed while it restored
    for f in result["failures"]:
        assert f["steps_redone"] is not None and f["steps_redone"] <= 1, f
    # The survivors were released from the collective they waited in by the abort, not
    # killed after failure.abort_timeout_s: each recovery replaced the failed ranks only.
    for f in result["failures"][:2]:
        assert f["phases_s"]["abort"] < 5.0, f
    recovered = events_of(result, "recovered")
    assert [sorted(r["replaced"]) for r in recovered[:2]] == [[1], [2]], recovered
    [lost] = events_of(result, "node_lost")
    assert 0 in lost["ranks"]
    multinode.ensure_worker_nodes(3)  # the lost node's place, for the baseline
    assert result["model_digest"] == mbaseline(spec)["model_digest"]

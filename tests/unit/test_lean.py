"""The lean rule (checkpoint.memory_budget under 6 x replicas; ckpt/footprint.py): a node
keeps 2 versions of each rank's state, in a ring of 2 slots whose older shard goes when its
rank names a newer floor (ckpt/ring.py), and 2 copies of each peer shard, the older dropped
as a newer one arrives (agent/replication.py ReplicaStore)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring_pipeline import RingPipeline
from stalwart.ckpt.snapshot import Snapshot
from stalwart.orchestrator.agent.actor import NodeAgent
from stalwart.orchestrator.agent.replication import ReplicaStore
from stalwart.orchestrator.spec import SpecError, validate
from tests.unit.test_ring import _state, _until

pytestmark = pytest.mark.timeout(60)


def _lean_agent(tmp_path, wait_s=10.0):
    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None, lean=True)
    sent: list[int] = []
    pipe = RingPipeline(
        lambda metas, n, k: agent.open_ring(0, metas, n, k),
        lambda: SnapshotPipeline(lambda snap: sent.append(snap.step)),
        generation=lambda: 1,
        wait_s=wait_s,
        lean=True,
    )
    return agent, pipe, sent


def test_a_lean_ring_holds_two_versions_and_moves_none_out(tmp_path):
    agent, pipe, sent = _lean_agent(tmp_path)
    model = torch.nn.Linear(16, 16)
    try:
        for step in range(8):
            pipe.submit(step, _state(step, model))
            _until(lambda s=step: agent.store.stored().get(0, [])[-1:] == [s])
            held = agent.store.stored()[0]
            assert held == list(range(max(0, step - 1), step + 1)), held
        assert pipe.drain(5) and sent == [] and pipe.stats.errors == 0
        (reader,) = agent.rings._readers.values()
        assert reader.ring.slots == 2
        # Every shard is in the ring: no slot file was made for a moved-out one.
        assert not [p for p in (tmp_path / "shm").rglob("*") if p.name.startswith("slot")]
    finally:
        agent.close()


def test_a_shard_being_sent_is_not_released_the_snapshot_waits(tmp_path):
    agent, pipe, _sent = _lean_agent(tmp_path, wait_s=0.5)
    model = torch.nn.Linear(16, 16)
    pinned = {1}
    agent.replicator.pinned = lambda: set(pinned)
    try:
        for step in range(3):
            pipe.submit(step, _state(step, model))
        # Step 1 is being sent: step 3 would have to take its slot, and is given up.
        pipe.submit(3, _state(3, model))
        assert pipe.stats.errors == 1 and "no free snapshot slot" in pipe.stats.last_error
        _until(lambda: agent.store.stored().get(0) == [1, 2])
        pinned.clear()
        pipe.submit(4, _state(4, model))
        # Step 2 is the newest it wrote: only what is older goes (1; 3 never came).
        _until(lambda: agent.store.stored().get(0) == [2, 4])
    finally:
        agent.close()


def _copy(step: int, nbytes: int = 64) -> Snapshot:
    payload = np.full(nbytes, step, dtype=np.uint8)
    return Snapshot(step, b"", (), payload, None)


def test_lean_copies_keep_the_newest_commit_and_the_one_arriving():
    store = ReplicaStore(lean=True)
    for step in (1, 2, 3):
        store.make_room(0, step)  # the channel, before the payload is read
        store.adopt(0, _copy(step))
    store.put(1, _copy(2))
    assert store.stored() == {0: [2, 3], 1: [2]}
    store.adopt(0, _copy(1))  # a late older copy takes nothing away
    assert store.stored()[0] == [1, 2, 3]
    store.make_room(0, 4)
    assert store.stored()[0] == [3]
    assert store.allocated() == 64 + 64  # rank 0's copy of 3 and rank 1's of 2: no spares
    plain = ReplicaStore()
    for step in (1, 2, 3):
        plain.adopt(0, _copy(step))
    assert plain.make_room(0, 4) == 0 and plain.stored()[0] == [1, 2, 3]


def test_the_budget_takes_the_lean_rule_below_six_versions_per_copy():
    base = {"name": "j", "entrypoint": "m:f", "steps": 10, "workers": 2}
    lean = validate({**base, "checkpoint": {"memory_budget": 4}}).checkpoint
    assert lean.lean and lean.max_lag_steps == 0 and lean.versions == 2
    roomy = validate({**base, "checkpoint": {"memory_budget": 12}}).checkpoint
    assert not roomy.lean and roomy.max_lag_steps == 2 and roomy.versions == 6
    three = validate({**base, "checkpoint": {"memory_budget": 17, "replicas": 3}}).checkpoint
    assert three.lean
    refused = {
        "too small": ({"memory_budget": 5, "replicas": 3}, "at least 6"),
        "a lag": ({"memory_budget": 4, "max_lag_steps": 1}, "max_lag_steps must be 0"),
        "persisting": ({"memory_budget": 4, "persist": {"uri": "/tmp/x"}}, "checkpoint.persist"),
    }
    for ckpt, message in refused.values():
        with pytest.raises(SpecError, match=message):
            validate({**base, "checkpoint": ckpt})

"""A rank restores its own shard straight from its node's shared memory: the node agent names
where the payload lies (NodeAgent.locate_shard: a ring slot or a slot file), the rank maps it
read-only (ckpt/store.py read_in_place), one copy in all, none through Ray."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring_pipeline import RingPipeline
from stalwart.ckpt.snapshot import restore
from stalwart.ckpt.store import read_in_place
from stalwart.orchestrator.agent.actor import NodeAgent
from tests.unit.test_ring import _state, _until

pytestmark = pytest.mark.timeout(60)


def test_a_shard_is_read_in_place_from_its_ring_or_its_slot_file(tmp_path):
    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    pipe = RingPipeline(
        lambda metas, n, k: agent.open_ring(0, metas, n, k),
        lambda: SnapshotPipeline(lambda snap: None),
        generation=lambda: 1,
    )
    model = torch.nn.Linear(32, 32)
    try:
        for step in range(3):
            pipe.submit(step, _state(step, model))
        _until(lambda: agent.store.stored().get(0) == [0, 1, 2])
        where = agent.locate_shard(0, 2)
        assert where["path"].startswith(str(tmp_path)) and where["offset"] > 0
        snap = read_in_place(where, 2)
        held = agent.get_shard(0, 2)
        assert snap.intact() and np.array_equal(np.asarray(snap.payload), held.payload)
        back = restore(snap)
        assert back["step"] == 2 and torch.equal(back["model"]["weight"], model.weight)
        # Moved out of the ring into a slot file of its own: read there, from its start.
        assert agent.store.move_out(0, 1)
        moved = agent.locate_shard(0, 1)
        assert moved["offset"] == 0 and moved["path"] != where["path"]
        assert read_in_place(moved, 1).intact()
        assert agent.locate_shard(0, 7) is None  # not held
        os.unlink(moved["path"])  # its file gone (a ring closed under it): not read
        assert read_in_place(moved, 1) is None
    finally:
        agent.close()

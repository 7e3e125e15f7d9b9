"""A rank's heartbeat through its snapshot ring (ckpt/ring.py's heartbeat area): written by
the rank's beat thread, read by its node agent when it reports, with no call per beat; a
rank without an open ring (before its first snapshot, or through Ray) still calls. A real
hub and store under a temporary folder, no Ray."""

from __future__ import annotations

import time

import pytest
import torch

from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring import BEAT_CAP, W_BEAT_SEQ
from stalwart.orchestrator.agent.rings import newest_beats
from stalwart.orchestrator.worker import heartbeat
from tests.unit.test_ring import _Node, _pipeline, _state

pytestmark = pytest.mark.timeout(60)


def _beat(step: int, sent_at: float, **extra) -> dict:
    return {
        "rank": 2,
        "pid": 4242,
        "generation": 1,
        "step": step,
        "recent": [(step, 0.01, 0.02)],
        "metrics": {"loss": float("nan")},
        "sent_at": sent_at,
        **extra,
    }


def test_a_ranks_heartbeats_go_through_its_ring_and_the_hub_reads_the_newest(tmp_path):
    node = _Node(tmp_path / "n")
    pipe = _pipeline(node, rank=2)
    model = torch.nn.Linear(4, 4)
    try:
        # No ring before the first snapshot: the beat goes by call.
        assert not pipe.write_beat(heartbeat.encode(_beat(0, time.time())))
        assert node.hub.beats() == {}
        pipe.submit(0, _state(0, model))  # opens the rank's ring
        sent = time.time()
        assert pipe.write_beat(heartbeat.encode(_beat(5, sent)))
        [(rank, got)] = node.hub.beats().items()
        # Received when it was written (same machine), as JSON carries it (a NaN loss too).
        assert rank == 2 and got["step"] == 5 and got["received_at"] == sent
        assert got["recent"] == [[5, 0.01, 0.02]] and got["metrics"]["loss"] != 0
        assert pipe.write_beat(heartbeat.encode(_beat(6, sent + 0.1)))
        assert node.hub.beats()[2]["step"] == 6
        # A clock ahead of the agent's does not make a beat look newer than now.
        ahead = time.time() + 60
        assert pipe.write_beat(heartbeat.encode(_beat(7, ahead)))
        assert node.hub.beats()[2]["received_at"] <= time.time()
        # Too large for the area, or not JSON: by call (the ring keeps the last beat).
        assert not pipe.write_beat(heartbeat.encode(_beat(8, sent, blob="x" * BEAT_CAP)))
        assert heartbeat.encode(_beat(8, sent, odd=object())) is None
        assert not pipe.write_beat(None)
        assert node.hub.beats()[2]["step"] == 7
        # A closed ring (ranks renumbered, shards moved to memory): by call, and the hub
        # no longer reports the closed ring's beat.
        node.hub.close_rank(2)
        assert not pipe.write_beat(heartbeat.encode(_beat(9, time.time())))
        assert node.hub.beats() == {}
        ray_path = _pipeline(
            node,
            open_ring=lambda metas, n, k: None,
            fallback=lambda: SnapshotPipeline(lambda snap: None),
        )
        ray_path.submit(0, _state(0, model))
        assert not ray_path.write_beat(heartbeat.encode(_beat(1, time.time())))
    finally:
        node.close()


def test_a_beat_being_rewritten_or_not_a_beat_is_never_read(tmp_path):
    node = _Node(tmp_path / "n")
    pipe = _pipeline(node, rank=1)
    try:
        pipe.submit(0, _state(0, torch.nn.Linear(4, 4)))
        ring = node.hub._readers[next(iter(node.hub._readers))].ring
        assert ring.read_beat() is None  # none written yet
        assert ring.write_beat(heartbeat.encode(_beat(3, time.time())))
        assert ring.read_beat() is not None
        # The rank stopped half-way through a write (killed): odd, never taken.
        ring.words[W_BEAT_SEQ] += 1
        assert ring.read_beat() is None and node.hub.beats() == {}
        # Whole, but not a beat (no sent_at, or not JSON): left out, as a lost call is.
        ring.words[W_BEAT_SEQ] += 1
        assert ring.write_beat(b'{"step": 3}') and node.hub.beats() == {}
        assert ring.write_beat(b"\xff\x00") and node.hub.beats() == {}
    finally:
        node.close()


def test_the_newest_of_a_ranks_ring_and_call_beats_is_reported():
    called = {0: {"step": 4, "sent_at": 10.0}, 1: {"step": 9, "sent_at": 30.0}}
    ringed = {0: {"step": 5, "sent_at": 11.0}, 1: {"step": 8, "sent_at": 29.0}, 2: {"sent_at": 1.0}}
    got = newest_beats(called, ringed)
    assert {r: b.get("step") for r, b in got.items()} == {0: 5, 1: 9, 2: None}
    assert called[0]["step"] == 4  # the agent's own record is not changed


def test_the_agent_keeps_a_ranks_newest_beat_when_its_ring_closes(tmp_path):
    """A rank called before its first snapshot, then wrote into its ring; the node's shared
    memory fills up and the rings close: the agent still reports the ring's newer beat (not
    the older call's, whose step would look like a step back and a long stall)."""
    from stalwart.orchestrator.agent.actor import NodeAgent

    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    pipe = _pipeline(None, open_ring=lambda metas, n, k: agent.open_ring(0, metas, n, k))
    try:
        agent.heartbeat(0, _beat(1, time.time() - 5))
        pipe.submit(0, _state(0, torch.nn.Linear(4, 4)))
        assert pipe.write_beat(heartbeat.encode(_beat(40, time.time())))
        assert agent.report()["beats"][0]["step"] == 40
        agent.store.fall_back("the file system is full (test)")
        assert not pipe.write_beat(heartbeat.encode(_beat(41, time.time())))  # closed
        assert agent.report()["beats"][0]["step"] == 40
        agent.forget(0)
        assert agent.report()["beats"] == {}
    finally:
        agent.close()

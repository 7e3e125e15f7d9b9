"""checkpoint.max_lag_steps on a node: the agent's CopyGate publishes how far each rank's
copies on peers are (agent/copy_gate.py) in the rank's snapshot ring (ckpt/ring.py), and
the rank waits at a step boundary while they lag too far (worker/copy_wait.py). A real
ring hub and ring files under a temporary folder; no Ray."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from stalwart.ckpt.ring import pack_replicated, unpack_replicated
from stalwart.ckpt.snapshot import SnapshotBuffer
from stalwart.orchestrator.agent.copy_gate import CopyGate
from stalwart.orchestrator.agent.rings import RingHub
from stalwart.orchestrator.worker.copy_wait import CopyWait

pytestmark = pytest.mark.timeout(60)


def _hub(tmp_path) -> RingHub:
    return RingHub(tmp_path, lambda *a: False, lambda reader: None)


def _ring_for(hub: RingHub, rank: int):
    snap = SnapshotBuffer().capture(0, {"w": torch.zeros(4)})
    path, _ = hub.open(rank, snap.metas, snap.nbytes, len(snap.skeleton))
    from stalwart.ckpt.ring import RingFile

    return RingFile(path)


def test_the_replicated_word_packs_a_generation_and_a_step():
    assert unpack_replicated(pack_replicated(3, 12_345)) == (3, 12_345)
    assert unpack_replicated(pack_replicated(0, 0)) == (0, 0)
    assert unpack_replicated(-1) is None
    assert pack_replicated(2, 5) > pack_replicated(1, 10**9)  # a newer generation is newer


def test_the_gate_reaches_the_ranks_rings_a_new_one_included(tmp_path):
    hub = _hub(tmp_path)
    gate = CopyGate(hub)
    try:
        ring = _ring_for(hub, 0)
        other = _ring_for(hub, 1)
        assert ring.replication() == (0, None)  # no bound yet: nothing to wait for
        gate.set_stride(2)
        gate.replicated(0, 4, generation=1)
        gate.replicated(0, 2, generation=1)  # an older one never goes back
        gate.replicated(1, 6, generation=None)  # a re-send whose writer is not known
        assert ring.replication() == (2, (1, 4))
        assert other.replication() == (2, None)
        # A new layout's ring starts where the old one was.
        again = _ring_for(hub, 0)
        assert again.replication() == (2, (1, 4))
    finally:
        hub.close()


@contextlib.contextmanager
def _gated(tmp_path, bound: int):
    """A hub, its gate at stride `bound`, rank 0's ring and a CopyWait of `bound` on it."""
    hub = _hub(tmp_path)
    gate = CopyGate(hub)
    try:
        ring = _ring_for(hub, 0)
        gate.set_stride(bound)
        yield gate, ring, CopyWait(bound, ring.replication, _never_asked)
    finally:
        hub.close()


def test_a_rank_waits_at_the_boundary_until_its_copies_are_on_the_peers(tmp_path):
    with _gated(tmp_path, 2) as (gate, ring, wait):
        gate.replicated(0, 2, generation=1)
        assert wait.after_snapshot(4, 1, 0, lambda: False) == 0.0  # 2 is enough for 4
        # Snapshot 5 needs step 4's copies: the agent's replicator sends them later.
        threading.Timer(0.3, gate.replicated, (0, 4, 1)).start()
        waited = wait.after_snapshot(5, 1, 0, lambda: False)
        assert waited >= 0.25 and wait.waits == 1 and wait.seconds == pytest.approx(waited)
        assert wait.since is None  # not waiting any more (the heartbeat says so)
        # Copies of an older generation (rolled back) count for nothing.
        gate.replicated(0, 10, generation=0)
        threading.Timer(0.2, gate.replicated, (0, 6, 2)).start()
        assert wait.after_snapshot(7, 2, 4, lambda: False) >= 0.15
        # A bound of None, or no peers (stride 0): never a wait.
        assert CopyWait(None, ring.replication, _never_asked).after_snapshot(99, 2, 0, _no) == 0
        gate.set_stride(0)
        assert wait.after_snapshot(99, 2, 0, lambda: False) == 0.0


def test_a_recovery_ends_a_wait_at_once(tmp_path):
    with _gated(tmp_path, 1) as (gate, _ring, wait):
        aborted = threading.Event()
        threading.Timer(0.2, aborted.set).start()
        t0 = time.monotonic()
        wait.after_snapshot(9, 1, 0, aborted.is_set)  # nothing ever copied
        assert 0.15 <= time.monotonic() - t0 < 2.0
        # A newer generation's copies: this rank was replaced; it does not wait either.
        gate.replicated(0, 3, generation=5)
        assert wait.after_snapshot(9, 1, 0, lambda: False) == 0.0


def test_through_ray_the_agent_is_asked_only_while_its_answer_does_not_cover(tmp_path):
    """No ring (a node without shared memory): the rank asks its agent, which answers
    once the step is copied or its wait is up; an answer that covers the next steps is
    used again without a call."""
    gate = CopyGate(None)
    gate.set_stride(2)
    asked = []

    def ask(generation, step, timeout_s):
        asked.append((generation, step))
        return gate.reached(0, generation, step, timeout_s)

    wait = CopyWait(2, lambda: None, ask)
    gate.replicated(0, 6, generation=1)
    assert wait.after_snapshot(6, 1, 0, _no) == 0.0
    assert wait.after_snapshot(7, 1, 0, _no) == 0.0
    assert wait.after_snapshot(8, 1, 0, _no) == 0.0
    assert len(asked) == 1  # (1, 4) answered (2, (1, 6)): covers up to snapshot 8
    threading.Timer(0.3, gate.replicated, (0, 8, 1)).start()
    assert wait.after_snapshot(9, 1, 0, _no) >= 0.25
    assert asked[-1] == (1, 8) and len(asked) <= 4


def test_shards_lost_with_the_nodes_memory_do_not_hold_their_rank(tmp_path):
    """After chaos drop_replicas the agent refuses its ranks' shards of the steps it lost
    (they will never be copied): a rank that restored from durable storage and snapshots
    those steps again must not wait for their copies (CI: rank 1 waited 300 s, until the
    hang timeout). A shard of an aborted generation is refused without counting."""
    from stalwart.orchestrator.agent.actor import NodeAgent

    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    try:
        agent.set_stride(1, bounded=True)
        agent.wipe(up_to=55)
        snap = SnapshotBuffer().capture(53, {"w": torch.zeros(4)})
        assert agent.put_shard(1, snap, generation=2).nbytes == 0
        assert agent.store.stored().get(1) in (None, [])
        assert agent.gate.reached(1, 2, 53, timeout_s=0.0)[1] == (2, 53)
        agent.prune(above=53, fence=3, seq=(0, 1))  # generation 2 aborted
        assert agent.put_shard(2, snap, generation=2).nbytes == 0
        assert agent.gate.reached(2, 2, 53, timeout_s=0.0)[1] is None
    finally:
        agent.close()


def test_a_shard_published_as_the_rings_close_does_not_hold_its_rank(tmp_path):
    """A rank published a step in its ring just as the node's shared memory filled: the
    fall-back closed the ring and the shard went with it, never to be sent to the peers.
    Its rank must not wait for those copies (the suite saw a 60 s stall, ended by the
    stuck-copies rule), as for a shard lost with the node's memory."""
    from types import SimpleNamespace

    import numpy as np

    from stalwart.orchestrator.agent.actor import NodeAgent

    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    try:
        agent.set_stride(1, bounded=True)
        agent.store.fall_back("the file system is full (test)")
        reader = SimpleNamespace(rank=1, ring=SimpleNamespace(payload=lambda slot: np.zeros(8)))
        assert agent._ring_shard(reader, 0, 37, 1, b"") is False
        assert agent.gate.reached(1, 1, 37, timeout_s=0.0)[1] == (1, 37)
    finally:
        agent.close()


def _no() -> bool:
    return False


def _never_asked(*args):
    raise AssertionError("the ring has the answer: no call")

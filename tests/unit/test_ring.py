"""The snapshot ring: a rank writes its snapshots straight into shared memory and the node
agent's hub finds them there (ckpt/ring.py, ckpt/ring_pipeline.py, orchestrator/agent/
rings.py), with a real store under a temporary folder, no Ray."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring import S_SEQ, RingFile, RingReader, RingWriter
from stalwart.ckpt.ring_pipeline import RingPipeline
from stalwart.ckpt.snapshot import SnapshotBuffer, nested_digest, payload_checksum, restore
from stalwart.ckpt.store import ShmShardStore
from stalwart.orchestrator.agent.rings import RingHub

pytestmark = pytest.mark.timeout(60)


def _state(step: int, model: torch.nn.Module) -> dict:
    return {"step": step, "model": model.state_dict(), "note": f"at {step}"}


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class _Node:
    """A hub and a store as the node agent wires them."""

    def __init__(self, root, keep_all: bool = False, slots: int = 5):
        self.store = ShmShardStore(root)
        self.keep_all = keep_all
        self.passed: list[int] = []
        self.hub = RingHub(root, self._shard, self._full, slots=slots)

    def _shard(self, reader: RingReader, slot: int, step: int, gen: int, skeleton: bytes):
        if gen < 0:
            self.passed.append(step)
            return False
        checksum = payload_checksum(reader.ring.payload(slot))
        self.store.commit_ring(
            reader.rank, step, skeleton, reader.ring.metas, reader, slot, checksum
        )
        if not self.keep_all:
            self.store.trim(set(), 2)
        return True

    def _full(self, reader: RingReader) -> None:
        if not self.keep_all:
            self.store.move_out(reader.rank, reader.held_steps()[0])

    def close(self) -> None:
        self.hub.close()
        self.store.close()


def _pipeline(node: _Node, rank: int = 0, gen=lambda: 1, **kw) -> RingPipeline:
    def fallback():
        raise AssertionError("no fall-back expected")

    opener = kw.pop("open_ring", lambda metas, n, k: node.hub.open(rank, metas, n, k))
    return RingPipeline(opener, kw.pop("fallback", fallback), generation=gen, **kw)


def test_snapshots_reach_the_store_bit_exact_and_restore(tmp_path):
    node = _Node(tmp_path / "n")
    model = torch.nn.Linear(64, 32)
    pipe = _pipeline(node)
    try:
        for step in range(12):
            with torch.no_grad():
                model.weight.add_(0.5)
            pipe.submit(step, _state(step, model))
            want = SnapshotBuffer().capture(step, _state(step, model)).digest()
            _until(lambda s=step: s in node.store.stored().get(0, []))
            got = node.store.get(0, step)
            assert got.digest() == want and got.intact()
        assert pipe.drain(5) and pipe.stats.captures == 12 and pipe.stats.errors == 0
        back = restore(node.store.get(0, 11))
        assert nested_digest(back) == nested_digest(_state(11, model))
        # Memory stays bounded: the store keeps the newest two, the ring has free slots.
        assert node.store.stored()[0] == [10, 11]
    finally:
        node.close()


def test_a_store_that_keeps_everything_moves_shards_out_of_the_ring(tmp_path):
    node = _Node(tmp_path / "n", slots=3)
    node._full = lambda reader: node.store.move_out(reader.rank, reader.held_steps()[0])
    node.hub._on_full = node._full
    model = torch.nn.Linear(16, 16)
    pipe = _pipeline(node, wait_s=10)
    try:
        node.keep_all = True  # nothing trimmed: only moving out gives the ring its slots
        for step in range(8):
            pipe.submit(step, _state(step, model))
        assert pipe.drain(5) and pipe.stats.errors == 0
        assert node.store.stored()[0] == list(range(8))
        assert all(node.store.get(0, s).intact() for s in range(8))
    finally:
        node.close()


def test_a_ring_the_agent_never_frees_gives_the_snapshot_up_with_the_reason(tmp_path):
    node = _Node(tmp_path / "n", keep_all=True, slots=2)
    node.hub._on_full = lambda reader: None  # holds every slot, never moves one out
    pipe = _pipeline(node, wait_s=0.2)
    model = torch.nn.Linear(4, 4)
    try:
        for step in range(3):
            pipe.submit(step, _state(step, model))
        assert pipe.stats.errors == 1 and "no free snapshot slot" in pipe.stats.last_error
        assert node.store.stored()[0] == [0, 1]
    finally:
        node.close()


def test_a_write_cut_short_is_never_taken_and_a_failed_copy_is_passed_over(tmp_path):
    node = _Node(tmp_path / "n")
    model = torch.nn.Linear(8, 8)
    try:
        path, bell = node.hub.open(
            0, SnapshotBuffer().capture(0, _state(0, model)).metas, 8 * 8 * 4 + 64, 4096
        )
        writer = RingWriter(path, bell)
        writer.begin(0)  # a rank killed half-way through its copy: the slot stays odd
        node.hub.poll()
        assert node.store.stored() == {} and writer.ring.word(0, S_SEQ) % 2 == 1

        def die(fault):
            raise RuntimeError("killed")

        pipe = _pipeline(node, torn=lambda step: {"at": step} if step == 1 else None, die=die)
        pipe.submit(0, _state(0, model))
        with pytest.raises(RuntimeError):
            pipe.submit(1, _state(1, model))
        pipe.submit(2, _state(2, model))
        assert pipe.drain(5)
        _until(lambda: 2 in node.store.stored().get(0, []))
        assert 1 not in node.store.stored()[0]  # the torn step was passed over
    finally:
        node.close()


def test_an_error_taking_a_shard_costs_that_shard_not_the_hub(tmp_path, caplog):
    node = _Node(tmp_path / "n")
    take = node._shard

    def fails_at_step_1(reader, slot, step, gen, skeleton):
        if step == 1:
            raise AttributeError("partially initialized module 'torch'")
        return take(reader, slot, step, gen, skeleton)

    node.hub._on_shard = fails_at_step_1
    model = torch.nn.Linear(8, 8)
    try:
        pipe = _pipeline(node)
        for step in range(4):  # more snapshots than the hub would free without its thread
            pipe.submit(step, _state(step, model))
        assert pipe.drain(5)
        _until(lambda: 3 in node.store.stored().get(0, []))
        assert 1 not in node.store.stored()[0]
        assert "rank 0's shard of step 1 was passed over" in caplog.text
    finally:
        node.close()


def test_a_closed_ring_makes_the_writer_open_another_and_no_room_means_ray(tmp_path):
    node = _Node(tmp_path / "n")
    model = torch.nn.Linear(8, 8)
    opened = []

    def opener(metas, n, k):
        opened.append(n)
        return node.hub.open(3, metas, n, k)

    pipe = _pipeline(node, rank=3, open_ring=opener)
    try:
        pipe.submit(0, _state(0, model))
        node.hub.close_rank(3)  # ranks renumbered, or the node's shards moved to memory
        pipe.submit(1, _state(1, model))
        assert len(opened) == 2 and pipe.drain(5)
        _until(lambda: node.store.stored().get(3) == [0, 1])

        sent = []
        ray_path = _pipeline(
            node,
            open_ring=lambda metas, n, k: None,
            fallback=lambda: SnapshotPipeline(lambda snap: sent.append(snap.step)),
        )
        ray_path.submit(0, _state(0, model))
        ray_path.submit(1, _state(1, model))
        assert ray_path.drain(5) and sent == [0, 1] and ray_path.transport == "ray"
    finally:
        node.close()


def test_a_ring_unlinked_before_the_rank_maps_it_is_a_closed_ring(tmp_path):
    """The agent answered with a ring and then fell back (its shared memory full), which
    unlinks every ring: the rank finds no file. It asks again, and a second answer (a new
    ring, or None: through Ray) is taken; no snapshot is lost to the race."""
    node = _Node(tmp_path / "n")
    model = torch.nn.Linear(8, 8)
    answers = []

    def vanishing_then(then):
        def opener(metas, n, k):
            path, bell = node.hub.open(0, metas, n, k)
            if not answers:
                node.hub.close_rank(0)  # the fall-back's close, after the answer
            answers.append(path)
            return then(path, bell, metas, n, k)

        return opener

    pipe = _pipeline(node, open_ring=vanishing_then(lambda path, bell, *a: (path, bell)))
    try:
        pipe.submit(0, _state(0, model))
        assert len(answers) == 2 and pipe.transport == "shm" and pipe.drain(5)
        _until(lambda: node.store.stored().get(0) == [0])

        answers.clear()
        sent = []
        ray_path = _pipeline(
            node,
            open_ring=vanishing_then(lambda *a: None if len(answers) > 1 else a[:2]),
            fallback=lambda: SnapshotPipeline(lambda snap: sent.append(snap.step)),
        )
        ray_path.submit(1, _state(1, model))
        assert ray_path.drain(5) and sent == [1] and ray_path.transport == "ray"
        assert ray_path.stats.errors == 0
    finally:
        node.close()


def test_a_ring_file_of_another_kind_is_refused(tmp_path):
    bad = tmp_path / "not-a-ring"
    bad.write_bytes(b"\0" * 16384)
    with pytest.raises(ValueError, match="not a stalwart snapshot ring"):
        RingFile(bad)


def test_a_new_layout_opens_a_new_ring(tmp_path):
    node = _Node(tmp_path / "n")
    model = torch.nn.Linear(8, 8)
    opt_state = {"m": torch.zeros(3)}
    pipe = _pipeline(node)
    try:
        pipe.submit(0, _state(0, model))
        pipe.submit(1, {**_state(1, model), "opt": opt_state})  # a state grew a tensor
        assert pipe.drain(5)
        _until(lambda: node.store.stored().get(0) == [0, 1])
        back = restore(node.store.get(0, 1))
        assert torch.equal(back["opt"]["m"], opt_state["m"])
    finally:
        node.close()


def test_on_a_gpu_the_copy_thread_fills_the_ring_and_the_optimizer_waits_for_it(tmp_path):
    """The CUDA path through the same ring, on test_device_copy's fake CUDA: the training
    thread only issues the copy; the next optimizer step is fenced behind it; every
    shard equals a synchronous capture taken at the same point."""
    from stalwart.ckpt.device_copy import AsyncCapture
    from tests.unit.test_device_copy import FakeCuda

    fake = FakeCuda()
    node = _Node(tmp_path / "n")
    pipe = _pipeline(node, device=AsyncCapture(api=fake))
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    pipe.guard(opt)
    want = {}
    try:
        for step in range(6):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()  # fenced behind the previous snapshot's copy
            opt.zero_grad()
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            want[step] = SnapshotBuffer().capture(step, state).digest()
            pipe.submit(step, state)
        assert pipe.drain(10) and pipe.stats.errors == 0, pipe.stats.last_error
        _until(lambda: set(node.store.stored().get(0, [])) >= {4, 5})
        for step in node.store.stored()[0]:
            assert node.store.get(0, step).digest() == want[step]
        assert not any(op[0] == "synchronize" and op[2] == "MainThread" for op in fake.log)
        assert any(op[0] == "wait" and op[1] == "training" for op in fake.log)  # the fence
    finally:
        node.close()


def test_the_node_agent_keeps_fences_and_falls_back_through_its_rings(tmp_path):
    """NodeAgent (in this process, no Ray) with its rings: shards of an aborted generation
    and of steps lost with the node's memory are passed over, and when its shared memory
    fills up the rings close and the rank's snapshots go through the fall-back."""
    from stalwart.orchestrator.agent.actor import NodeAgent

    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    generation = {"n": 1}
    sent = []

    def fallback():
        return SnapshotPipeline(lambda snap: sent.append(snap.step))

    pipe = RingPipeline(
        lambda metas, n, k: agent.open_ring(0, metas, n, k),
        fallback,
        generation=lambda: generation["n"],
    )
    model = torch.nn.Linear(8, 8)
    try:
        for step in range(3):
            pipe.submit(step, _state(step, model))
        assert pipe.drain(5)
        _until(lambda: agent.store.stored().get(0) == [0, 1, 2])
        agent.prune(above=1, fence=2, seq=(0, 1))  # a roll back to step 1; generation 2 next
        pipe.submit(2, _state(2, model))  # a late hand-over of generation 1
        assert pipe.drain(5) and agent.store.stored()[0] == [0, 1]
        generation["n"] = 2
        pipe.submit(2, _state(2, model))
        assert pipe.drain(5)
        _until(lambda: agent.store.stored()[0] == [0, 1, 2])
        assert agent.get_shard(0, 2).intact()

        agent.store.fall_back("the file system is full (test)")
        pipe.submit(3, _state(3, model))
        assert pipe.drain(5) and sent == [3] and pipe.transport == "ray"
        assert agent.store.transport == "ray" and agent.store.stored()[0] == [0, 1, 2]
        assert [n["type"] for n in agent.store.take_notes()] == ["shm_full"]
    finally:
        agent.close()


def test_a_ring_closed_under_the_last_snapshot_is_handed_it_again_at_the_drain(tmp_path):
    node = _Node(tmp_path / "n")
    node.hub._stop.set()  # the hub's thread stops looking: the last publish stays pending
    node.hub._thread.join(timeout=5)
    model = torch.nn.Linear(8, 8)
    pipe = _pipeline(node)
    try:
        pipe.submit(5, _state(5, model))
        with node.hub._poll_lock, node.hub._lock:  # closed before the hub took it
            reader = next(iter(node.hub._readers.values()))
            node.hub._readers.clear()
        reader.ring.close_for_writers()
        pipe_drained = []
        t = threading.Thread(target=lambda: pipe_drained.append(pipe.drain(10)))
        t.start()
        _until(lambda: len(node.hub._readers) == 1)  # drain opened a new ring
        # The hub's work, its thread stopped: the snapshot may reach the new ring after
        # the ring was registered, so it looks until the drain is answered.
        _until(lambda: node.hub.poll() >= 0 and not t.is_alive())
        t.join(10)
        assert pipe_drained == [True] and node.store.stored()[0] == [5]
    finally:
        node.close()


def test_a_full_ring_with_no_room_to_move_a_shard_out_falls_back_to_ray(tmp_path):
    """The node's shared memory filled up while its prunes keep every ring slot: the
    move-out finds no room, so the node moves its shards into memory (said once) and the
    rank's next snapshots go through Ray, none given up."""
    from stalwart.ckpt.store import ShmFull
    from stalwart.orchestrator.agent.actor import NodeAgent

    agent = NodeAgent("node-a", "job-key", shm_root=str(tmp_path / "shm"), lease_s=None)
    sent = []

    def no_room(rank, nbytes):
        raise ShmFull("no room for the test's shard")

    agent.store.shm.reserve = no_room
    pipe = RingPipeline(
        lambda metas, n, k: agent.open_ring(0, metas, n, k),
        lambda: SnapshotPipeline(lambda snap: sent.append(snap.step)),
        generation=lambda: 1,
        wait_s=10,
    )
    model = torch.nn.Linear(8, 8)
    try:
        for step in range(9):  # no prune: the agent keeps every shard, the ring fills
            pipe.submit(step, _state(step, model))
        assert pipe.drain(10) and pipe.stats.errors == 0, pipe.stats.last_error
        assert pipe.transport == "ray" and sent and agent.store.transport == "ray"
        held = agent.store.stored()[0]
        assert sorted(held + sent) == list(range(9))  # every snapshot kept, one way or the other
        assert [n["type"] for n in agent.store.take_notes()] == ["shm_full"]
    finally:
        agent.close()

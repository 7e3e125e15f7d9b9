"""ckpt/store.py: the in-memory shard store owns copies and recycles buffers."""

from __future__ import annotations

import os

import numpy as np
import torch

from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, restore
from stalwart.ckpt.store import MemoryShardStore, ShardInfo, ShardStore


def snap(step: int, value: float, n: int = 16) -> Snapshot:
    """A snapshot whose payload is a fresh array (not shared with any SnapshotBuffer)."""
    s = SnapshotBuffer().capture(step, {"w": torch.full((n,), float(value)), "step": step})
    return Snapshot(s.step, s.skeleton, s.metas, s.payload.numpy().copy())


def value_of(s: Snapshot) -> torch.Tensor:
    return restore(s)["w"]


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_satisfies_protocol():
    store: ShardStore = MemoryShardStore()
    assert store.stored() == {}


def test_put_and_get():
    store = MemoryShardStore()
    s = snap(3, 1.5)
    info = store.put(0, s)
    assert info == ShardInfo(rank=0, step=3, nbytes=s.nbytes)
    got = store.get(0, 3)
    assert got is not None
    assert got.step == 3
    assert got.metas == s.metas
    assert got.skeleton == s.skeleton
    assert torch.equal(value_of(got), torch.full((16,), 1.5))
    assert got.digest() == s.digest()
    assert store.get(0, 4) is None
    assert store.get(1, 3) is None


def test_put_copies_numpy_payload():
    store = MemoryShardStore()
    s = snap(1, 1.0)
    store.put(0, s)
    s.payload[:] = 0xFF  # mutate the source afterwards
    got = store.get(0, 1)
    assert got.payload is not s.payload
    assert not np.shares_memory(got.payload, s.payload)
    assert torch.equal(value_of(got), torch.full((16,), 1.0))


def test_put_copies_torch_payload_from_reused_buffer():
    # What a worker really sends: a view of its SnapshotBuffer, overwritten at the next capture.
    store = MemoryShardStore()
    buf = SnapshotBuffer()
    s1 = buf.capture(1, {"w": torch.full((8,), 1.0)})
    store.put(0, s1)
    s2 = buf.capture(2, {"w": torch.full((8,), 2.0)})
    assert s2.payload.data_ptr() == s1.payload.data_ptr()
    store.put(0, s2)
    assert torch.equal(value_of(store.get(0, 1)), torch.full((8,), 1.0))
    assert torch.equal(value_of(store.get(0, 2)), torch.full((8,), 2.0))


def test_stored_lists_sorted_steps_per_rank():
    store = MemoryShardStore()
    for rank, step in [(1, 5), (0, 4), (0, 2), (1, 3), (0, 3)]:
        store.put(rank, snap(step, step))
    assert store.stored() == {0: [2, 3, 4], 1: [3, 5]}


def test_drop_below():
    store = MemoryShardStore()
    for step in range(5):
        store.put(0, snap(step, step))
        store.put(1, snap(step, step))
    assert store.drop_below(3) == 6
    assert store.stored() == {0: [3, 4], 1: [3, 4]}
    assert store.get(0, 2) is None
    assert store.drop_below(3) == 0


def test_drop_above():
    store = MemoryShardStore()
    for step in range(5):
        store.put(0, snap(step, step))
    assert store.drop_above(2) == 2
    assert store.stored() == {0: [0, 1, 2]}
    assert store.drop_above(2) == 0


def test_drop_everything():
    store = MemoryShardStore()
    store.put(0, snap(1, 1))
    assert store.drop_above(-1) == 1
    assert store.stored() == {}
    assert store.nbytes() == 0


def test_nbytes():
    store = MemoryShardStore()
    a, b = snap(0, 0, n=16), snap(1, 0, n=1000)
    store.put(0, a)
    store.put(0, b)
    assert store.nbytes() == a.nbytes + b.nbytes


def test_dropped_buffers_are_reused_for_same_size():
    store = MemoryShardStore()
    store.put(0, snap(1, 1.0))
    old = store.get(0, 1).payload
    assert store.drop_below(2) == 1
    store.put(0, snap(2, 2.0))
    new = store.get(0, 2).payload
    assert addr(new) == addr(old)
    assert torch.equal(value_of(store.get(0, 2)), torch.full((16,), 2.0))


def test_dropped_buffers_not_reused_for_other_sizes():
    store = MemoryShardStore()
    store.put(0, snap(1, 1.0, n=16))
    old = store.get(0, 1).payload
    store.drop_below(2)
    store.put(0, snap(2, 2.0, n=1000))
    assert store.get(0, 2).payload.nbytes != old.nbytes
    assert torch.equal(value_of(store.get(0, 2)), torch.full((1000,), 2.0))


def test_steady_state_rotation_allocates_nothing_new():
    store = MemoryShardStore()
    seen = set()
    for step in range(20):
        for rank in range(2):
            store.put(rank, snap(step, step))
            seen.add(addr(store.get(rank, step).payload))
        store.drop_below(step - 1)  # keep two versions per rank
    assert store.stored() == {0: [18, 19], 1: [18, 19]}
    # 2 ranks x 2 kept versions + in flight: a small, bounded set of buffers.
    assert len(seen) <= 8
    for rank in range(2):
        assert torch.equal(value_of(store.get(rank, 19)), torch.full((16,), 19.0))


def test_replacing_same_rank_and_step():
    store = MemoryShardStore()
    store.put(0, snap(5, 1.0))
    first = store.get(0, 5).payload
    store.put(0, snap(5, 2.0))
    assert store.stored() == {0: [5]}
    assert torch.equal(value_of(store.get(0, 5)), torch.full((16,), 2.0))
    assert store.nbytes() == store.get(0, 5).nbytes
    # The replaced version's buffer went back to the pool and serves the next put.
    store.put(0, snap(6, 3.0))
    assert addr(store.get(0, 6).payload) == addr(first)
    assert torch.equal(value_of(store.get(0, 5)), torch.full((16,), 2.0))


def test_skeleton_is_owned_bytes():
    store = MemoryShardStore()
    s = snap(1, 1.0)
    s = Snapshot(s.step, bytearray(s.skeleton), s.metas, s.payload)
    store.put(0, s)
    s.skeleton[:] = b"\x00" * len(s.skeleton)
    assert isinstance(store.get(0, 1).skeleton, bytes)
    assert torch.equal(value_of(store.get(0, 1)), torch.full((16,), 1.0))


# --- ShmShardStore ----------------------------------------------------------------------------

from stalwart.ckpt.store import ShmShardStore  # noqa: E402


def _write_slot(store, rank, step, data: bytes):
    """What a worker does: write into the reserved file through its own mapping, commit."""
    path = store.reserve(rank, len(data))
    mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(len(data),))
    mm[:] = np.frombuffer(data, dtype=np.uint8)
    del mm  # the writer goes away (a killed worker): the file stays with the store
    store.commit(rank, step, b"skel", (), path)
    return path


def test_shm_store_round_trip_survives_the_writer(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    _write_slot(store, 1, 5, b"abcdef")
    snap = store.get(1, 5)
    assert bytes(snap.payload) == b"abcdef"
    assert type(snap.payload) is np.ndarray  # not a memmap: serializers copy bytes
    assert store.stored() == {1: [5]}
    assert store.nbytes() == 6


def test_shm_store_reuses_slots_of_dropped_steps(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    first = _write_slot(store, 0, 1, b"x" * 64)
    _write_slot(store, 0, 2, b"y" * 64)
    store.drop_below(2)
    assert store.stored() == {0: [2]}
    assert store.reserve(0, 64) == first  # the dropped step's file, reused


def test_shm_store_frees_extra_slots(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    paths = [_write_slot(store, 0, s, b"z" * 8) for s in range(6)]
    store.drop_below(6)
    on_disk = sorted(p.name for p in (tmp_path / "node").iterdir() if p.name != ".owner")
    assert len(on_disk) == 2  # two spare slots kept per rank, the rest unlinked
    assert {str(tmp_path / "node" / n) for n in on_disk} <= set(paths)


def test_shm_store_release_returns_unfinished_reservations(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    path = store.reserve(3, 16)  # the worker died before committing
    store.release(3)
    assert store.stored() == {}
    assert store.reserve(3, 16) == path


def test_shm_store_close_removes_files(tmp_path):
    store = ShmShardStore(tmp_path / "job" / "node")
    _write_slot(store, 0, 1, b"data")
    store.close()
    assert not (tmp_path / "job").exists()


def test_shm_store_usable():
    assert ShmShardStore.usable("/proc/stalwart-not-here") is False


def test_shm_store_release_one_reservation(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    kept = store.reserve(0, 8)
    dropped = store.reserve(0, 16)  # reserved ahead, then the state changed size
    store.release(0, dropped)
    assert store.reserve(0, 16) == dropped
    store.commit(0, 1, b"s", (), kept)  # the other reservation is untouched
    assert store.stored() == {0: [1]}


def test_orphaned_shm_stores_are_reaped_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from stalwart.ckpt.store import OWNER_FILE, ShmShardStore

    live = ShmShardStore(tmp_path / "job-a" / "node1")
    live.put(0, snap(1, 1.0))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_dir = tmp_path / "job-b" / "node1"
    dead_dir.mkdir(parents=True)
    (dead_dir / "r0-1").write_bytes(b"x" * 100)
    (dead_dir / OWNER_FILE).write_text(f"{gone.stdout.strip()}:12345")
    reaped = ShmShardStore.reap_orphans(tmp_path)
    assert reaped == [str(dead_dir)]
    assert not (tmp_path / "job-b").exists()
    assert live.get(0, 1) is not None and (tmp_path / "job-a" / "node1").exists()
    # A reused pid with another start time is not the owner.
    (live.root / OWNER_FILE).write_text(f"{os.getpid()}:1")
    assert ShmShardStore.reap_orphans(tmp_path) == [str(live.root)]


def test_checksums_travel_with_shards_and_discard_drops_one(tmp_path):
    from stalwart.ckpt.snapshot import payload_checksum
    from stalwart.ckpt.store import ShmShardStore

    for store in (MemoryShardStore(), ShmShardStore(tmp_path / "shm")):
        s = snap(3, 2.5)
        s.checksum = payload_checksum(s.payload)
        store.put(0, s)
        store.put(0, snap(4, 1.0))
        store.put(1, snap(3, 1.0))
        got = store.get(0, 3)
        assert got.checksum == s.checksum and got.intact()
        got.payload[len(got.payload) // 2] ^= 0xFF  # damaged memory, in place
        assert not store.get(0, 3).intact()
        assert store.discard(0, 3) == 1
        assert store.stored() == {0: [4], 1: [3]}
        store.close()

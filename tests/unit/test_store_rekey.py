"""ckpt/store.py rekey (renumbered worlds) and ckpt/commit.py CommitTracker.reset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.ckpt.commit import CommitTracker
from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, restore
from stalwart.ckpt.store import MemoryShardStore, ShmShardStore


def snap(step: int, value: float, n: int = 16) -> Snapshot:
    """A real snapshot whose payload is a fresh array holding `value`."""
    s = SnapshotBuffer().capture(step, {"w": torch.full((n,), float(value)), "step": step})
    return Snapshot(s.step, s.skeleton, s.metas, s.payload.numpy().copy())


def value(s: Snapshot | None) -> float:
    assert s is not None
    w = restore(s)["w"]
    assert torch.equal(w, torch.full_like(w, w[0].item()))
    return w[0].item()


def fill(store, ranks=(0, 1, 2), steps=(4, 5)) -> dict[tuple[int, int], str]:
    """Rank r's shard of step s holds 10 * r + s; returns each shard's digest."""
    digests = {}
    for r in ranks:
        for s in steps:
            shard = snap(s, 10 * r + s)
            store.put(r, shard)
            digests[(r, s)] = shard.digest()
    return digests


def shm_put(store: ShmShardStore, rank: int, shard: Snapshot) -> str:
    """What a worker does: reserve, write into the file, commit. Returns the file."""
    src = np.asarray(shard.payload, dtype=np.uint8).reshape(-1)
    path = store.reserve(rank, src.nbytes)
    mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(src.nbytes,))
    mm[:] = src
    del mm
    store.commit(rank, shard.step, shard.skeleton, shard.metas, path)
    return path


def files(root: Path) -> set[str]:
    """The slot files (not the store's owner mark)."""
    return {str(p) for p in root.iterdir() if p.name != ".owner"}


# --- both stores --------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "shm"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryShardStore()
    else:
        s = ShmShardStore(tmp_path / "job" / "node")
    yield s
    s.close()


def test_rekey_moves_shards_to_their_new_ranks(store):
    digests = fill(store)
    # Rank 1 was lost; rank 2 becomes rank 1.
    assert store.rekey({0: 0, 2: 1}) == 4
    assert store.stored() == {0: [4, 5], 1: [4, 5]}
    for step in (4, 5):
        assert value(store.get(0, step)) == step
        assert value(store.get(1, step)) == 20 + step
        assert store.get(1, step).digest() == digests[(2, step)]
        assert store.get(1, step).step == step
        assert store.get(2, step) is None


def test_rekey_drops_unmapped_ranks(store):
    fill(store)
    assert store.rekey({1: 0}) == 2
    assert store.stored() == {0: [4, 5]}
    assert value(store.get(0, 5)) == 15
    assert store.nbytes() == 2 * snap(0, 0).nbytes


def test_rekey_swaps_ranks(store):
    digests = fill(store, ranks=(0, 1))
    assert store.rekey({0: 1, 1: 0}) == 4
    assert store.stored() == {0: [4, 5], 1: [4, 5]}
    for step in (4, 5):
        assert value(store.get(0, step)) == 10 + step
        assert value(store.get(1, step)) == step
        assert store.get(0, step).digest() == digests[(1, step)]


def test_rekey_to_nothing_empties_the_store(store):
    fill(store)
    assert store.rekey({}) == 0
    assert store.stored() == {}
    assert store.nbytes() == 0


def test_rekeyed_store_keeps_working(store):
    fill(store, ranks=(0, 1))
    store.rekey({1: 0})
    store.put(0, snap(6, 99))
    store.put(1, snap(6, 98))
    assert store.stored() == {0: [4, 5, 6], 1: [6]}
    assert value(store.get(0, 6)) == 99
    assert value(store.get(0, 4)) == 14
    assert store.drop_below(6) == 2
    assert store.stored() == {0: [6], 1: [6]}


# --- ShmShardStore specifics --------------------------------------------------------------------


def test_shm_rekey_releases_reservations(tmp_path):
    store = ShmShardStore(tmp_path / "node")
    shm_put(store, 0, snap(1, 1))
    shard = snap(2, 2)
    pending = store.reserve(0, shard.nbytes)  # a worker was writing step 2 when renumbered
    assert store.rekey({0: 1}) == 1
    with pytest.raises(KeyError):
        store.commit(0, 2, shard.skeleton, shard.metas, pending)
    with pytest.raises(KeyError):
        store.commit(1, 2, shard.skeleton, shard.metas, pending)
    assert store.stored() == {1: [1]}
    # Under its new rank the worker reserves again.
    shm_put(store, 1, shard)
    assert store.stored() == {1: [1, 2]}
    assert value(store.get(1, 2)) == 2


def test_shm_rekey_unlinks_files_of_dropped_shards(tmp_path):
    root = tmp_path / "node"
    store = ShmShardStore(root)
    kept = {shm_put(store, 0, snap(s, s)) for s in (1, 2)}
    dropped = {shm_put(store, 1, snap(s, 10 + s)) for s in (1, 2)}
    assert files(root) == kept | dropped
    store.rekey({0: 0})
    assert files(root) == kept
    assert value(store.get(0, 2)) == 2


def test_shm_rekey_leaves_only_the_kept_shards_files(tmp_path):
    # Free slots and reservations are files too; none outlive the renumbering.
    root = tmp_path / "node"
    store = ShmShardStore(root)
    shm_put(store, 0, snap(1, 1))
    kept = shm_put(store, 0, snap(2, 2))
    store.drop_below(2)  # step 1's slot is free now, its file still there
    reserved = store.reserve(1, 64)
    assert len(files(root)) == 3
    assert store.rekey({0: 1}) == 1
    assert files(root) == {kept}
    assert not Path(reserved).exists()


def test_shm_rekey_moves_the_shards_files_with_them(tmp_path):
    root = tmp_path / "node"
    store = ShmShardStore(root)
    a = shm_put(store, 0, snap(1, 1))
    b = shm_put(store, 1, snap(1, 11))
    store.rekey({0: 1, 1: 0})
    assert files(root) == {a, b}
    store.close()
    assert not root.exists()


# --- CommitTracker.reset ------------------------------------------------------------------------


def test_reset_commits_the_newest_steps_every_rank_has():
    ct = CommitTracker(3)
    assert ct.reset({0: [1, 2, 3, 4], 1: [2, 3], 2: [3, 2, 1]}) == 3
    assert ct.committed == 3
    assert ct.retained == (2, 3)
    assert ct.droppable_below() == 2


def test_reset_with_a_rank_holding_nothing_commits_nothing():
    ct = CommitTracker(3)
    ct.observe({0: [1, 2], 1: [1, 2], 2: [1, 2]})
    assert ct.reset({0: [1, 2], 1: [1, 2]}) is None  # rank 2's store was lost
    assert ct.retained == ()
    assert ct.droppable_below() is None
    assert ct.reset({0: [1, 2], 1: [1, 2], 2: []}) is None


def test_reset_honours_keep():
    stored = {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}
    one, three = CommitTracker(2, keep=1), CommitTracker(2, keep=3)
    assert one.reset(stored) == 4
    assert one.retained == (4,)
    assert one.droppable_below() == 4
    assert three.reset(stored) == 4
    assert three.retained == (2, 3, 4)
    assert three.droppable_below() == 2


def test_reset_may_go_back():
    # Unlike observe, reset starts over: a commit whose shards are gone is forgotten.
    ct = CommitTracker(2)
    ct.observe({0: [5, 6], 1: [5, 6]})
    assert ct.committed == 6
    assert ct.reset({0: [3, 6], 1: [3]}) == 3
    assert ct.retained == (3,)


def test_reset_forgets_what_was_stored_before():
    ct = CommitTracker(2)
    ct.observe({0: [1, 2], 1: [1, 2]})
    ct.reset({0: [1], 1: [1]})
    # Rank 1 alone reporting step 2 does not commit it: rank 0's old report is gone.
    assert ct.observe({1: [1, 2]}) == 1
    assert ct.observe({0: [1, 2]}) == 2
    assert ct.retained == (1, 2)


def test_reset_ignores_ranks_outside_the_world():
    ct = CommitTracker(2)
    assert ct.reset({0: [7], 1: [7], 2: [8]}) == 7
    assert ct.reset({0: [7], 2: [7]}) is None

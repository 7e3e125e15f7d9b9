"""ShardStore.trim: keep the supervisor's retained commits and replication target, and each
rank's newest steps; nothing else (bounded memory while replication lags)."""

from __future__ import annotations

import pytest
import torch

from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer
from stalwart.ckpt.store import MemoryShardStore, ShmShardStore

pytestmark = pytest.mark.timeout(60)


def snap(step: int) -> Snapshot:
    s = SnapshotBuffer().capture(step, {"w": torch.full((8,), float(step))})
    return Snapshot(s.step, s.skeleton, s.metas, s.payload.numpy().copy())


@pytest.fixture(params=["memory", "shm"])
def store(request, tmp_path):
    s = MemoryShardStore() if request.param == "memory" else ShmShardStore(tmp_path / "shm")
    yield s
    s.close()


def fill(store, ranks: dict[int, range]) -> None:
    for rank, steps in ranks.items():
        for step in steps:
            store.put(rank, snap(step))


def test_keeps_the_listed_steps_and_each_ranks_newest(store):
    fill(store, {0: range(1, 11), 1: range(1, 10)})
    dropped = store.trim(keep={3, 5}, newest=2)
    assert store.stored() == {0: [3, 5, 9, 10], 1: [3, 5, 8, 9]}
    assert dropped == 10 + 9 - 8


def test_below_drops_even_kept_steps(store):
    fill(store, {0: range(1, 6)})
    store.trim(keep={1, 3}, newest=1, below=2)
    assert store.stored() == {0: [3, 5]}


def test_newest_zero_keeps_only_the_listed_steps(store):
    fill(store, {0: range(1, 6), 2: range(4, 8)})
    store.trim(keep={4}, newest=0)
    assert store.stored() == {0: [4], 2: [4]}


def test_trimmed_shards_are_gone_and_kept_ones_intact(store):
    fill(store, {0: range(1, 6)})
    store.trim(keep={2}, newest=1)
    assert store.get(0, 3) is None
    kept = store.get(0, 2)
    assert kept is not None and kept.digest() == snap(2).digest()

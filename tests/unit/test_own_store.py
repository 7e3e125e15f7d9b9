"""orchestrator/agent/own_store.py: a node's shards in shared memory until its file system is
full, then in the agent's memory, nothing lost, said once. On a real 1 MiB tmpfs."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from stalwart.ckpt.snapshot import Snapshot, payload_checksum
from stalwart.ckpt.store import ShmShardStore
from stalwart.orchestrator.agent.own_store import OwnStore


@pytest.fixture
def tiny_tmpfs(tmp_path):
    where = tmp_path / "shm"
    where.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], check=True, timeout=30
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], timeout=30)


def _snap(step: int, nbytes: int) -> Snapshot:
    payload = np.full(nbytes, step % 251, dtype=np.uint8)
    return Snapshot(step, b"", (), payload, payload_checksum(payload))


def test_a_full_file_system_moves_the_shards_into_memory(tiny_tmpfs):
    store = OwnStore(ShmShardStore(tiny_tmpfs / "job" / "node"))
    assert store.transport == "shm"
    size = 200 * 1024
    steps = []
    for step in range(1, 20):  # 1 MiB holds four or five
        path = store.reserve(0, size)
        if path is None:
            break
        with open(path, "r+b") as f:
            f.write(_snap(step, size).payload.tobytes())
        store.commit(0, step, b"", (), path, payload_checksum(_snap(step, size).payload))
        steps.append(step)
    assert 2 <= len(steps) < 19, steps
    assert store.transport == "ray"
    # Every shard it held is still there, intact, now in memory.
    assert store.stored() == {0: steps}
    assert all(store.get(0, s).intact() for s in steps)
    [note] = store.take_notes()
    assert note["type"] == "shm_full" and "no room for rank 0's" in note["reason"]
    assert "bytes free" in note["reason"] and store.take_notes() == []
    # From now on shards come through put(), into memory.
    store.put(0, _snap(99, size))
    assert store.stored() == {0: [*steps, 99]} and store.reserve(0, size) is None
    store.close()

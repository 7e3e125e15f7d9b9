"""ckpt/durable.py: layout, safetensors compatibility, verification, retries, chaos, pruning.

Local checkpoints go under tmp_path; the non-local backend is fsspec's memory://, each test
under its own prefix. No test sleeps: backoff goes through an injected sleep that moves a
fake clock.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import pickle
import re
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart.ckpt.durable as durable
import stalwart.ckpt.durable_io as durable_io
from stalwart.ckpt.durable import (
    CHUNK,
    CorruptCheckpoint,
    DurableError,
    DurableStore,
    Manifest,
    ShardRecord,
    parse_uri,
)
from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, restore
from tests.unit.test_snapshot import assert_same_tree

pytestmark = pytest.mark.timeout(60)


# -- helpers -----------------------------------------------------------------------------


def make_state(step: int, seed: int = 0, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "w": torch.randn(n, 8, generator=g),
        "opt": {
            "exp_avg": torch.randn(n, generator=g, dtype=torch.float64),
            "count": torch.tensor(step),
            "mask": torch.rand(5, generator=g) > 0.5,
        },
        "step": step,
        "lr": [0.1, (1, 2)],
    }


def make_snapshot(step: int, seed: int = 0, n: int = 64) -> tuple[Snapshot, dict]:
    state = make_state(step, seed, n)
    snap = SnapshotBuffer().capture(step, state)
    return Snapshot(snap.step, snap.skeleton, snap.metas, snap.payload.numpy().copy()), state


def write_step(store: DurableStore, step: int, world_size: int = 2, seed: int = 0) -> list:
    """A complete step: every rank's shard, then the manifest. Returns (snapshot, state)s."""
    out, records = [], []
    for rank in range(world_size):
        snap, state = make_snapshot(step, seed + rank)
        records.append(store.write_shard(step, rank, snap))
        out.append((snap, state))
    store.write_manifest(step, world_size, records)
    return out


def shard_path(store: DurableStore, step: int, rank: int) -> str:
    return f"{store.step_dir(step)}/rank-{rank:05d}.safetensors"


def manifest_path(store: DurableStore, step: int) -> str:
    return f"{store.step_dir(step)}/manifest.json"


def rewrite_manifest(store: DurableStore, step: int, changes: dict) -> None:
    path = manifest_path(store, step)
    doc = json.loads(store.fs.cat_file(path))
    doc.update(changes)
    store.fs.pipe_file(path, json.dumps(doc).encode())


def files_under(store: DurableStore) -> list[str]:
    return sorted(store.fs.find(store.root))


class Sleeper:
    """The injected sleep: records the backoff and moves the fake clock instead of waiting."""

    def __init__(self, clock):
        self.clock = clock
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.clock.advance(seconds)


@pytest.fixture
def sleeper(clock) -> Sleeper:
    return Sleeper(clock)


@pytest.fixture
def mem_uri():
    uri = f"memory://stalwart-durable-test/{uuid.uuid4().hex}"
    yield uri
    fs, root = parse_uri(uri)
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def uri(request, tmp_path, mem_uri) -> str:
    return str(tmp_path / "ck") if request.param == "local" else mem_uri


@pytest.fixture
def make_store(clock, sleeper):
    def make(uri: str, job: str = "job", **kw) -> DurableStore:
        return DurableStore(uri, job, clock=clock, sleep=sleeper, **kw)

    return make


class FailingFile:
    """Wraps a real file: writes go through until `budget` bytes, then raise `error`."""

    def __init__(self, f, budget: int, error: OSError):
        self.f, self.budget, self.error = f, budget, error
        self.written = 0

    def write(self, data) -> int:
        room = self.budget - self.written
        if len(data) > room:
            self.f.write(bytes(data[: max(room, 0)]))
            self.written = self.budget
            raise self.error
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# -- round trips and format ----------------------------------------------------------------


def test_round_trip(uri, make_store):
    store = make_store(uri)
    written = write_step(store, 7, world_size=3)
    assert store.steps() == [7]
    manifest = store.verify(7, world_size=3)
    assert manifest.job == "job" and manifest.step == 7 and manifest.world_size == 3
    assert [s.rank for s in manifest.shards] == [0, 1, 2]
    assert [s.file for s in manifest.shards] == [f"rank-{r:05d}.safetensors" for r in range(3)]
    for rank, (snap, state) in enumerate(written):
        back = store.read_shard(7, rank, manifest)
        assert back.step == 7
        assert back.skeleton == snap.skeleton
        assert back.metas == snap.metas
        assert isinstance(back.payload, np.ndarray) and back.payload.dtype == np.uint8
        assert back.digest() == snap.digest()
        assert_same_tree(state, restore(back))
    # Without a manifest passed in, read_shard fetches it itself.
    assert store.read_shard(7, 1).digest() == written[1][0].digest()


def test_round_trip_of_a_torch_payload_and_an_empty_state(uri, make_store):
    store = make_store(uri)
    state = {"w": torch.arange(10, dtype=torch.int16), "step": 3}
    snap = SnapshotBuffer().capture(3, state)  # payload: a view of the buffer, a torch tensor
    assert isinstance(snap.payload, torch.Tensor)
    empty = SnapshotBuffer().capture(3, {"step": 3, "none": []})
    records = [store.write_shard(3, 0, snap), store.write_shard(3, 1, empty)]
    manifest = store.write_manifest(3, 2, records)
    assert_same_tree(state, restore(store.read_shard(3, 0, manifest)))
    back = store.read_shard(3, 1, manifest)
    assert back.nbytes == 0 and back.digest() == empty.digest()
    assert restore(back) == {"step": 3, "none": []}


def test_layout_and_uri_forms(tmp_path, make_store):
    root = tmp_path / "ck"
    store = make_store(str(root), job="train-1")
    write_step(store, 42, world_size=2)
    step_dir = root / "train-1" / "step-000000000042"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "manifest.json",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    assert store.describe() == str(root / "train-1")
    # file:// and a trailing slash name the same place.
    other = make_store(f"file://{root}/", job="train-1")
    assert other.describe() == store.describe()
    assert other.newest_valid(2)[0] == store.manifest(42)
    fs, path = parse_uri(f"file://{root}/")
    assert path == str(root) and fs.exists(path)


def test_manifest_json(uri, make_store):
    store = make_store(uri)
    snap, _ = make_snapshot(5)
    rec = store.write_shard(5, 0, snap)
    manifest = store.write_manifest(5, 1, [rec], extra={"loss": 1.5, "tokens": 10})
    doc = json.loads(store.fs.cat_file(manifest_path(store, 5)))
    assert doc == {
        "format": "stalwart-manifest-1",
        "job": "job",
        "step": 5,
        "world_size": 1,
        "shards": [{"rank": 0, "file": rec.file, "nbytes": rec.nbytes, "sha256": rec.sha256}],
        "created_at": manifest.created_at,
        "extra": {"loss": 1.5, "tokens": 10},
    }
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert store.manifest(5) == manifest
    # The record says what is on storage.
    raw = store.fs.cat_file(shard_path(store, 5, 0))
    assert rec == ShardRecord(
        0, "rank-00000.safetensors", len(raw), hashlib.sha256(raw).hexdigest()
    )


def test_shard_is_a_safetensors_file(tmp_path, make_store):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    store = make_store(str(tmp_path), job="j")
    snap, _ = make_snapshot(12, n=100)
    store.write_shard(12, 3, snap)
    path = shard_path(store, 12, 3)

    tensors = safetensors_numpy.load_file(path)
    assert list(tensors) == ["payload"]
    assert tensors["payload"].dtype == np.uint8
    assert np.array_equal(tensors["payload"], snap.payload)

    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "stalwart-shard-1"
    assert (meta["job"], meta["step"], meta["rank"]) == ("j", "12", "3")
    import base64

    assert base64.b64decode(meta["skeleton"]) == snap.skeleton
    metas = json.loads(meta["metas"])
    assert [m["offset"] for m in metas] == [m.offset for m in snap.metas]
    assert metas[0] == {
        "offset": 0,
        "nbytes": 100 * 8 * 4,
        "dtype": "float32",
        "shape": [100, 8],
        "device": "cpu",
    }
    # The raw layout: 8-byte length, a header padded to a multiple of 8, then the payload.
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 : 8 + n].decode().startswith("{")
    assert raw[8 + n :] == snap.payload.tobytes()


def test_large_payload_is_streamed_in_chunks(tmp_path, make_store, monkeypatch):
    store = make_store(str(tmp_path))
    n = 20 * (1 << 20) // 4  # 20 MB of float32
    state = {"big": torch.arange(n, dtype=torch.float32)}
    snap = SnapshotBuffer().capture(1, state)
    sizes: list[int] = []
    real_open = open

    class Recording(FailingFile):
        def write(self, data) -> int:
            sizes.append(len(data))
            return self.f.write(data)

    monkeypatch.setattr(
        durable_io, "open", lambda p, m: Recording(real_open(p, m), 0, enospc()), raising=False
    )
    rec = store.write_shard(1, 0, snap)
    monkeypatch.undo()

    raw = Path(shard_path(store, 1, 0)).read_bytes()
    assert rec.nbytes == len(raw) > 20 * (1 << 20)
    assert rec.sha256 == hashlib.sha256(raw).hexdigest()
    assert max(sizes) <= CHUNK and len(sizes) >= 20 * (1 << 20) // CHUNK
    manifest = store.write_manifest(1, 1, [rec])
    store.verify(1, 1, deep=True)
    back = store.read_shard(1, 0, manifest)
    assert back.digest() == snap.digest()
    assert torch.equal(restore(back)["big"], state["big"])


# -- what makes a step valid ---------------------------------------------------------------


def test_a_step_without_manifest_is_skipped(uri, make_store):
    store = make_store(uri)
    write_step(store, 10)
    snap, _ = make_snapshot(20)
    store.write_shard(20, 0, snap)
    store.write_shard(20, 1, snap_for(20, 1))
    assert store.steps() == [10, 20]
    manifest, skipped = store.newest_valid(world_size=2)
    assert manifest.step == 10
    assert len(skipped) == 1 and skipped[0][0] == 20
    assert "manifest" in skipped[0][1] and "partial" in skipped[0][1]
    with pytest.raises(CorruptCheckpoint) as e:
        store.verify(20)
    assert e.value.step == 20 and "manifest.json" in e.value.reason
    message = str(e.value)
    assert "\n" not in message and "step-000000000020" in message and "20" in message


def snap_for(step: int, rank: int) -> Snapshot:
    return make_snapshot(step, rank)[0]


def test_truncated_shard_falls_back_to_the_older_step(uri, make_store):
    store = make_store(uri)
    write_step(store, 30)
    write_step(store, 40)
    path = shard_path(store, 40, 1)
    raw = store.fs.cat_file(path)
    store.fs.pipe_file(path, raw[: len(raw) // 2])

    manifest, skipped = store.newest_valid(world_size=2)
    assert manifest.step == 30
    [(step, reason)] = skipped
    assert step == 40
    assert "rank 1" in reason and "truncated" in reason and "size mismatch" in reason
    # The shallow check sees it too, and so does a direct read.
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        store.verify(40, deep=False)
    with pytest.raises(CorruptCheckpoint, match="truncated") as e:
        store.read_shard(40, 1)
    assert e.value.step == 40
    assert store.read_shard(40, 0).step == 40  # the other rank's shard is fine


def test_tampered_byte_of_the_same_size_fails_the_sha256(uri, make_store):
    store = make_store(uri)
    write_step(store, 30)
    write_step(store, 40)
    path = shard_path(store, 40, 0)
    raw = bytearray(store.fs.cat_file(path))
    raw[-100] ^= 0x01
    store.fs.pipe_file(path, bytes(raw))

    assert store.verify(40, deep=False).step == 40  # same size: only the hash tells
    with pytest.raises(CorruptCheckpoint, match="sha256 mismatch") as e:
        store.verify(40)
    assert "rank 0" in e.value.reason
    manifest, skipped = store.newest_valid(world_size=2)
    assert manifest.step == 30
    assert skipped[0][0] == 40 and "sha256 mismatch" in skipped[0][1]
    with pytest.raises(CorruptCheckpoint, match="sha256 mismatch"):
        store.read_shard(40, 0, store.manifest(40))


def test_tampered_header_length_is_caught_before_parsing(uri, make_store):
    store = make_store(uri)
    write_step(store, 40, world_size=1)
    path = shard_path(store, 40, 0)
    raw = store.fs.cat_file(path)
    for length in (2**62, 9):  # absurd, and plausible but wrong
        store.fs.pipe_file(path, struct.pack("<Q", length) + raw[8:])
        with pytest.raises(CorruptCheckpoint, match="sha256 mismatch"):
            store.read_shard(40, 0)


def test_manifest_of_another_job(uri, make_store):
    store = make_store(uri, job="a")
    write_step(store, 30)
    write_step(store, 40)
    rewrite_manifest(store, 40, {"job": "b"})
    with pytest.raises(CorruptCheckpoint, match="job 'b'"):
        store.verify(40)
    manifest, skipped = store.newest_valid()
    assert manifest.step == 30 and "'b'" in skipped[0][1]
    # Another job's store under the same URI sees nothing of job a.
    assert make_store(uri, job="b").steps() == []


def test_other_world_size(uri, make_store):
    store = make_store(uri)
    write_step(store, 30, world_size=2)
    with pytest.raises(CorruptCheckpoint, match=r"2 ranks.*now has 4"):
        store.verify(30, world_size=4)
    manifest, skipped = store.newest_valid(world_size=4)
    assert manifest is None and [s for s, _ in skipped] == [30]
    assert store.newest_valid()[0].world_size == 2  # no world size asked: any


def test_step_mismatch(uri, make_store):
    store = make_store(uri)
    write_step(store, 10)
    write_step(store, 20)
    store.fs.pipe_file(manifest_path(store, 20), store.fs.cat_file(manifest_path(store, 10)))
    with pytest.raises(CorruptCheckpoint, match="step 10"):
        store.verify(20)


def test_shard_list_must_be_ranks_0_to_world_size(uri, make_store):
    store = make_store(uri)
    records = [store.write_shard(5, r, snap_for(5, r)) for r in range(3)]
    with pytest.raises(ValueError, match="ranks"):
        store.write_manifest(5, 3, records[:2])
    with pytest.raises(ValueError, match="ranks"):
        store.write_manifest(5, 2, [records[0], records[2]])
    store.write_manifest(5, 3, records[::-1])  # any order: stored by rank
    assert [s.rank for s in store.manifest(5).shards] == [0, 1, 2]
    rewrite_manifest(store, 5, {"world_size": 4})
    with pytest.raises(CorruptCheckpoint, match=r"ranks \[0, 1, 2\], expected 0..3"):
        store.verify(5)
    doc = json.loads(store.fs.cat_file(manifest_path(store, 5)))
    doc["world_size"] = 3
    doc["shards"][2] = dict(doc["shards"][1])  # rank 1 twice, rank 2 missing
    store.fs.pipe_file(manifest_path(store, 5), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpoint, match=r"ranks \[0, 1, 1\]"):
        store.verify(5)


def test_missing_shard_file(uri, make_store):
    store = make_store(uri)
    write_step(store, 30)
    write_step(store, 40)
    store.fs.rm_file(shard_path(store, 40, 1))
    with pytest.raises(
        CorruptCheckpoint, match=r"rank 1's shard rank-00001\.safetensors is missing"
    ):
        store.verify(40, deep=False)
    with pytest.raises(CorruptCheckpoint, match="missing"):
        store.read_shard(40, 1)
    manifest, skipped = store.newest_valid()
    assert manifest.step == 30 and "missing" in skipped[0][1]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"format": "other-1"}).encode(), "format"),
        (json.dumps({"format": "stalwart-manifest-1", "job": "job"}).encode(), "step"),
    ],
)
def test_unparsable_manifest(uri, make_store, content, why):
    store = make_store(uri)
    write_step(store, 30)
    write_step(store, 40)
    store.fs.pipe_file(manifest_path(store, 40), content)
    with pytest.raises(CorruptCheckpoint, match=r"unparsable manifest\.json") as e:
        store.manifest(40)
    assert why in e.value.reason
    manifest, skipped = store.newest_valid()
    assert manifest.step == 30 and skipped[0][0] == 40


def test_manifest_field_types_are_checked(uri, make_store):
    store = make_store(uri)
    write_step(store, 30, world_size=1)
    for changes, why in [
        ({"step": "30"}, "step"),
        ({"world_size": True}, "world_size"),
        ({"shards": [{"rank": 0, "file": "x", "nbytes": 1, "sha256": "zz"}]}, "sha256"),
        ({"shards": ["rank-00000.safetensors"]}, "shards[0]"),
        ({"extra": []}, "extra"),
    ]:
        write_step(store, 30, world_size=1)
        rewrite_manifest(store, 30, changes)
        with pytest.raises(CorruptCheckpoint, match=re.escape(why)):
            store.manifest(30)


def test_shard_file_names_cannot_leave_the_step_directory(uri, make_store):
    store = make_store(uri)
    write_step(store, 10, world_size=1)
    write_step(store, 20, world_size=1)
    doc = json.loads(store.fs.cat_file(manifest_path(store, 20)))
    doc["shards"][0]["file"] = "../step-000000000010/rank-00000.safetensors"
    store.fs.pipe_file(manifest_path(store, 20), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpoint, match="unsafe"):
        store.verify(20)
    with pytest.raises(CorruptCheckpoint, match="unsafe"):
        store.read_shard(20, 0)


def test_read_shard_checks_the_header_against_where_it_was_found(uri, make_store):
    """A shard copied under another rank's name (with a manifest that matches its bytes)
    is refused: its header says whose it is."""
    store = make_store(uri)
    rec0 = store.write_shard(9, 0, snap_for(9, 0))
    raw = store.fs.cat_file(shard_path(store, 9, 0))
    store.fs.pipe_file(shard_path(store, 9, 1), raw)
    rec1 = ShardRecord(1, "rank-00001.safetensors", rec0.nbytes, rec0.sha256)
    manifest = store.write_manifest(9, 2, [rec0, rec1])
    assert store.verify(9).step == 9  # the bytes are what the manifest says
    with pytest.raises(CorruptCheckpoint, match="says rank '0', expected '1'"):
        store.read_shard(9, 1, manifest)
    # A different job's store reading the same bytes refuses them too.
    other = make_store(uri, job="other")
    other.fs.makedirs(other.step_dir(9), exist_ok=True)
    other.fs.pipe_file(shard_path(other, 9, 0), raw)
    other.write_manifest(9, 1, [rec0])
    with pytest.raises(CorruptCheckpoint, match="says job 'job', expected 'other'"):
        other.read_shard(9, 0)


def test_a_header_of_the_wrong_format_is_refused(uri, make_store):
    store = make_store(uri)
    header = json.dumps(
        {
            "payload": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "__metadata__": {"format": "stalwart-shard-1", "job": "job", "step": "3", "rank": "0"},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    raw = struct.pack("<Q", len(header)) + header + bytes(16)
    store.fs.makedirs(store.step_dir(3), exist_ok=True)
    store.fs.pipe_file(shard_path(store, 3, 0), raw)
    rec = ShardRecord(0, "rank-00000.safetensors", len(raw), hashlib.sha256(raw).hexdigest())
    manifest = store.write_manifest(3, 1, [rec])
    with pytest.raises(CorruptCheckpoint, match="describes its payload"):
        store.read_shard(3, 0, manifest)


def test_corrupt_checkpoint_message_and_pickling():
    e = CorruptCheckpoint(40, "rank 2's shard is truncated", "s3://b/job/step-000000000040")
    assert str(e) == (
        "checkpoint step 40 (s3://b/job/step-000000000040) is unusable: rank 2's shard is truncated"
    )
    back = pickle.loads(pickle.dumps(e))
    assert (back.step, back.reason, str(back)) == (e.step, e.reason, str(e))


def test_newest_valid_at_most(uri, make_store):
    store = make_store(uri)
    for step in (10, 20, 30):
        write_step(store, step)
    store.fs.rm_file(manifest_path(store, 20))
    manifest, skipped = store.newest_valid(at_most=25)
    assert manifest.step == 10 and [s for s, _ in skipped] == [20]
    manifest, skipped = store.newest_valid(at_most=5)
    assert manifest is None and skipped == []
    assert store.newest_valid()[0].step == 30


def test_steps_lists_only_step_directories(uri, make_store):
    store = make_store(uri)
    assert store.steps() == []  # nothing written yet: no job directory at all
    write_step(store, 3, world_size=1)
    write_step(store, 100, world_size=1)
    store.fs.pipe_file(f"{store.root}/step-000000000200", b"a file, not a step")
    store.fs.makedirs(f"{store.root}/notes", exist_ok=True)
    store.fs.pipe_file(f"{store.root}/notes/x", b"")
    assert store.steps() == [3, 100]


# -- failures, retries, chaos ----------------------------------------------------------------


def test_retries_with_backoff_then_success(uri, make_store, clock, sleeper):
    store = make_store(uri)  # retries=3, backoff 0.5 s
    store.fail_for(3.0)
    snap, state = make_snapshot(4)
    rec = store.write_shard(4, 0, snap)
    assert sleeper.calls == [0.5, 1.0, 2.0]  # failed at +0, +0.5, +1.5; fine at +3.5
    store.write_manifest(4, 1, [rec])
    assert sleeper.calls == [0.5, 1.0, 2.0]  # storage is back: no more waiting
    assert_same_tree(state, restore(store.read_shard(4, 0)))


def test_retries_exhausted_raise_durable_error_naming_the_path(uri, make_store, sleeper):
    store = make_store(uri)
    store.fail_for(60)
    with pytest.raises(DurableError) as e:
        store.write_shard(4, 2, snap_for(4, 2))
    message = str(e.value)
    assert "step-000000000004/rank-00002.safetensors" in message
    assert "storage unavailable (injected by chaos for 60 s)" in message
    assert "4 attempts" in message
    assert isinstance(e.value.__cause__, OSError)
    assert sleeper.calls == [0.5, 1.0, 2.0]
    with pytest.raises(DurableError, match=r"manifest\.json"):
        store.write_manifest(4, 1, [ShardRecord(0, "rank-00000.safetensors", 1, "0" * 64)])


def test_fail_for_blocks_every_operation_until_the_clock_passes(uri, make_store, clock, sleeper):
    store = make_store(uri, retries=0)
    write_step(store, 1, world_size=1)
    store.fail_for(10)
    with pytest.raises(DurableError, match="unavailable"):
        store.write_shard(2, 0, snap_for(2, 0))
    clock.advance(9.9)
    for op in (
        lambda: store.write_shard(2, 0, snap_for(2, 0)),
        store.steps,
        lambda: store.manifest(1),
        lambda: store.read_shard(1, 0),
        # Unavailable storage says nothing about the checkpoints: no step is "skipped".
        store.newest_valid,
        lambda: store.prune(1),
    ):
        with pytest.raises(DurableError, match="unavailable"):
            op()
    assert sleeper.calls == []
    clock.advance(0.1)
    rec = store.write_shard(2, 0, snap_for(2, 0))
    store.write_manifest(2, 1, [rec])
    assert store.newest_valid()[0].step == 2


def test_transient_local_errors_are_retried(tmp_path, make_store, monkeypatch, sleeper):
    store = make_store(str(tmp_path))
    real_open = open
    attempts = []

    def flaky_open(path, mode):
        attempts.append(path)
        budget = 100 if len(attempts) <= 2 else 1 << 40
        return FailingFile(real_open(path, mode), budget, OSError(errno.EIO, "I/O error"))

    monkeypatch.setattr(durable_io, "open", flaky_open, raising=False)
    snap, state = make_snapshot(6)
    rec = store.write_shard(6, 0, snap)
    assert sleeper.calls == [0.5, 1.0]
    assert len(attempts) == 3 and len(set(attempts)) == 3  # a fresh temp name each time
    store.write_manifest(6, 1, [rec])
    monkeypatch.undo()
    assert sorted(os.listdir(store.step_dir(6))) == ["manifest.json", "rank-00000.safetensors"]
    assert_same_tree(state, restore(store.read_shard(6, 0)))


def test_failed_local_write_leaves_neither_temp_nor_partial_file(tmp_path, make_store, monkeypatch):
    store = make_store(str(tmp_path), retries=2)
    real_open = open
    temps = []

    def failing_open(path, mode):
        temps.append(path)
        return FailingFile(real_open(path, mode), 1000, OSError(errno.EIO, "I/O error"))

    monkeypatch.setattr(durable_io, "open", failing_open, raising=False)
    with pytest.raises(DurableError, match="I/O error"):
        store.write_shard(8, 0, snap_for(8, 0))
    monkeypatch.undo()
    assert len(temps) == 3
    assert all(Path(t).parent == Path(store.step_dir(8)) for t in temps)
    assert all(Path(t).name.startswith(".rank-00000.safetensors.tmp") for t in temps)
    assert os.listdir(store.step_dir(8)) == []  # no temp file left, nothing under the final name


def test_failed_fsync_removes_the_temp_file(tmp_path, make_store, monkeypatch):
    store = make_store(str(tmp_path), retries=1)
    write_step(store, 1, world_size=1)

    def no_fsync(fd):
        raise enospc()

    monkeypatch.setattr(durable_io.os, "fsync", no_fsync)
    with pytest.raises(DurableError, match="No space left"):
        store.write_shard(2, 0, snap_for(2, 0))
    monkeypatch.undo()
    assert os.listdir(store.step_dir(2)) == []


def test_full_disk_keeps_the_older_checkpoint_valid(tmp_path, make_store, monkeypatch, sleeper):
    store = make_store(str(tmp_path))
    written = write_step(store, 10, world_size=2)
    real_open = open
    monkeypatch.setattr(
        durable_io,
        "open",
        lambda path, mode: FailingFile(real_open(path, mode), 100, enospc()),
        raising=False,
    )
    with pytest.raises(DurableError) as e:
        store.write_shard(20, 0, snap_for(20, 0))
    assert "No space left on device" in str(e.value) and "rank-00000.safetensors" in str(e.value)
    assert sleeper.calls == [0.5, 1.0, 2.0]
    with pytest.raises(DurableError, match=r"manifest\.json.*No space left"):
        store.write_manifest(20, 1, [ShardRecord(0, "rank-00000.safetensors", 1, "0" * 64)])
    monkeypatch.undo()
    manifest, skipped = store.newest_valid(world_size=2)
    assert manifest.step == 10
    assert [s for s, _ in skipped] == [20] and "manifest" in skipped[0][1]
    assert os.listdir(store.step_dir(20)) == []
    assert store.read_shard(10, 1, manifest).digest() == written[1][0].digest()


def test_failed_remote_write_removes_the_partial_object(mem_uri, make_store, monkeypatch):
    store = make_store(mem_uri, retries=1)
    real_open = store.fs.open

    def failing_open(path, mode="rb", **kw):
        f = real_open(path, mode, **kw)
        return FailingFile(f, 1000, OSError(errno.EIO, "I/O error")) if "w" in mode else f

    monkeypatch.setattr(store.fs, "open", failing_open)
    with pytest.raises(DurableError, match="I/O error"):
        store.write_shard(8, 0, snap_for(8, 0))
    monkeypatch.undo()
    assert not store.fs.exists(shard_path(store, 8, 0))


def test_constructor_checks(tmp_path):
    for job in ("", "a/b", ".."):
        with pytest.raises(ValueError):
            DurableStore(str(tmp_path), job)
    with pytest.raises(ValueError):
        DurableStore(str(tmp_path), "j", retries=-1)


def test_write_shard_refuses_a_snapshot_of_another_step(uri, make_store):
    store = make_store(uri)
    with pytest.raises(ValueError, match="step 5, not 6"):
        store.write_shard(6, 0, snap_for(5, 0))
    with pytest.raises(TypeError):
        store.write_manifest(5, 0, [], extra={"not json": object()})


# -- pruning -------------------------------------------------------------------------------


def test_prune(uri, make_store):
    store = make_store(uri)
    store.write_shard(5, 0, snap_for(5, 0))  # incomplete, older than everything
    for step in (10, 20, 30, 40):
        write_step(store, step)
    store.write_shard(25, 0, snap_for(25, 0))  # incomplete, between complete steps
    store.write_shard(50, 1, snap_for(50, 1))  # incomplete, newest: may be being written
    assert store.steps() == [5, 10, 20, 25, 30, 40, 50]

    assert store.prune(keep_last=2) == [5, 10, 20, 25]
    assert store.steps() == [30, 40, 50]
    assert store.fs.exists(shard_path(store, 50, 1))
    assert store.newest_valid(2)[0].step == 40
    assert store.verify(30).step == 30
    assert store.prune(keep_last=2) == []  # idempotent
    assert store.prune(keep_last=1) == [30]
    assert store.steps() == [40, 50]
    with pytest.raises(ValueError):
        store.prune(0)


def test_prune_leaves_the_steps_above_the_one_just_written(uri, make_store):
    # Another run of the job went to step 120; this one writes 10, 20, 30 with keep_last=2:
    # it keeps its own newest two, and 120 is not counted against them.
    store = make_store(uri)
    write_step(store, 120)
    pruned = []
    for step in (10, 20, 30):
        write_step(store, step)
        pruned += store.prune(keep_last=2, newest=step)
    assert pruned == [10]
    assert store.steps() == [20, 30, 120]


def test_prune_without_complete_steps_deletes_nothing(uri, make_store):
    store = make_store(uri)
    assert store.prune(1) == []
    store.write_shard(5, 0, snap_for(5, 0))
    assert store.prune(1) == []
    assert store.steps() == [5]


def test_prune_counts_a_step_with_a_damaged_shard_as_complete(uri, make_store):
    """Complete means "has a readable manifest"; verification is newest_valid's job."""
    store = make_store(uri)
    for step in (10, 20):
        write_step(store, step)
    store.fs.rm_file(shard_path(store, 20, 0))
    assert store.prune(keep_last=2) == []
    assert store.prune(keep_last=1) == [10]


# -- boundaries ----------------------------------------------------------------------------


def test_ckpt_never_imports_the_orchestrator_or_ray():
    names = set()
    trees = [ast.parse(Path(m.__file__).read_text()) for m in (durable, durable_io)]
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    assert not {n for n in names if n.split(".")[0] in ("orchestrator", "ray")}
    assert "pickle" not in names  # only ckpt.snapshot's allow-listed unpickler decodes

"""The durable tier's DCP format (ckpt/dcp_format.py, ckpt/manifest.py, ckpt/dcp_read.py):
a step written by the ranks' nodes reads back exactly, every file and blob is checked, DCP's
own reader reads it, format 1 steps beside it still read, and nothing is unpickled that a
checkpoint chose (its `.metadata` through an allow-list). One process: the sharded paths run
in tests/unit/test_sharded_world.py and tests/component/test_fsdp_dcp.py."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from stalwart.ckpt.dcp_dir import dcp_reader
from stalwart.ckpt.dcp_format import CheckpointMismatch
from stalwart.ckpt.dcp_read import read_foreign_metadata
from stalwart.ckpt.durable import CorruptCheckpoint, DurableStore
from stalwart.ckpt.fsdp import sharded_views
from stalwart.ckpt.snapshot import restore
from stalwart.orchestrator.worker.restore import InitFromError, init_from
from tests.unit.test_durable import make_snapshot, mem_uri, write_step
from tests.unit.test_snapshot import assert_same_tree

pytestmark = pytest.mark.timeout(60)
__all__ = ["mem_uri"]  # the fixture, shared with tests/unit/test_durable.py


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path, mem_uri) -> DurableStore:
    uri = str(tmp_path / "ck") if request.param == "local" else mem_uri
    return DurableStore(uri, "job", retries=0)


def write_dcp_step(store: DurableStore, step: int, world: int = 2) -> list:
    states, writes = [], []
    for rank in range(world):
        snap, state = make_snapshot(step, seed=rank)
        writes.append(store.write_rank(step, rank, snap))
        states.append((snap, state))
    store.write_manifest(step, world, writes=writes)
    return states


def test_a_step_reads_back_exactly_and_lists_dcp_files(store):
    states = write_dcp_step(store, 10)
    m = store.verify(10, 2)
    assert m.format == "stalwart-manifest-2" and not m.sharded
    assert sorted(store.fs.ls(store.step_dir(10), detail=False)) == sorted(
        f"{store.step_dir(10)}/{n}"
        for n in ("__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json")
    )
    for rank, (snap, state) in enumerate(states):
        back = store.read_shard(10, rank, m)
        assert back.digest() == snap.digest()
        assert_same_tree(restore(back), state)


@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata"])
def test_a_damaged_file_is_found_by_verify_and_read(store, damage):
    write_dcp_step(store, 10)
    d = store.step_dir(10)
    path = f"{d}/.metadata" if damage == "metadata" else f"{d}/__1_0.distcp"
    data = bytearray(store.fs.cat_file(path))
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptCheckpoint) as e:
        store.verify(10, 2)
    reason = e.value.reason
    if damage == "truncate":
        assert "__1_0.distcp is truncated" in reason, reason
    elif damage == "metadata":
        assert ".metadata is corrupt (sha256 mismatch" in reason, reason
    else:
        assert "__1_0.distcp is corrupt (sha256 mismatch" in reason, reason
    if damage == "flip":  # a read checks every blob it takes
        with pytest.raises(CorruptCheckpoint, match=r"sha256 mismatch|does not load"):
            store.read_shard(10, 1)


def test_format_1_steps_are_still_read_beside_dcp_steps(store):
    old = write_step(store, 10)
    new = write_dcp_step(store, 20)
    assert [store.verify(s, 2).format for s in (10, 20)] == [
        "stalwart-manifest-1",
        "stalwart-manifest-2",
    ]
    assert store.read_shard(10, 1).digest() == old[1][0].digest()
    assert store.read_shard(20, 1).digest() == new[1][0].digest()
    assert store.newest_valid(2)[0].step == 20


def test_dcps_own_reader_loads_the_step(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store = DurableStore(str(tmp_path / "ck"), "job")
    states = write_dcp_step(store, 10)
    dcp_to_torch_save(store.step_dir(10), str(tmp_path / "all.pt"))
    loaded = torch.load(tmp_path / "all.pt", weights_only=False)
    own = loaded["stalwart"]["rank1"]  # rank 1's own tensors, one after another, as bytes
    snap = states[1][0]
    assert own.dtype == torch.uint8
    for t in (restore(snap)["w"], restore(snap)["opt"]["exp_avg"]):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        assert any(torch.equal(own[i : i + raw.numel()], raw) for i in range(own.numel()))


def test_another_world_size_is_refused_unless_the_state_is_sharded(store):
    write_dcp_step(store, 10)
    with pytest.raises(CorruptCheckpoint, match="holds no sharded state to reshard"):
        store.verify(10, 3, reshard=True)
    with pytest.raises(CorruptCheckpoint, match="written by 2 ranks, the job now has 3"):
        store.verify(10, 3)


def test_a_foreign_metadata_naming_other_code_is_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("this ran",))

    with pytest.raises(CheckpointMismatch, match=r"refers to builtins\.print, refused"):
        read_foreign_metadata(pickle.dumps(Evil()), "/ckpt")
    with pytest.raises(CheckpointMismatch, match="holds a dict"):
        read_foreign_metadata(pickle.dumps({"a": 1}), "/ckpt")


def _dcp_save(state: dict, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_init_from_loads_a_plain_dcp_checkpoint_and_its_step(tmp_path):
    saved = torch.nn.Linear(3, 2)
    _dcp_save({"model": saved.state_dict(), "step": 7}, tmp_path / "ck")
    model = torch.nn.Linear(3, 2)
    views = sharded_views({"model": model})
    assert init_from(str(tmp_path / "ck"), views, dcp_reader) == 7
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)


def test_init_from_another_model_or_a_missing_one_is_refused_naming_the_field(tmp_path):
    _dcp_save({"model": torch.nn.Linear(5, 2).state_dict()}, tmp_path / "other")
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    views = sharded_views({"model": model})
    with pytest.raises(InitFromError) as e:
        init_from(str(tmp_path / "other"), views, dcp_reader)
    text = str(e.value)
    assert "checkpoint.init_from" in text and "not a checkpoint of this model" in text
    assert "model.weight: (2, 5) saved, (2, 3) here" in text
    assert torch.equal(model.weight, before)  # nothing loaded
    with pytest.raises(InitFromError, match=r"has no \.metadata"):
        init_from(str(tmp_path / "nowhere"), views, dcp_reader)
    _dcp_save({"net": torch.nn.Linear(3, 2).state_dict()}, tmp_path / "named")
    with pytest.raises(
        InitFromError, match=r"holds no state for the registered objects \['model'\]"
    ):
        init_from(str(tmp_path / "named"), views, dcp_reader)


def test_the_manifest_refuses_a_layout_that_does_not_add_up(store):
    write_dcp_step(store, 10)
    path = f"{store.step_dir(10)}/manifest.json"
    doc = json.loads(store.fs.cat_file(path))
    doc["layouts"] = doc["layouts"][:1]
    store.fs.pipe_file(path, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpoint, match="1 rank layouts for a world of 2"):
        store.verify(10, 2)

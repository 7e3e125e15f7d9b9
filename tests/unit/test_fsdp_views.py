"""What ctx.register puts in front of a sharded model and its optimizer (ckpt/fsdp.py), the
placements a snapshot records (ckpt/dtensor.py), FSDP1's refusal, and the chaos faults
that fire inside a collective (spec `in_collective`, ElasticGroup.arm). Pure: no process
group (the DTensor paths run in tests/unit/test_sharded_world.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from stalwart.ckpt import dtensor
from stalwart.ckpt.fsdp import (
    ShardedOptimizer,
    UnsupportedWrapper,
    canonical,
    refuse_fsdp1,
    sharded_views,
)
from stalwart.ckpt.skeleton import SkeletonUnpickler
from stalwart.ckpt.snapshot import TensorRef
from stalwart.orchestrator.spec import SpecError, validate
from stalwart.orchestrator.worker.collective import ElasticGroup


def test_canonical_names_drop_compile_and_checkpoint_wrappers():
    assert canonical("blocks.0._checkpoint_wrapped_module.attn.weight") == "blocks.0.attn.weight"
    assert canonical("_orig_mod.head.weight") == "head.weight"
    assert canonical("head.weight") == "head.weight"


def test_plain_objects_get_no_view():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    views = sharded_views({"model": model, "optimizer": opt})
    assert views["model"] is model and views["optimizer"] is opt


def test_the_optimizer_view_keys_by_fqn_and_loads_back_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    view = ShardedOptimizer(opt, [model])
    sd = view.state_dict()
    assert sorted(sd["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert sd["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    ShardedOptimizer(fresh, [model]).load_state_dict(sd)
    assert fresh.state_dict()["param_groups"][0]["lr"] == 0.01
    for a, b in zip(fresh.state.values(), opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_an_optimizer_over_parameters_of_no_registered_module_is_refused():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="belong to no registered module"):
        ShardedOptimizer(opt, [model])


def test_fsdp1_is_refused_with_what_to_use():
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = object.__new__(FullyShardedDataParallel)  # its type is what is judged
    with pytest.raises(UnsupportedWrapper) as e:
        refuse_fsdp1("model", fsdp1)
    text = str(e.value)
    assert "ctx.register(model=...)" in text and "fully_shard" in text
    assert "docs/migrating.md" in text


def test_placements_are_kept_as_plain_values_and_come_back():
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    for p in (Shard(1), Replicate(), Partial("sum"), _StridedShard(0, split_factor=2)):
        value = dtensor.encode_placement(p)
        assert all(isinstance(v, str | int) for v in value)
        assert dtensor.decode_placement(value) == p


def test_a_shard_ref_passes_the_skeletons_allow_list():
    ref = dtensor.ShardRef(
        0,
        ("cpu", (2, 2), ("replicate", "shard"), "ab"),
        (("replicate",), ("shard", 0)),
        (6, 4),
        (4, 1),
        (3, 0),
    )
    back = SkeletonUnpickler(pickle.dumps({"w": ref}, protocol=5), TensorRef).load()
    assert back == {"w": ref}


def test_a_mesh_is_described_by_its_dimensions():
    key = ("cpu", (2, 2), ("replicate", "shard"), "ab")
    assert dtensor.describe_mesh(key) == "cpu mesh (replicate=2, shard=2)"
    assert dtensor.describe_mesh(("cuda", (8,), (), "cd")) == "cuda mesh (8)"


def _spec(**fault):
    return {
        "name": "t",
        "entrypoint": "m:f",
        "workers": 2,
        "steps": 10,
        "chaos": {"faults": [{"rank": 0, "at_step": 3, **fault}]},
    }


@pytest.mark.parametrize("kind", ["kill_worker", "kill_node", "hang"])
def test_in_collective_is_for_kills_and_hangs(kind):
    spec = validate(_spec(kind=kind, in_collective="reduce_scatter"))
    assert spec.chaos.faults[0].in_collective == "reduce_scatter"


def test_in_collective_elsewhere_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"chaos\.faults\.0\.in_collective: only for"):
        validate(_spec(kind="slow", in_collective="all_gather"))
    with pytest.raises(SpecError, match=r"chaos\.faults\.0\.in_collective"):
        validate(_spec(kind="kill_worker", in_collective="all_gather", during="restore"))
    with pytest.raises(SpecError, match=r"in_collective"):
        validate(_spec(kind="hang", in_collective="gossip"))


def test_an_armed_fault_fires_around_the_next_collective_of_its_kind_only():
    group = ElasticGroup()
    calls: list[tuple[str, bool]] = []
    group.arm("reduce_scatter", lambda issued: calls.append(("fire", issued)))
    group._on_collective("allreduce", False)
    group._on_collective("allreduce", True)
    assert calls == []
    group._on_collective("_reduce_scatter_base", False)
    group._on_collective("_reduce_scatter_base", True)
    assert calls == [("fire", False), ("fire", True)]
    group._on_collective("_reduce_scatter_base", False)  # once: disarmed after it fired
    assert len(calls) == 2


def test_workers_that_do_not_fit_the_shard_groups_are_refused_naming_the_field():
    base = {"name": "t", "entrypoint": "m:f", "steps": 10}
    with pytest.raises(SpecError, match=r"workers\.min: must be a multiple of workers"):
        validate({**base, "workers": {"min": 3, "max": 4, "multiple_of": 2}})
    with pytest.raises(SpecError, match=r"workers\.max: must be a multiple"):
        validate({**base, "workers": {"min": 2, "max": 5, "multiple_of": 2}})
    spec = validate({**base, "workers": {"min": 2, "max": 6, "multiple_of": 2}})
    assert spec.world_multiple == 2
    assert validate({**base, "workers": 4}).world_multiple == 1


def test_a_mesh_the_world_does_not_fill_is_refused_with_what_to_do():
    from stalwart.orchestrator.worker.mesh import MeshShapeError, check_shape

    check_shape((2, 2), 4)
    for shape, world in (((2, 2), 3), ((3,), 4), ((2, 4), 4)):
        with pytest.raises(MeshShapeError) as e:
            check_shape(shape, world)
        text = str(e.value)
        assert f"mesh_shape={shape}" in text and f"world has {world}" in text
        assert "ctx.world_size" in text and "workers.multiple_of" in text

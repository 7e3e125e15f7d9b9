"""State a recovery would lose, found at the first snapshot (worker/exactness.py), and two
restored states compared object by object (ckpt/compare.py, `stalwart verify`)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from stalwart.ckpt.compare import compare_objects
from stalwart.orchestrator.worker.collective import local_group
from stalwart.orchestrator.worker.exactness import unregistered
from stalwart.orchestrator.worker.stateful import stateful

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def parts():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    ema = AveragedModel(model)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, ema, scaler


def test_unregistered_scheduler_ema_and_scaler_are_named(parts):
    model, opt, _sched, _ema, _scaler = parts
    t0 = time.perf_counter()
    found = unregistered({"model": model, "optimizer": opt})
    took = time.perf_counter() - t0
    assert len(found) == 3, found
    assert any("LR scheduler (StepLR)" in f and "'optimizer'" in f for f in found)
    assert any("GradScaler" in f for f in found)
    assert any("AveragedModel" in f for f in found)
    print(f"scan took {took * 1000:.0f} ms")


def test_everything_registered_gives_no_warning(parts):
    model, opt, sched, ema, scaler = parts
    assert (
        unregistered(
            {"model": model, "optimizer": opt, "scheduler": sched, "ema": ema, "scaler": scaler}
        )
        == []
    )


def test_an_unregistered_optimizer_of_a_registered_ddp_model_is_named():
    net = torch.nn.Linear(3, 3)
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=local_group())
    opt = torch.optim.Adam(ddp.parameters())
    found = unregistered({"model": ddp})
    assert any("optimizer (Adam)" in f for f in found), found
    assert unregistered({"model": ddp, "optimizer": opt}) == []


def test_an_unregistered_powersgd_state_is_named_and_registered_it_round_trips():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from stalwart.ckpt.snapshot import SnapshotBuffer, restore

    net = torch.nn.Linear(3, 3)
    state = PowerSGDState(process_group=None, start_powerSGD_iter=2, random_seed=3)
    found = unregistered({"model": net})
    assert any("PowerSGDState" in f and "ctx.register(powersgd=" in f for f in found), found
    adapter = stateful("powersgd", state)
    assert not any("PowerSGD" in f for f in unregistered({"model": net, "powersgd": adapter}))
    # What changes as the hook runs goes through a snapshot and back.
    state.iter, state.error_dict[0] = 5, torch.arange(4.0)
    state.rng.randint(10)
    snap = SnapshotBuffer().capture(5, {"p": adapter.state_dict()})
    expect = state.rng.randint(1_000_000)
    other = PowerSGDState(process_group=None, start_powerSGD_iter=2, random_seed=3)
    stateful("powersgd", other).load_state_dict(restore(snap)["p"])
    assert other.iter == 5 and torch.equal(other.error_dict[0], torch.arange(4.0))
    assert other.rng.randint(1_000_000) == expect


def _state(model, opt, step=3):
    return {"step": step, "objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}}


def test_compare_names_the_first_differing_tensor_and_value():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    a = _state(model, opt)
    b = {
        "objects": {
            "model": {k: v.clone() for k, v in a["objects"]["model"].items()},
            "optimizer": {**a["objects"]["optimizer"]},
        }
    }
    assert all(d.identical for d in compare_objects(a, b))
    b["objects"]["model"]["weight"][1, 2] += 1e-6
    b["objects"]["optimizer"] = {
        **a["objects"]["optimizer"],
        "param_groups": [{**a["objects"]["optimizer"]["param_groups"][0], "lr": 0.05}],
    }
    model_diff, opt_diff = compare_objects(a, b)
    assert (model_diff.name, model_diff.identical, model_diff.path) == ("model", False, "weight")
    assert "1 of 6 elements differ" in model_diff.detail
    assert (opt_diff.identical, opt_diff.path) == (False, "param_groups[0]/lr")
    assert opt_diff.detail == "0.1 vs 0.05"
    del b["objects"]["optimizer"]
    [_, gone] = compare_objects(a, b)
    assert gone.detail == "not registered in the second run"


def test_numpy_state_compares_and_digests_by_its_bytes():
    import numpy as np

    from stalwart.ckpt.snapshot import nested_digest

    a = {"objects": {"rng": {"legacy": {"key": np.arange(2000, dtype=np.uint32)}}}}
    b = {"objects": {"rng": {"legacy": {"key": np.arange(2000, dtype=np.uint32)}}}}
    assert compare_objects(a, b)[0].identical
    b["objects"]["rng"]["legacy"]["key"][1000] += 1  # in the part a repr would elide
    [diff] = compare_objects(a, b)
    assert (diff.identical, diff.path) == (False, "legacy/key")
    assert nested_digest(a["objects"]) != nested_digest(b["objects"])


def test_a_registered_sequential_schedule_covers_its_parts():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[3])
    assert unregistered({"model": model, "optimizer": opt, "scheduler": seq}) == []

"""A loop's data position and random generators, checkpointed (worker/data.py): a
DataLoader with a shuffling DistributedSampler, epochs and worker processes resumes at the
batch after the restored one, through the same snapshot round trip a recovery uses."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from stalwart.ckpt.snapshot import SnapshotBuffer, restore
from stalwart.orchestrator.worker.data import Epochs
from stalwart.orchestrator.worker.stateful import stateful

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]

STEPS = 70  # batches: 3 epochs of 25 for rank 1 of 2, with 100 samples and batches of 2


def _loader(kind: str, workers: int):
    data = TensorDataset(torch.arange(200.0).reshape(100, 2), torch.arange(100))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    cls = StatefulDataLoader if kind == "stateful" else DataLoader
    return Epochs(cls(data, batch_size=2, sampler=sampler, num_workers=workers), sampler)


def _round_trip(state):
    """What a recovery does with registered state: a snapshot, then a restore."""
    return restore(SnapshotBuffer(False).capture(1, {"objects": {"data": state}}))["objects"][
        "data"
    ]


@pytest.mark.parametrize(("kind", "workers"), [("stateful", 2), ("stateful", 0), ("plain", 0)])
@pytest.mark.parametrize("stop", [10, 25, 49])
def test_a_restored_loader_goes_on_with_the_next_batch(kind, workers, stop):
    straight = _loader(kind, workers)
    seen = [next(straight)[1].tolist() for _ in range(STEPS)]
    # The sampler reshuffled every epoch: the epochs' orders differ.
    assert seen[:25] != seen[25:50]

    first = _loader(kind, workers)
    for _ in range(stop):
        next(first)
    state = _round_trip(first.state_dict())
    # After an epoch's last batch, the next epoch starts at the next batch.
    assert (state["epoch"], state["batches"]) == ((0, 25) if stop == 25 else divmod(stop, 25))
    resumed = _loader(kind, workers)  # a new process: the loop built it again
    resumed.load_state_dict(state)
    assert [next(resumed)[1].tolist() for _ in range(STEPS - stop)] == seen[stop:]


def test_random_generators_can_be_registered_and_round_trip():
    gens = {
        "torch": torch.Generator().manual_seed(5),
        "numpy": np.random.default_rng(5),
        "legacy": np.random.RandomState(5),
        "python": random.Random(5),
    }
    views = {name: stateful(name, g) for name, g in gens.items()}
    states = {name: _round_trip(v.state_dict()) for name, v in views.items()}

    def draw():
        return (
            torch.rand(3, generator=gens["torch"]).tolist(),
            gens["numpy"].random(3).tolist(),
            gens["legacy"].rand(3).tolist(),
            [gens["python"].random() for _ in range(3)],
        )

    first = draw()
    for name, v in views.items():
        v.load_state_dict(states[name])
    assert draw() == first


def test_an_object_without_state_is_refused_by_name():
    with pytest.raises(TypeError, match=r"ctx.register\(cache=...\).*got dict"):
        stateful("cache", {})


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_restore_mid_epoch_leaves_the_global_generator_as_the_straight_run_had_it(kind):
    """Making an epoch's iterator draws a seed from torch's global generator: the straight
    run drew it at the epoch's start, so the restore must not draw again after the
    generators are put back (the order ctx.steps() restores in: objects, then RNG)."""

    def draws(loader, n):
        out = []
        for _ in range(n):
            next(loader)
            out.append(torch.rand(1).item())  # dropout, say
        return out

    torch.manual_seed(0)
    straight = _loader(kind, 0)
    draws(straight, 10)
    state, rng = _round_trip(straight.state_dict()), torch.get_rng_state()
    expected = draws(straight, 20)

    resumed = _loader(kind, 0)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert draws(resumed, 20) == expected


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_state_taken_before_the_first_batch_restores_exactly(kind):
    """The fresh start's snapshot (step 0) is taken before any batch."""
    torch.manual_seed(0)
    straight = _loader(kind, 2 if kind == "stateful" else 0)
    state, rng = _round_trip(straight.state_dict()), torch.get_rng_state()
    expected = [(next(straight)[1].tolist(), torch.rand(1).item()) for _ in range(5)]
    resumed = _loader(kind, 2 if kind == "stateful" else 0)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [(next(resumed)[1].tolist(), torch.rand(1).item()) for _ in range(5)] == expected


def test_an_epoch_without_a_batch_is_an_error_not_a_spin():
    data = TensorDataset(torch.arange(3.0))
    loader = DataLoader(data, batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="epoch 0 has no batch"):
        next(Epochs(loader))

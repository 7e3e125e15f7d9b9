"""A train loop's data position and random generators, checkpointed like its model.

`Epochs` turns the ordinary ``DataLoader(dataset, sampler=DistributedSampler(...),
num_workers=N)`` into an endless stream of batches that knows where it is: the epoch (it
calls ``sampler.set_epoch`` at each epoch's start, so shuffling follows the epoch as in
any DDP script) and the position within it. Register it and a recovery resumes at the
batch after the restored step's, not at the epoch's start::

    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
    data = stalwart.Epochs(loader, sampler)
    ctx.register(model=model, optimizer=optimizer, data=data)
    for step in ctx.steps():
        images, labels = next(data)

The position within an epoch comes from the loader's own state: torchdata's
StatefulDataLoader (a drop-in DataLoader) keeps it, workers included. A plain DataLoader has
no such state; `Epochs` then counts the batches it handed out and, on a restore, loads that
many of the epoch's again (a restore late in a long epoch costs that time: StatefulDataLoader
avoids it). Randomness inside DataLoader workers (augmentation) is
not restored mid-epoch: draw it from a generator seeded by the sample's index and epoch
(docs/exactness.md).

`stateful(name, obj)` lets ``ctx.register`` take random generators, which have no
state_dict: ``torch.Generator``, ``numpy.random.Generator``/``RandomState`` and
``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class Epochs:
    """Batches of `loader` forever, epoch after epoch; `sampler` (if it has set_epoch) is
    told each epoch. state_dict: the epoch, the batches done in it, the loader's state."""

    def __init__(self, loader: Any, sampler: Any = None, start_epoch: int = 0):
        self.loader = loader
        self.sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.epoch = start_epoch
        self.batches = 0  # handed out in this epoch
        self._it: Iterator[Any] | None = None
        self._stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")

    def __iter__(self) -> Epochs:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                if hasattr(self.sampler, "set_epoch"):
                    self.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.batches = 0
                continue
            self.batches += 1
            return batch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self.batches}
        if self._stateful:
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        self._it = None
        if not self.batches:
            return  # at an epoch's start: the next batch starts it, as in the straight run
        # The epoch's iterator is made now, before the restore puts the random generators
        # back: making one draws a seed from torch's global generator, which the straight
        # run did at the epoch's start (its draw is inside the restored state).
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        if self._stateful and "loader" in state:
            self.loader.load_state_dict(state["loader"])
            self._it = iter(self.loader)
            return
        self._it = iter(self.loader)
        for _ in range(self.batches):  # a plain DataLoader: the epoch's done batches again
            try:
                next(self._it)
            except StopIteration:
                self._it = None
                break


class _TorchGenerator:
    def __init__(self, g: torch.Generator):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g.set_state(state["state"])


class _NumpyGenerator:
    def __init__(self, g: np.random.Generator | np.random.RandomState):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.g, np.random.RandomState):
            return {"legacy": self.g.get_state(legacy=False)}
        return {"bit_generator": self.g.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "legacy" in state:
            self.g.set_state(state["legacy"])
        else:
            self.g.bit_generator.state = state["bit_generator"]


class _PythonRandom:
    def __init__(self, g: random.Random):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.g.getstate()
        return {"version": version, "internal": list(internal), "gauss": gauss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g.setstate((state["version"], tuple(state["internal"]), state["gauss"]))


def stateful(name: str, obj: Any) -> Any:
    """`obj`, or an adapter giving a random generator state_dict/load_state_dict."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, np.random.Generator | np.random.RandomState):
        return _NumpyGenerator(obj)
    if isinstance(obj, random.Random):
        return _PythonRandom(obj)
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise TypeError(
            f"ctx.register({name}=...): needs state_dict() and load_state_dict() (or a "
            f"torch, numpy or python random generator), got {type(obj).__name__}"
        )
    return obj

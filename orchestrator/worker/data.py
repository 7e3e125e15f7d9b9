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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


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
                if self.batches == 0:
                    raise ValueError(
                        f"stalwart.Epochs: epoch {self.epoch} has no batch (a sampler's share "
                        "smaller than a batch with drop_last?)"
                    ) from None
                self.epoch += 1
                self.batches = 0
                continue
            self.batches += 1
            return batch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self.batches}
        # Only inside an epoch: a StatefulDataLoader asked before its first batch makes
        # an iterator (drawing a seed from torch's generator) that a restore would not.
        if self._stateful and self._it is not None:
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
        for done in range(self.batches):  # a plain DataLoader: the epoch's done batches again
            try:
                next(self._it)
            except StopIteration:
                raise ValueError(
                    f"stalwart.Epochs: the checkpoint is {self.batches} batches into epoch "
                    f"{self.epoch}, but this loader's epoch has {done}: the data or the batch "
                    "size changed since"
                ) from None

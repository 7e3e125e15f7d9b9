"""Sharded optimizer state: each rank checkpoints and restores its own shard only.

A sharded optimizer (ZeRO stage 1: torch.distributed.optim.ZeroRedundancyOptimizer) keeps
the optimizer state of a partition of the parameters on each rank. Its own ``state_dict()``
gathers every shard to one rank first (``consolidate_state_dict()``, a collective), which a
per-step, off-the-critical-path checkpoint cannot afford and does not need: each rank's
snapshot is its own shard, replicated and persisted like any other rank-local state.

`RankShard` is the view ``ctx.register`` puts in front of such an optimizer. Its state dict
is the local optimizer's, tagged with the partition it belongs to (rank, world size, the
sizes of the rank's parameters), and loading checks that tag: restoring rank k's shard into
any other rank, a different world size or a different partition raises `ShardMismatch`
instead of silently training with another rank's moments. stalwart does not reshard: a job
with sharded state keeps a fixed number of workers (an elastic resize fails with that error).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Not imported here: torch.distributed.optim costs each process 1.6 s of CPU at start-up,
# and an object can only be one if its program imported it already.
_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


class ShardMismatch(RuntimeError):
    """A shard of sharded state was offered to a rank or partition it does not belong to."""


class RankShard:
    """``state_dict``/``load_state_dict`` of one rank's shard of a ZeroRedundancyOptimizer."""

    def __init__(self, optimizer: ZeroRedundancyOptimizer):
        self.optimizer = optimizer

    def partition(self) -> dict[str, Any]:
        zero = self.optimizer
        local = [p.numel() for g in zero.optim.param_groups for p in g["params"]]
        return {"rank": zero.rank, "world_size": zero.world_size, "numels": local}

    def state_dict(self) -> dict[str, Any]:
        return {"partition": self.partition(), "local": self.optimizer.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "partition" not in state or "local" not in state:
            raise ShardMismatch(
                "checkpointed optimizer state is not a rank's shard (expected keys "
                "'partition' and 'local'); was the job run without ZeroRedundancyOptimizer?"
            )
        saved, here = state["partition"], self.partition()
        if (saved["rank"], saved["world_size"]) != (here["rank"], here["world_size"]):
            raise ShardMismatch(
                f"optimizer shard of rank {saved['rank']} of {saved['world_size']} offered to "
                f"rank {here['rank']} of {here['world_size']}: stalwart does not reshard "
                "ZeroRedundancyOptimizer state; keep `workers` fixed (no elastic min) for "
                "sharded optimizers"
            )
        if list(saved["numels"]) != here["numels"]:
            raise ShardMismatch(
                f"rank {here['rank']}: optimizer shard holds parameters of sizes "
                f"{_brief(saved['numels'])}, this rank's partition has {_brief(here['numels'])}; "
                "the model or the optimizer's parameter groups changed"
            )
        zero = self.optimizer
        zero.optim.load_state_dict(state["local"])
        # Hyperparameters (a scheduler's learning rate) live in the local optimizer's groups
        # and in the wrapper's mirror; ZeroRedundancyOptimizer.step() copies the mirror down,
        # so it must hold the restored values too.
        for src, dst in zip(zero.optim.param_groups, zero.param_groups, strict=True):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value


def _brief(numels: list[int]) -> str:
    return f"[{', '.join(map(str, numels[:6]))}{', ...' if len(numels) > 6 else ''}] " + (
        f"({len(numels)} tensors)"
    )


def rank_local_view(obj: Any) -> Any:
    """What ``ctx.register`` checkpoints for `obj`: a `RankShard` for a sharded optimizer,
    the object itself otherwise."""
    zero = sys.modules.get(_ZERO_MODULE)
    if zero is not None and isinstance(obj, zero.ZeroRedundancyOptimizer):
        return RankShard(obj)
    return obj

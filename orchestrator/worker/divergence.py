"""The divergence guard: data-parallel replicas must hold the same parameters, bit for bit.

A loop whose ranks drift apart (a rank-dependent code path, an init that depends on the
rank, a model that is not wrapped in DDP) trains to the end with several models. After the
first step and every `every` steps, each rank sums every parameter's bits (the tensor
viewed as integers of its element size, summed in int64: one pass over the parameters) and
the ranks all-reduce the sums twice, with MAX and MIN: where they disagree, the replicas
differ. Buffers are not compared: under DDP's ``broadcast_buffers`` they legitimately
differ after a step (DDP copies rank 0's at the start of the next forward).

A sharded model's parameters (DTensors: FSDP2, HSDP) are compared among the ranks that
should hold the same values: the local shards along each Replicate dimension of their mesh
(HSDP's replicate dimension), over that dimension's group. A shard no other rank holds
(FSDP2 on a 1-D mesh) has nothing to be compared with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stalwart.ckpt import dtensor

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class ReplicaDivergence(RuntimeError):
    """The ranks' parameters differ: the loop's update is rank-dependent or
    nondeterministic, or the hardware corrupted them (silent data corruption). Not the
    user's ordinary error, and never retried blindly (health/policy.py)."""

    def __init__(
        self, message: str, step: int, tensors: list[str], outliers: list[int] | None
    ) -> None:
        super().__init__(message)
        self.step, self.tensors, self.outliers = step, tensors, outliers


# How many of the differing tensors the guard gathers every rank's fingerprint of, to name
# the ranks that differ from the majority (one int64 per rank and tensor).
OUTLIER_TENSORS = 8


def named_parameters(objects: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """'object.parameter' -> tensor, for every registered module (a DDP's inner module)."""
    out = []
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            obj = obj.module
        if isinstance(obj, torch.nn.Module):
            out += [(f"{name}.{n}", p) for n, p in obj.named_parameters()]
    return out


def fingerprint(params: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bits; any changed element changes it."""
    sums = []
    for _, p in params:
        t = dtensor.local_shard(p) if dtensor.is_dtensor(p) else p.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=t.device))
            continue
        view = t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t
        sums.append(view.sum(dtype=torch.int64))
    if not sums:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.stack([s.to(device) for s in sums])


def replica_groups(params: list[tuple[str, torch.Tensor]]) -> list[tuple[Any, list[int]]]:
    """(group, indices into `params`) for each set of ranks that must agree: None is the
    whole job (a plain parameter, replicated by DDP), else a DTensor mesh dimension's group
    along which the parameter is replicated. In parameter order, so that every rank issues
    its collectives in the same order."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, (_, p) in enumerate(params):
        if not dtensor.is_dtensor(p):
            groups.setdefault(0, (None, []))[1].append(i)
            continue
        for dim, placement in enumerate(p.placements):
            if placement.is_replicate():
                group = p.device_mesh.get_group(dim)
                groups.setdefault(id(group), (group, []))[1].append(i)
    return list(groups.values())


class DivergenceGuard:
    """`all_reduce(tensor, op, group)` is the job's (abortable) collective on `group` (None:
    every rank); `every` 0 = off."""

    def __init__(self, every: int, all_reduce: Callable[[torch.Tensor, str, Any], torch.Tensor]):
        self.every = every
        self._all_reduce = all_reduce
        self.checks = 0
        self.seconds = 0.0  # time the checks took, in all (their cost, reported)

    def due(self, step: int, first_of_generation: bool) -> bool:
        return self.every > 0 and (first_of_generation or step % self.every == 0)

    def check(
        self,
        step: int,
        objects: Mapping[str, Any],
        device: torch.device,
        rank: int | None = None,
        world: int | None = None,
    ) -> None:
        """Raise ReplicaDivergence when the ranks' parameters differ after `step` steps.
        With this `rank` of `world`, the ranks whose plain (DDP-replicated) parameters
        differ from the majority's are named (one more all-reduce, only on a divergence)."""
        t0 = time.perf_counter()
        params = named_parameters(objects)
        differ: list[int] = []
        whole: list[int] = []  # differing tensors replicated over every rank
        for group, indices in replica_groups(params):
            mine = fingerprint([params[i] for i in indices], device)
            high, low = mine.clone(), mine.clone()
            self._all_reduce(high, "max", group)
            self._all_reduce(low, "min", group)
            found = [indices[i] for i in (high != low).nonzero().flatten().tolist()]
            differ += found
            if group is None:
                whole = found
        outliers = None
        if whole and rank is not None and world is not None:
            outliers = self._outliers(params, whole[:OUTLIER_TENSORS], device, rank, world)
        self.checks += 1
        self.seconds += time.perf_counter() - t0
        if differ:
            differ = sorted(set(differ))
            names = [params[i][0] for i in differ]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            who = ""
            if outliers:
                who = (
                    f"rank(s) {', '.join(map(str, outliers))} differ from the other "
                    f"{world - len(outliers)}; "
                )
            raise ReplicaDivergence(
                f"the ranks' parameters differ after step {step} (the guard compares them "
                f"after each generation's first step and every {self.every} steps): {who}"
                f"{shown}. Data-parallel replicas must stay identical: either the loop's "
                "update depends on the rank or is not deterministic (wrap the model in "
                "DistributedDataParallel or ctx.prepare_model, keep rank-dependent code out "
                "of the update), or the hardware corrupted them (silent data corruption: "
                "the same rank on the same node again points at it). A sharded model's "
                "shards are compared along the mesh's replicate dimension only",
                step,
                names,
                outliers,
            )

    def _outliers(
        self,
        params: list[tuple[str, torch.Tensor]],
        indices: list[int],
        device: torch.device,
        rank: int,
        world: int,
    ) -> list[int]:
        """The ranks whose fingerprint of any of `indices` is not the majority's."""
        table = torch.zeros(world, len(indices), dtype=torch.int64, device=device)
        table[rank] = fingerprint([params[i] for i in indices], device)
        self._all_reduce(table, "sum", None)  # every rank's row: an all-gather
        odd: set[int] = set()
        for column in table.t().tolist():
            common = max(set(column), key=column.count)
            odd |= {r for r, value in enumerate(column) if value != common}
        return sorted(odd)

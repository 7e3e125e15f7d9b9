"""DTensors (FSDP2, HSDP, tensor parallel) in snapshots: a rank keeps its local shard only.

A sharded model's parameters and its optimizer's moments are DTensors: each rank holds a
local shard of a global tensor laid out over a DeviceMesh by its placements. A snapshot
takes the local shard (no all-gather on the training step) and records in the skeleton
what puts it back exactly: the mesh (its device type, shape, dimension names and rank
layout), the placements, the global shape and stride, and where the shard starts in the
global tensor (for assembling the full tensor from every rank's shards offline, and for
DCP's chunk metadata: ckpt/dcp_format.py), and whether this rank is the one of the
replicas of that chunk that writes it to durable storage.

A restore rebuilds each DTensor from its shard on the live mesh with the same key: the
mesh the loop built again in this generation, found among the registered objects' own
DTensors (`meshes_of`). A snapshot whose mesh the loop no longer builds (another world
size, another layout) is refused here with both layouts named; loading it into another
layout is resharding (ckpt/reshard.py).

torch.distributed.tensor is imported only by a process that uses DTensors already (it
costs 0.4 s to import): `dtensor_type()` is None until then.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stalwart.ckpt.lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:  # the supervisor and the node agents import this module and start without torch
    torch = LazyModule("torch")

_MODULE = "torch.distributed.tensor"

# (device type, mesh shape, dimension names, digest of the rank layout)
MeshKey = tuple[str, tuple[int, ...], tuple[str, ...], str]


class MeshChanged(RuntimeError):
    """A snapshot's DTensor shards belong to a mesh this generation does not have."""


@dataclass(frozen=True)
class ShardRef:
    """Placeholder in a skeleton for one DTensor: its local shard is tensor `index`."""

    index: int
    mesh: MeshKey
    placements: tuple[tuple[Any, ...], ...]  # ("shard", dim) ("replicate",) ...
    shape: tuple[int, ...]  # the global tensor's
    stride: tuple[int, ...]
    offset: tuple[int, ...]  # where the local shard starts in the global tensor
    # First along the mesh's dimensions that do not shard it (HSDP's replicate one): the
    # one rank of those holding this same chunk that writes it to durable storage.
    primary: bool = True


def dtensor_type() -> type | None:
    """torch's DTensor class, once this process imported it (None before: no DTensor)."""
    module = sys.modules.get(_MODULE)
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> bool:
    kind = dtensor_type()
    return kind is not None and isinstance(value, kind)


def local_shard(t: Any) -> torch.Tensor:
    """The rank's local tensor of DTensor `t`, detached (no autograd node per snapshot)."""
    return t._local_tensor.detach()


def shard_ref(t: Any, index: int) -> ShardRef:
    """The skeleton's placeholder for DTensor `t`, whose local shard is tensor `index`."""
    return ShardRef(index, *_spec_fields(t._spec))


@functools.lru_cache(maxsize=16384)
def _spec_fields(spec: Any) -> tuple:
    # A parameter's spec object lives as long as the parameter: what it gives is computed
    # once per DTensor layout, not per snapshot.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    coordinate = spec.mesh.get_coordinate() or [0] * len(spec.placements)
    primary = all(
        c == 0 for c, p in zip(coordinate, spec.placements, strict=True) if not p.is_shard()
    )
    return (
        mesh_key(spec.mesh),
        tuple(encode_placement(p) for p in spec.placements),
        tuple(spec.shape),
        tuple(spec.stride),
        tuple(int(o) for o in offset),
        primary,
    )


@functools.lru_cache(maxsize=256)
def mesh_key(mesh: Any) -> MeshKey:
    """What identifies a mesh across generations: equal for the mesh a loop builds again on
    the same ranks, different for another shape, names or layout."""
    ranks = mesh.mesh.flatten().tolist()
    layout = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return (
        str(mesh.device_type),
        tuple(int(n) for n in mesh.mesh.shape),
        tuple(mesh.mesh_dim_names or ()),
        layout,
    )


def describe_mesh(key: MeshKey) -> str:
    device, shape, names, _ = key
    dims = ", ".join(
        f"{name}={n}" if name else str(n)
        for name, n in zip(names or [""] * len(shape), shape, strict=True)
    )
    return f"{device} mesh ({dims})"


def encode_placement(p: Any) -> tuple[Any, ...]:
    """A placement as plain values (the skeleton holds no torch classes)."""
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    if isinstance(p, _StridedShard):
        return ("strided", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return ("shard", int(p.dim))
    if isinstance(p, Replicate):
        return ("replicate",)
    if isinstance(p, Partial):
        return ("partial", str(p.reduce_op))
    raise TypeError(f"a DTensor placement stalwart does not checkpoint: {p!r}")


def decode_placement(value: tuple[Any, ...]) -> Any:
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    kind = value[0]
    if kind == "shard":
        return Shard(value[1])
    if kind == "strided":
        return _StridedShard(value[1], split_factor=value[2])
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial(value[1])
    raise ValueError(f"unknown placement {value!r} in a checkpoint")


def meshes_of(objects: Iterable[Any]) -> dict[MeshKey, Any]:
    """The meshes of the DTensors that registered objects hold now (a module's parameters
    and buffers, an optimizer's parameters), by key."""
    kind = dtensor_type()
    found: dict[MeshKey, Any] = {}
    if kind is None:
        return found
    for obj in objects:
        tensors: list[Any] = []
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [p for g in obj.param_groups for p in g["params"]]
        for t in tensors:
            if isinstance(t, kind):
                found.setdefault(mesh_key(t.device_mesh), t.device_mesh)
    return found


def rebuilder(meshes: dict[MeshKey, Any]) -> Callable[[ShardRef, torch.Tensor], Any]:
    """What turns a ShardRef and its restored local tensor into a DTensor on `meshes`."""

    def rebuild(ref: ShardRef, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        mesh = meshes.get(ref.mesh)
        if mesh is None:
            have = ", ".join(describe_mesh(k) for k in meshes) or "no DTensors"
            raise MeshChanged(
                f"the checkpoint's shards are laid out on a {describe_mesh(ref.mesh)}; this "
                f"generation's registered objects have {have}: restoring them needs the "
                "same mesh on the same ranks (a different world size is resharded from a "
                "DCP checkpoint)"
            )
        return DTensor.from_local(
            local,
            mesh,
            [decode_placement(p) for p in ref.placements],
            run_check=False,
            shape=torch.Size(ref.shape),
            stride=ref.stride,
        )

    return rebuild


def no_meshes(ref: ShardRef, local: torch.Tensor) -> Any:
    """The rebuild of a process with no meshes (a tool reading a snapshot): refused."""
    raise MeshChanged(
        f"this snapshot holds DTensor shards (a {describe_mesh(ref.mesh)}); restore it in "
        "the job's processes, or assemble full tensors from every rank's snapshot"
    )


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or the full tensor of DTensor `t` (a collective on its mesh: every rank
    holding a shard calls it, in the same order)."""
    return t.full_tensor() if is_dtensor(t) else t

"""``init_device_mesh`` in a worker process: a mesh the world does not fill is refused with
what to do, instead of torch's error deep in the mesh's set-up (or, for a mesh smaller
than the world, ranks left outside it with no shards to train).

Under stalwart the world size is the job's (``workers``), and with an elastic job it
changes at a resize: a loop must build its mesh from ``ctx.world_size`` (HSDP: the shard
dimension fixed, the replicate one ``ctx.world_size // shard``), and the job spec keeps the
world a multiple of the shard size with ``workers.multiple_of``. `install` runs before the
entrypoint's module is imported, so a loop's ``from torch.distributed.device_mesh import
init_device_mesh`` takes the checked one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh

_installed = False


class MeshShapeError(ValueError):
    """A mesh shape the generation's world does not fill (a user error)."""


def check_shape(mesh_shape: Any, world: int) -> None:
    shape = tuple(int(n) for n in mesh_shape)
    ranks = math.prod(shape)
    if ranks != world:
        raise MeshShapeError(
            f"init_device_mesh(mesh_shape={shape}): the mesh has {ranks} ranks, this "
            f"generation's world has {world}: build the shape from ctx.world_size (HSDP: "
            "(ctx.world_size // shard, shard)), and for an elastic job keep workers.min and "
            "workers.max multiples of the shard size (workers.multiple_of)"
        )


def install() -> None:
    """Check every init_device_mesh of this process (once; a worker runs one job's loop)."""
    global _installed
    if _installed:
        return
    _installed = True
    original = device_mesh.init_device_mesh

    @functools.wraps(original)
    def init_device_mesh(device_type: str, mesh_shape: Any, *args: Any, **kwargs: Any) -> Any:
        if dist.is_initialized():
            check_shape(mesh_shape, dist.get_world_size())
        return original(device_type, mesh_shape, *args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    if hasattr(dist, "init_device_mesh"):
        dist.init_device_mesh = init_device_mesh

"""What a torchrun script expects of its process, given by each generation.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ... and the script
calls ``torch.distributed.init_process_group()``, builds ``DistributedDataParallel(model)``
and at the end ``destroy_process_group()``. Under stalwart the generation's group already
exists (orchestrator/worker/collective.py, abortable: worker/torch_group.py), so in a
worker process, once `install()` ran:

- the environment is set per generation (`set_environment`), the way torchrun sets it;
- ``init_process_group`` hands back the generation's group (checking any rank or
  world_size it is given) instead of failing with "trying to initialize the default process
  group twice"; ``destroy_process_group`` of the default group does nothing (stalwart owns
  it; the next generation replaces it);
- a DistributedDataParallel built on that group reduces its gradients in stalwart's fixed
  buckets (worker/buckets.py), overlapped with the backward: the layout depends on the
  model's parameters alone, not on DDP's bucket rebuild (a DDP built again in a recovery
  has DDP's initial layout while a long-running one has the rebuilt one), so a recovered
  run stays bit-identical to a failure-free one. ``register_comm_hook`` on it is kept:
  the user's hook (torch's fp16/bf16 compression, PowerSGD, their own) runs on stalwart's
  buckets, on the group its state names (the default group, abortable, when None).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from stalwart.orchestrator.worker.buckets import reduce_in_buckets
from stalwart.orchestrator.worker.torch_group import AbortableProcessGroup

log = logging.getLogger("stalwart.worker")

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
)

_installed = False


def environment(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    nodes: list[list[int]],
    master_addr: str,
    master_port: int,
    generation: int,
    max_restarts: int | None,
    run_id: str,
    device_index: int | None = None,
) -> dict[str, str]:
    """torchrun's variables for `rank` in a generation; `nodes`: each node's ranks, in
    node order (GROUP_RANK is the index of this rank's node). `device_index`: the worker's
    CUDA device; each worker sees only its own GPU (as cuda:0), so LOCAL_RANK, which
    scripts pass to torch.cuda.set_device, is that index (ctx.local_rank keeps the rank's
    position on its node)."""
    node = next((i for i, ranks in enumerate(nodes) if rank in ranks), 0)
    local_world = len(nodes[node]) if nodes else 1
    values: dict[str, Any] = {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": local_rank if device_index is None else device_index,
        "LOCAL_WORLD_SIZE": local_world,
        "GROUP_RANK": node,
        "GROUP_WORLD_SIZE": max(1, len(nodes)),
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": generation - 1,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts if max_restarts is not None else 2**31 - 1,
        "TORCHELASTIC_RUN_ID": run_id,
    }
    return {k: str(v) for k, v in values.items()}


def set_environment(values: dict[str, str]) -> None:
    os.environ.update(values)


def install() -> None:
    """Patch this process's torch.distributed and DDP as the module docstring says (once;
    a worker process runs only stalwart's train loop)."""
    global _installed
    if _installed:
        return
    _installed = True
    original_init = c10d.init_process_group
    original_destroy = c10d.destroy_process_group

    @functools.wraps(original_init)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        pg = c10d._world.default_pg
        if pg is None:
            return original_init(backend, *args, **kwargs)
        _check_init(pg, backend, kwargs)
        return None

    @functools.wraps(original_destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d._world.default_pg:
            return None  # the generation's group: stalwart replaces it, not the loop
        return original_destroy(group)

    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.destroy_process_group = destroy_process_group
    _patch_ddp()


def _check_init(pg: dist.ProcessGroup, backend: Any, kwargs: dict[str, Any]) -> None:
    for key, have in (("rank", pg.rank()), ("world_size", pg.size())):
        want = kwargs.get(key, -1)
        if want not in (-1, None) and int(want) != have:
            raise ValueError(
                f"init_process_group({key}={want}): this generation's {key} is {have} "
                f"(stalwart sets RANK and WORLD_SIZE; read them, or pass nothing)"
            )
    if backend is not None:
        ours = dist.get_backend(pg)
        asked = str(backend).lower()
        if ours not in asked.replace(":", ",").split(","):
            log.warning(
                "init_process_group(backend=%r): the job runs %r (the job spec's `backend`); "
                "using that",
                backend,
                ours,
            )


def _patch_ddp() -> None:
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    original_init = ddp_cls.__init__
    original_register = ddp_cls.register_comm_hook

    @functools.wraps(original_init)
    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        group = kwargs.get("process_group") or c10d._world.default_pg
        if getattr(getattr(group, "elastic", None), "restoring", False):
            # A restore follows (ctx.steps()): the broadcast of rank 0's state would be
            # overwritten at once; skip it (a fresh start keeps it).
            kwargs.setdefault("init_sync", False)
        original_init(self, module, *args, **kwargs)
        elastic = getattr(self.process_group, "elastic", None)
        if isinstance(self.process_group, AbortableProcessGroup) and elastic is not None:
            reduce_in_buckets(self, elastic, original_register)

    @functools.wraps(original_register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        reducer = getattr(self, "_stalwart_reducer", None)
        if reducer is None:
            return original_register(self, state, hook)
        reducer.use(state, hook)  # run on stalwart's buckets, which DDP's hook feeds
        return None

    ddp_cls.__init__ = __init__
    ddp_cls.register_comm_hook = register_comm_hook

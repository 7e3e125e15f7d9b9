"""Warnings, once, about state a recovery would lose (docs/exactness.md).

A recovery restores what the loop registered and nothing else. An LR scheduler, a
GradScaler or an EMA model that is not registered restarts from its initial state after a
recovery (the learning rate goes back to its first value, the loss scale to 65536, the
average to the current weights), and the run silently stops matching a failure-free one.
At the first snapshot, the process's live objects are searched once (the garbage
collector's list: ~0.1 s in a process that imported torch) for such objects that belong
with a registered optimizer or model but are not registered themselves, and for a PowerSGD
comm hook's state (its error feedback and warm-start matrices) that is not registered.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel

# DDP.module, RankShard.optimizer, ZeRO.optim, a PowerSGDState's adapter (worker/stateful.py)
_WRAPS = ("module", "optimizer", "optim", "hook_state")


def _wrapped(obj: Any) -> list[Any]:
    """`obj` and what it wraps (a DDP's module, a ZeRO shard's optimizer and its local one,
    a SequentialLR's or ChainedScheduler's schedulers)."""
    out, todo = [], [obj]
    while todo and len(out) < 32:
        o = todo.pop()
        out.append(o)
        todo += [w for w in (getattr(o, a, None) for a in _WRAPS) if w is not None]
        todo += list(getattr(o, "_schedulers", None) or ())
    return out


def _ids(objects: Mapping[str, Any]) -> dict[int, tuple[str, Any]]:
    """id -> (registered name, object), for every registered object and what it wraps."""
    out: dict[int, tuple[str, Any]] = {}
    for name, obj in objects.items():
        for o in _wrapped(obj):
            out.setdefault(id(o), (name, o))
    return out


def _params(objects: Mapping[str, Any]) -> set[int]:
    return {
        id(p)
        for obj in objects.values()
        for o in _wrapped(obj)
        if isinstance(o, torch.nn.Module)
        for p in o.parameters()
    }


_KINDS = (LRScheduler, torch.amp.GradScaler, AveragedModel, torch.optim.Optimizer, PowerSGDState)


def unregistered(objects: Mapping[str, Any]) -> list[str]:
    """What the loop should register and did not, one sentence each."""
    registered = _ids(objects)
    params = _params(objects)
    optimizers = {
        i: name for i, (name, o) in registered.items() if isinstance(o, torch.optim.Optimizer)
    }
    found: list[str] = []
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter asks some objects for __class__, which
        # deprecated torch objects answer with a warning.
        kind = type(obj)
        if id(obj) in registered or not issubclass(kind, _KINDS):
            continue
        if issubclass(kind, LRScheduler) and id(obj.optimizer) in optimizers:
            found.append(
                f"an LR scheduler ({type(obj).__name__}) of the registered optimizer "
                f"{optimizers[id(obj.optimizer)]!r} is not registered: after a recovery its "
                "schedule starts over (ctx.register(scheduler=...))"
            )
        elif issubclass(kind, torch.amp.GradScaler) and obj.is_enabled():
            found.append(
                "a GradScaler is not registered: after a recovery its loss scale starts over "
                "(ctx.register(scaler=...))"
            )
        elif issubclass(kind, AveragedModel):
            found.append(
                "an EMA/averaged model (AveragedModel) is not registered: after a recovery "
                "the average starts over from the current weights (ctx.register(ema=...))"
            )
        elif issubclass(kind, PowerSGDState):
            found.append(
                "a PowerSGD comm hook's state (PowerSGDState) is not registered: after a "
                "recovery its error feedback, warm-start matrices, random generator and "
                "iteration count (hence when compression starts) start over "
                "(ctx.register(powersgd=state))"
            )
        elif (
            issubclass(kind, torch.optim.Optimizer)
            and params
            and any(id(p) in params for g in obj.param_groups for p in g["params"])
        ):
            found.append(
                f"an optimizer ({type(obj).__name__}) of the registered model is not "
                "registered: after a recovery its state (momentum, Adam's moments) is lost "
                "(ctx.register(optimizer=...))"
            )
    return sorted(set(found))

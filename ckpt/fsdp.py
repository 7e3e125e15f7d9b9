"""A sharded model (FSDP2 ``fully_shard``, HSDP) and its optimizer under ``ctx.register``.

The state of such a model is its DTensors' local shards (ckpt/dtensor.py). What a
checkpoint keys them by must not depend on the world size or on wrappers, so that a
snapshot, a DCP checkpoint and torch's own ``get_state_dict`` agree on names: the views
here key the model by canonical FQNs (``torch.compile``'s ``_orig_mod.`` and activation
checkpointing's ``_checkpoint_wrapped_module.`` taken out) and the optimizer in the format
of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: ``state`` by
parameter FQN, ``param_groups`` listing FQNs.

Why not ``get_optimizer_state_dict`` itself on every snapshot: on an optimizer that has
no state yet (stalwart's step-0 snapshot, before the first step) it runs a step with zero
gradients and lr 0 to create the state (``_init_optim_state``), which sets AdamW's step
counter to 1: every later bias correction would differ from the same loop run without
stalwart. And it rebuilds its name maps on each call. The views compute the maps once
per registration and map keys only; loading a checkpoint of another layout (an elastic
resize, another world size, ``checkpoint.init_from``) goes through torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict`` (ckpt/reshard.py), where the
step with zero gradients is harmless: everything it sets is loaded over.

FSDP1 (``FullyShardedDataParallel``) is refused with what to use instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from stalwart.ckpt.dtensor import is_dtensor

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
_FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel"


class UnsupportedWrapper(TypeError):
    """A registered object stalwart cannot checkpoint as it is, with what to use instead."""


def canonical(name: str) -> str:
    """A parameter's name without the wrappers' segments (what DCP checkpoints use)."""
    for segment in _WRAPPERS:
        name = name.replace(segment, "")
    return name


def is_sharded_module(obj: Any) -> bool:
    """A module holding DTensor parameters (fully_shard, or a DTensor-parallel plan)."""
    return isinstance(obj, torch.nn.Module) and any(is_dtensor(p) for p in obj.parameters())


def refuse_fsdp1(name: str, obj: Any) -> None:
    module = sys.modules.get(_FSDP1)
    if module is not None and isinstance(obj, module.FullyShardedDataParallel):
        raise UnsupportedWrapper(
            f"ctx.register({name}=...): FullyShardedDataParallel (FSDP1) is not supported; "
            "shard the model with FSDP2 instead: `from torch.distributed.fsdp import "
            "fully_shard`, then fully_shard(block) for each block and fully_shard(model) "
            "(HSDP: a 2-D init_device_mesh), and register the model itself "
            "(docs/migrating.md, From FSDP2 / torchtitan)"
        )


class ShardedModel:
    """``state_dict``/``load_state_dict`` of a module with DTensor parameters, keyed by
    canonical FQN. The values are the module's own DTensors (the snapshot keeps their
    local shards)."""

    def __init__(self, module: torch.nn.Module):
        self.wrapped = module
        self._to_fqn = {k: canonical(k) for k in module.state_dict(keep_vars=True)}
        self._from_fqn = {v: k for k, v in self._to_fqn.items()}

    def state_dict(self) -> dict[str, Any]:
        return {self._to_fqn.get(k, k): v for k, v in self.wrapped.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wrapped.load_state_dict({self._from_fqn.get(k, k): v for k, v in state.items()})


class ShardedOptimizer:
    """``state_dict``/``load_state_dict`` of an optimizer over a sharded model's
    parameters, in get_optimizer_state_dict's format (keys are parameter FQNs)."""

    def __init__(self, optimizer: torch.optim.Optimizer, modules: Iterable[torch.nn.Module]):
        self.wrapped = optimizer
        fqn_of = {
            id(p): canonical(n)
            for m in modules
            for n, p in m.named_parameters(remove_duplicate=False)
        }
        params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in fqn_of]
        if missing:
            raise ValueError(
                f"ctx.register: the optimizer's parameters {missing[:8]} belong to no "
                "registered module; register the sharded model with its optimizer, e.g. "
                "ctx.register(model=model, optimizer=optimizer)"
            )
        self._fqns = [fqn_of[id(p)] for p in params]  # by the index state_dict() uses
        owned = {id(p) for p in params}
        # The module whose parameters it updates (torch's get_optimizer_state_dict's model).
        self.model = next(m for m in modules if any(id(p) in owned for p in m.parameters()))
        self._index = {fqn: i for i, fqn in enumerate(self._fqns)}

    def state_dict(self) -> dict[str, Any]:
        sd = self.wrapped.state_dict()
        return {
            "state": {self._fqns[i]: s for i, s in sd["state"].items()},
            "param_groups": [
                {**g, "params": [self._fqns[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state["state"]) - set(self._index))
        if unknown:
            raise ValueError(
                f"the checkpointed optimizer has state for parameters the model does not "
                f"have: {unknown[:5]}"
            )
        self.wrapped.load_state_dict(
            {
                "state": {self._index[k]: s for k, s in state["state"].items()},
                "param_groups": [
                    {**g, "params": [self._index[k] for k in g["params"]]}
                    for g in state["param_groups"]
                ],
            }
        )


def sharded_views(objects: dict[str, Any]) -> dict[str, Any]:
    """`objects` (name -> what ctx.register was given), with a sharded model and the
    optimizers over its parameters behind the views above; everything else as given."""
    for name, obj in objects.items():
        refuse_fsdp1(name, obj)
    modules = [o for o in objects.values() if is_sharded_module(o)]
    if not modules:
        return dict(objects)
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module) and obj in modules:
            out[name] = ShardedModel(obj)
        elif isinstance(obj, torch.optim.Optimizer) and any(
            is_dtensor(p) for g in obj.param_groups for p in g["params"]
        ):
            out[name] = ShardedOptimizer(obj, modules)
        else:
            out[name] = obj
    return out

"""Putting a rank's registered objects back: from its snapshot (the usual recovery), resharded
when the snapshot's mesh is not the one the loop built (an elastic resize, a resume at
another world size), or, at a job's start, from another job's DCP checkpoint
(``checkpoint.init_from``).

A snapshot restores onto the live meshes (ckpt/dtensor.py). When its DTensors are of
another layout, the sharded objects (a model under fully_shard, its optimizer) are loaded
from a DCP reader of the old world's shards instead (ckpt/reshard.py): the nodes' memory
or durable storage, whichever the supervisor named; the rest of the snapshot (random
states, counters, objects that are not sharded) is the rank's own, as usual.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stalwart.ckpt import dtensor
from stalwart.ckpt.dcp_format import CheckpointMismatch
from stalwart.ckpt.fsdp import ShardedModel, ShardedOptimizer
from stalwart.ckpt.snapshot import Snapshot, restore

# (a DCP reader of the snapshot's step in the old layout, where it is) or None
ReshardSource = Callable[[], tuple[Any, str] | None]


def _skip_shard(ref: dtensor.ShardRef, local: torch.Tensor) -> None:
    return None  # loaded resharded instead


def restore_objects(
    snap: Snapshot,
    objects: Mapping[str, Any],
    views: Mapping[str, Any],
    device: torch.device,
    resharded: ReshardSource,
    rank: int,
    retired: Sequence[Any] = (),
) -> dict[str, Any]:
    """Load `snap` into the registered objects (`views`: what ctx.register checkpoints for
    each); returns the snapshot's state (rng, counters, step) for the caller to apply."""
    rebuild = dtensor.rebuilder(dtensor.meshes_of(objects.values()))
    sharded: list[str] = []
    try:
        # Borrowed: the tensors are views of the payload, copied out below (load_into).
        state = restore(snap, device, rebuild, borrow=True)
    except dtensor.MeshChanged as e:
        source = resharded()
        if source is None:
            raise dtensor.MeshChanged(
                f"{e}; the loop built another mesh than the one this job checkpointed, "
                "with nothing to reshard from (build the same mesh for the same world size)"
            ) from None
        from stalwart.ckpt import reshard  # torch.distributed.checkpoint: 0.5 s to import

        reader, where = source
        state = restore(snap, device, _skip_shard, borrow=True)
        sharded = [n for n, v in views.items() if isinstance(v, ShardedModel | ShardedOptimizer)]
        reshard.load(views, sharded, reader, where)
    for name, view in views.items():
        if name not in state["objects"]:
            raise RuntimeError(
                f"rank {rank}: checkpoint has no {name!r}; registered objects changed "
                f"between generations ({sorted(state['objects'])})"
            )
        if name not in sharded:
            load_into(view, state["objects"][name], retired)
        obj = objects[name]
        if isinstance(obj, torch.nn.Module):
            obj.zero_grad(set_to_none=True)
    # What the caller applies (random states, counters, step): its own copies.
    return owned({k: v for k, v in state.items() if k != "objects"})


def load_into(view: Any, state: Any, retired: Sequence[Any] = ()) -> None:
    """Load `state`, whose tensors are borrowed views of a snapshot's payload, into a
    registered object without keeping any of them: a module copies them into its own
    tensors; a torch optimizer's state is copied into the tensors it already has where
    they match, else into tensors of the same kind the `retired` optimizers (the last
    generation's, which the loop built again) no longer need, else into copies: a
    survivor allocates nothing. Any other object (a sharded one, a user's) gets copies,
    as it may keep what it is given."""
    if isinstance(view, torch.nn.Module):
        view.load_state_dict(state)
    elif isinstance(view, torch.optim.Optimizer) and isinstance(state.get("state"), dict):
        view.load_state_dict(_into_optimizer_tensors(view, state, retired))
    else:
        view.load_state_dict(owned(state))


def _plain(t: Any) -> bool:
    return type(t) is torch.Tensor  # not a DTensor, nor another subclass


def _into_optimizer_tensors(
    opt: torch.optim.Optimizer, state: dict[str, Any], retired: Sequence[Any]
) -> dict:
    """`state` (an optimizer's state dict, borrowed) with each tensor copied into the
    optimizer's live tensor of the same parameter and key when that has the same shape,
    dtype and device (load_state_dict then keeps it as it is), else into a retired
    optimizer's tensor of that kind, else into a copy."""
    live = opt.state_dict()["state"]  # the live tensors, not copies
    taken = {id(t) for per in live.values() for t in per.values() if _plain(t)}
    spare: dict[tuple, list[torch.Tensor]] = {}
    for old in retired:
        if old is opt:
            continue
        for per in old.state.values():
            for t in per.values():
                if _plain(t) and id(t) not in taken:
                    taken.add(id(t))
                    spare.setdefault((t.shape, t.dtype, t.device), []).append(t)
    out = {}
    for pid, per_param in state.get("state", {}).items():
        have = live.get(pid, {})
        out[pid] = {}
        for key, value in per_param.items():
            if not _plain(value):
                out[pid][key] = owned(value)
                continue
            kind = (value.shape, value.dtype, value.device)
            mine = have.get(key)
            if _plain(mine) and (mine.shape, mine.dtype, mine.device) == kind:
                out[pid][key] = mine.copy_(value)
            elif spare.get(kind):
                out[pid][key] = spare[kind].pop().copy_(value)
            else:
                out[pid][key] = value.clone()
    return {**state, "state": out}


def owned(state: Any) -> Any:
    """`state` with every tensor in it copied (nested dicts, lists and tuples, their types
    and a state dict's `_metadata` kept)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        out = copy.copy(state)  # an OrderedDict's attributes (a module's _metadata) too
        for k, v in state.items():
            out[k] = owned(v)
        return out
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # a namedtuple
        return type(state)(*(owned(v) for v in state))
    if isinstance(state, list | tuple):
        return type(state)(owned(v) for v in state)
    return state


class InitFromError(ValueError):
    """checkpoint.init_from names a checkpoint that cannot start this job (a user error)."""


def init_from(uri: str, views: Mapping[str, Any], open_reader: Callable[[str], tuple]) -> int:
    """Load the registered objects the DCP checkpoint at `uri` holds state for (a job's own
    or another's: torchrun, torchtitan) into what the loop built; returns the step to go on
    from: the checkpoint's top-level `step`, else 0."""
    from stalwart.ckpt import reshard  # torch.distributed.checkpoint: 0.5 s to import

    try:
        reader, where = open_reader(uri)
        held = reshard.held_names(reader.read_metadata())
    except (CheckpointMismatch, OSError) as e:
        raise InitFromError(f"checkpoint.init_from: {e}") from None
    names = [n for n in views if n in held]
    if not names:
        raise InitFromError(
            f"checkpoint.init_from: {where} holds no state for the registered objects "
            f"{sorted(views)} (it holds {sorted(held)[:8]}): register them under the names "
            "the checkpoint was saved with (dcp.save({'model': ..., 'optimizer': ...}))"
        )
    try:
        reshard.load(views, names, reader, f"checkpoint.init_from {where}")
        return _saved_step(reader)
    except CheckpointMismatch as e:
        raise InitFromError(str(e)) from None


def _saved_step(reader: Any) -> int:
    import torch.distributed.checkpoint as dcp

    from stalwart.ckpt import reshard

    md = reader.read_metadata().state_dict_metadata.get("step")
    if md is None:
        return 0
    target: dict[str, Any] = {
        "step": torch.zeros((), dtype=torch.int64) if hasattr(md, "size") else 0
    }
    reshard._dcp_load(dcp, target, reader, "its step")
    value = target["step"]
    step = int(value.item() if isinstance(value, torch.Tensor) else value)
    if step < 0:
        raise CheckpointMismatch(f"its step is {step}")
    return step

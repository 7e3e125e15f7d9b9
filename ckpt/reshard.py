"""Loading a DCP checkpoint into the state a loop built, whatever layout it was saved in:
a sharded job after an elastic resize (from the old world's shards in memory, or from
durable storage), a resume at another world size, a job started from another job's
checkpoint (``checkpoint.init_from``), and a full-model export.

This is torch's supported way: the targets are what ``get_model_state_dict`` /
``get_optimizer_state_dict`` give for the objects the loop built (DTensors on its mesh),
``dcp.load`` fills them (each rank reads the pieces of the saved chunks its own shards
overlap), and ``set_optimizer_state_dict`` puts an optimizer's back. The readers are
ckpt/dcp_read.py's, which run none of a checkpoint's code.

What is exact (docs/exactness.md): every value is loaded exactly (a reshard moves bytes,
it computes nothing); the training after it is not the same as at the old world size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stalwart.ckpt.dcp_read import CheckpointMismatch, SafeLoadPlanner
from stalwart.ckpt.fsdp import ShardedModel, ShardedOptimizer


def _flat_keys(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def held_names(metadata: Any) -> set[str]:
    """The top-level names (registered objects) a checkpoint holds state for."""
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def targets(views: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """What to load `names` (registered objects) into: the state the loop built, as
    torch's get_state_dict API gives it (an optimizer's state created if it has none)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out: dict[str, Any] = {}
    for name in names:
        view = views[name]
        if isinstance(view, ShardedOptimizer):
            out[name] = get_optimizer_state_dict(view.model, view.wrapped)
        else:
            out[name] = view.state_dict()
    return out


def check(metadata: Any, wanted: dict[str, Any], where: str) -> None:
    """CheckpointMismatch naming what `wanted` needs and the checkpoint at `where` lacks or
    holds in another shape (another model's checkpoint)."""
    have = metadata.state_dict_metadata
    missing, shapes = [], []
    for key, value in _flat_keys(wanted).items():
        md = have.get(key)
        if md is None:
            missing.append(key)
        elif (
            isinstance(value, torch.Tensor)
            and hasattr(md, "size")
            and tuple(md.size) != tuple(value.shape)
        ):
            shapes.append(f"{key}: {tuple(md.size)} saved, {tuple(value.shape)} here")
    if missing or shapes:
        parts = []
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            parts.append(f"it has no {shown}")
        if shapes:
            parts.append("; ".join(shapes[:3]))
        raise CheckpointMismatch(f"{where} is not a checkpoint of this model: " + "; ".join(parts))


def load(views: Mapping[str, Any], names: list[str], reader: Any, where: str) -> None:
    """Load the registered objects `names` (their ctx.register views) from `reader`, a DCP
    checkpoint of any layout; CheckpointMismatch when it is another model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    wanted = targets(views, names)
    check(reader.read_metadata(), wanted, where)
    # Each rank reads what its own shards need: no collective (the planning is local).
    _dcp_load(dcp, wanted, reader, where)
    for name in names:
        view = views[name]
        if isinstance(view, ShardedOptimizer):
            set_optimizer_state_dict(view.model, view.wrapped, wanted[name])
        elif isinstance(view, ShardedModel):
            view.load_state_dict(wanted[name])
        else:
            view.load_state_dict(wanted[name])


def full_state(reader: Any, name: str) -> dict[str, torch.Tensor]:
    """Registered object `name`'s state with full (unsharded) tensors, assembled from every
    rank's chunks (what `stalwart checkpoint export` writes of a sharded checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.split(".", 1)[0] != name:
            continue
        # A value (a learning rate, the parameter names) is read as it was saved.
        is_tensor = hasattr(md, "size")
        flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if is_tensor else None
    if not flat:
        raise CheckpointMismatch(f"the checkpoint holds no state of {name!r}")
    _dcp_load(dcp, flat, reader, "the checkpoint")
    mapping = {k: tuple(metadata.planner_data.get(k, (k,))) for k in flat}
    return unflatten_state_dict(flat, mapping)[name]


def _dcp_load(dcp: Any, state: dict[str, Any], reader: Any, where: str) -> None:
    """dcp.load, its failures as CheckpointMismatch (DCP raises a BaseException, which
    would pass every `except Exception` on its way to the user)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # no_dist is asked for: each rank loads what its own shards need.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        causes = [f"{type(c).__name__}: {c}" for c in getattr(e, "failures", {}).values()]
        cause = "; ".join(causes)[:600] or str(e)[:600]
        raise CheckpointMismatch(f"{where} could not be loaded: {cause}") from None


def whole_state(snapshot: Any, reader: Callable[[], Any]) -> Any:
    """A rank's restored state (ckpt.snapshot.restore) with every object that holds DTensor
    shards assembled whole from the step's chunks (`reader()`, asked only then): what
    `stalwart checkpoint export` writes and `stalwart verify` compares."""
    from stalwart.ckpt.dcp_format import _has_shards
    from stalwart.ckpt.snapshot import restore

    # A shard stays its ShardRef: its object is then assembled whole.
    state = restore(snapshot, rebuild=lambda ref, local: ref)
    objects = state.get("objects") if isinstance(state, dict) else None
    if not isinstance(objects, dict):
        return state
    names = [n for n, v in objects.items() if _has_shards(v)]
    if names:
        source = reader()
        for name in names:
            objects[name] = full_state(source, name)
    return state

"""The formats `stalwart checkpoint export` writes (ckpt/export.py finds and reads the
checkpoint): a restored state dict made plain, then written as ``torch`` or ``safetensors``.

* `plain`: what ``torch.load(path, weights_only=True)`` takes (tensors, dicts, lists,
  tuples, sets, numbers, strings, bytes, None) stays; numpy arrays become tensors, numpy
  scalars Python numbers, deques lists, enums their value, numpy generators their state,
  anything else its ``str``, each conversion noted. Tensors end up on the CPU, contiguous,
  each owning exactly its own storage (what safetensors requires).
* `strip_wrapper_prefix`: a module state dict loses the prefix a wrapper put on every key
  (``module.`` from DistributedDataParallel, ``_orig_mod.`` from torch.compile).
* ``torch``: `torch.save` of the plain state, checked to load with ``weights_only=True``.
* ``safetensors``: the tensors under their dotted key paths (``state.0.exp_avg``); each
  tensor-free value under its dotted path in the file's metadata as a JSON string (a whole
  tensor-free subtree as one value: an optimizer's ``param_groups``); ``format`` is ``pt``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SUFFIX = {"torch": ".pt", "safetensors": ".safetensors"}
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile
_PLAIN = (str, int, float, bool, complex, bytes, type(None))  # exact types weights_only takes


class ExportError(Exception):
    """The caller's input is wrong (a path, a step, a rank, OUT); the message says which."""


class ExportFailed(Exception):
    """The checkpoint could not be restored or the export could not be written."""


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, on the CPU, contiguous, owning exactly its own storage."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() or not whole:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def plain(value: Any, path: str, notes: list[str]) -> Any:
    """`value` with every part `torch.load(weights_only=True)` takes (tensors, dicts,
    lists, tuples, sets, numbers, strings, bytes, None); the rest converted, noted."""
    if isinstance(value, torch.Tensor):
        return plain_tensor(value)
    if type(value) in _PLAIN:
        return value
    if isinstance(value, dict):
        kind = OrderedDict if isinstance(value, OrderedDict) else dict
        return kind(
            (_plain_key(k, path, notes), plain(v, f"{path}[{k!r}]", notes))
            for k, v in value.items()
        )
    if type(value) in (list, tuple, set, frozenset):
        items = [plain(v, f"{path}[{i}]", notes) for i, v in enumerate(value)]
        return type(value)(items)
    if isinstance(value, enum.Enum):
        return _note(notes, path, value, "its value", plain(value.value, path, notes))
    if isinstance(value, np.generic):
        return plain(value.item(), path, notes)
    if isinstance(value, np.ndarray):
        with contextlib.suppress(TypeError, ValueError):
            if not value.dtype.hasobject:
                tensor = torch.from_numpy(np.ascontiguousarray(value)).clone()
                return _note(notes, path, value, "a tensor", tensor)
        return _note(notes, path, value, "a list", plain(value.tolist(), path, notes))
    if isinstance(value, np.random.Generator):
        state = plain(value.bit_generator.state, path, notes)
        return _note(notes, path, value, "its bit generator's state", state)
    if isinstance(value, np.random.RandomState):
        state = plain(value.get_state(legacy=False), path, notes)
        return _note(notes, path, value, "its state", state)
    if isinstance(value, collections.deque | list | tuple | set | frozenset):
        base = next((k for k in (tuple, set, frozenset) if isinstance(value, k)), list)
        items = [plain(v, f"{path}[{i}]", notes) for i, v in enumerate(value)]
        return _note(notes, path, value, f"a {base.__name__}", base(items))
    if isinstance(value, _PLAIN):  # a subclass of str, int, ... (not an enum)
        base = next(k for k in _PLAIN if isinstance(value, k))
        return _note(notes, path, value, f"a {base.__name__}", base(value))
    return _note(notes, path, value, "a str", str(value))


def _plain_key(key: Any, path: str, notes: list[str]) -> Any:
    if type(key) in _PLAIN:
        return key
    if type(key) is tuple:
        return tuple(_plain_key(k, path, notes) for k in key)
    return _note(notes, f"{path} key {key!r}", key, "a str", str(key))


def _note(notes: list[str], path: str, value: Any, what: str, result: Any) -> Any:
    kind = type(value)
    notes.append(f"{path}: {kind.__module__}.{kind.__qualname__} written as {what}")
    return result


def strip_wrapper_prefix(state: Any) -> tuple[Any, str | None]:
    """A module state dict without the prefix every key shares from a wrapper
    (``module.``, ``_orig_mod.``, or both); other states unchanged."""
    stripped = ""
    while isinstance(state, dict) and state and all(isinstance(k, str) for k in state):
        if not any(isinstance(v, torch.Tensor) for v in state.values()):
            break
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None:
            break
        state = type(state)((k[len(prefix) :], v) for k, v in state.items())
        stripped += prefix
    return state, stripped or None


# -- writing ------------------------------------------------------------------------------


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """`write(tmp)` then rename tmp to `path` (never a half-written file under its name)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_torch(state: Any, path: str) -> dict[str, Any]:
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    # What a user's torch.load does, cheaply (mmap: the tensors' bytes are not read).
    try:
        torch.load(path, weights_only=True, mmap=True)
    except Exception as e:  # a value `plain` let through that weights_only refuses: our bug
        raise ExportFailed(f"{path} does not load with weights_only=True: {e}") from None
    return {}


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by dotted key path, JSON of each tensor-free subtree by dotted key path)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {"format": "pt"}

    def put(table: dict, key: str, value: Any) -> None:
        if key in tensors or key in meta:
            raise ExportFailed(f"two values flatten to the same safetensors key {key!r}")
        table[key] = value

    def walk(value: Any, key: str) -> None:
        if isinstance(value, torch.Tensor):
            put(tensors, key, value)
        elif not _holds_tensor(value):
            put(meta, key, json.dumps(_jsonable(value)))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:  # a list, tuple or set holding tensors
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}")

    if isinstance(state, dict):
        for k, v in state.items():
            walk(v, str(k))
    else:  # a state_dict() that is not a dict
        walk(state, "__state__")
    return tensors, meta


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_holds_tensor(v) for v in value)
    return False


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or type(value) in (str, int, float, bool):
        return value
    return str(value)


def write_safetensors(state: Any, path: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    tensors, meta = flatten(state)
    try:
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    except (ValueError, TypeError, RuntimeError) as e:  # OSError propagates as it is
        raise ExportFailed(f"{path}: safetensors refused the state: {e}") from None
    return {"metadata_values": len(meta) - 1}


WRITERS = {"torch": write_torch, "safetensors": write_safetensors}


def tensor_stats(value: Any) -> tuple[int, int]:
    """(number of tensors, their bytes) in `value`."""
    if isinstance(value, torch.Tensor):
        return 1, value.numel() * value.element_size()
    children: Any = ()
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, list | tuple | set | frozenset):
        children = value
    counts = [tensor_stats(v) for v in children]
    return sum(c for c, _ in counts), sum(b for _, b in counts)

"""What a snapshot's skeleton may hold, and finding what a state holds that it may not.

The skeleton is the pickled structure of a rank's state with its tensors taken out. Restoring
it must never run code a checkpoint chose, so it is unpickled with an allow-list of value
types: containers, numbers, strings, tensor references, numpy arrays, scalars and random
generators, datetimes, paths, UUIDs, decimals, fractions, and enum members of classes that
are already imported (a checkpoint never makes the restoring process import a module).
Everything else is refused, and refused when it is captured (`check`), with the path of the
offending value, instead of at the first restore.
"""

from __future__ import annotations

import collections
import enum
import io
import pickle
import sys
from typing import Any

# (module, name) -> what find_class may return
_VALUES = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("collections", "deque"),
    ("datetime", "date"),
    ("datetime", "datetime"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("decimal", "Decimal"),
    ("fractions", "Fraction"),
    ("uuid", "UUID"),
    # numpy arrays (not of dtype object: their items would need find_class too) and scalars
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "scalar"),
    # numpy random generators: rebuilt by bit-generator name from numpy's own table
    ("numpy.random._pickle", "__generator_ctor"),
    ("numpy.random._pickle", "__bit_generator_ctor"),
    ("numpy.random._pickle", "__randomstate_ctor"),
    ("numpy.random._pcg64", "PCG64"),
    ("numpy.random._pcg64", "PCG64DXSM"),
    ("numpy.random._mt19937", "MT19937"),
    ("numpy.random._philox", "Philox"),
    ("numpy.random._sfc64", "SFC64"),
    ("numpy.random.bit_generator", "SeedSequence"),
    ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"}


class RECHECK:
    """The kind of a value whose pickle depends on more than its type (a container of
    arbitrary items, a numpy object array, a random generator's bit generator): a skeleton
    holding one is checked at every capture."""


def leaf_kind(value: Any) -> type:
    """What the capture-time check caches its verdict by: the value's type, unless that
    does not decide what the value pickles to (RECHECK)."""
    kind = type(value)
    if kind in (set, frozenset, collections.deque):
        return RECHECK
    if kind.__module__.startswith("numpy"):
        dtype = getattr(value, "dtype", None)
        if (dtype is not None and dtype.hasobject) or kind.__module__.startswith("numpy.random"):
            return RECHECK
    return kind


class UnsafeState(TypeError):
    """A state holds a value a checkpoint cannot restore safely. `path` locates it."""

    def __init__(self, path: tuple[Any, ...], what: str):
        self.path = path
        self.what = what
        super().__init__(f"{format_path(path) or 'the state'}: {what}")


def format_path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path)


class SkeletonUnpickler(pickle.Unpickler):
    """Unpickles a skeleton, refusing every class or function outside the allow-list."""

    def __init__(self, data: bytes, tensor_ref: type):
        super().__init__(io.BytesIO(data))
        self._tensor_ref = tensor_ref

    def find_class(self, module: str, name: str) -> Any:
        # The tensor placeholder, under its name since 0.1 and its name before.
        if name == "TensorRef" and module in ("stalwart.ckpt.snapshot", "ckpt.snapshot"):
            return self._tensor_ref
        if (module, name) == ("stalwart.ckpt.dtensor", "ShardRef"):  # a DTensor's shard
            from stalwart.ckpt.dtensor import ShardRef

            return ShardRef
        if (module, name) in _VALUES or (
            module in ("pathlib", "pathlib._local") and name in _PATHS
        ):
            return super().find_class(module, name)
        # An enum member of a class the restoring process has already imported (its train
        # loop's module): no import happens on a checkpoint's say-so.
        cls = getattr(sys.modules.get(module), name, None) if "." not in name else None
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            return cls
        raise pickle.UnpicklingError(f"checkpoint skeleton refers to {module}.{name}, refused")


def check(skeleton: bytes, state: Any, tensor_ref: type) -> None:
    """Raise UnsafeState unless `skeleton` (pickled from `state`) unpickles under the
    allow-list; the error names the first value on the way that does not."""
    try:
        SkeletonUnpickler(skeleton, tensor_ref).load()
    except pickle.UnpicklingError as e:
        raise _first_unsafe(state, (), tensor_ref) or UnsafeState((), str(e)) from None


def dumps(skeleton: Any, state: Any) -> bytes:
    """Pickle `skeleton` (the tensor-free structure of `state`); a value pickle cannot take
    at all (a lambda, a lock, an open file) raises UnsafeState with its path."""
    try:
        return pickle.dumps(skeleton, protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise _first_unsafe(state, (), None) or UnsafeState((), str(e)) from None


def _first_unsafe(obj: Any, path: tuple[Any, ...], tensor_ref: type | None) -> UnsafeState | None:
    """The first value under `obj` that pickle cannot take or, with `tensor_ref`, that the
    allow-list refuses; None if there is none."""
    import torch

    if isinstance(obj, dict):
        items: list[tuple[Any, Any]] | None = list(obj.items())
    elif isinstance(obj, list | tuple):
        items = list(enumerate(obj))
    else:
        items = None
    if items is not None:
        for k, v in items:
            found = _first_unsafe(v, (*path, k), tensor_ref)
            if found is not None:
                return found
        return None
    if isinstance(obj, torch.Tensor):
        return None
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    try:
        data = pickle.dumps(obj, protocol=5)
    except Exception as e:
        return UnsafeState(path, f"a {kind}, which cannot be pickled ({e})")
    if tensor_ref is None:
        return None
    try:
        SkeletonUnpickler(data, tensor_ref).load()
    except pickle.UnpicklingError as e:
        return UnsafeState(path, f"a {kind}, which a checkpoint does not restore ({e})")
    return None

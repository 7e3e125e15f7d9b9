"""Two restored rank states, compared object by object (`stalwart verify`).

A state is what a snapshot restores: {"step", "objects": {name: state_dict}, "rng", ...}.
For each registered object: identical or not, and where not, the first tensor (in a fixed
order of key paths) whose bits differ, with its largest difference; a non-tensor value
that differs is named too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ObjectDiff:
    name: str
    identical: bool
    path: str | None = None  # the first differing key path, e.g. "state/0/exp_avg"
    detail: str | None = None  # what differs there


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out = []
        for key in sorted(obj, key=repr):
            out += _leaves(obj[key], f"{path}/{key}" if path else str(key))
        return out
    if isinstance(obj, list | tuple):
        out = []
        for i, item in enumerate(obj):
            out += _leaves(item, f"{path}[{i}]")
        return out
    return [(path, obj)]


def _tensor_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    bits_a = a.contiguous().reshape(-1).view(torch.uint8)
    bits_b = b.contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(bits_a, bits_b):
        return None
    if a.is_floating_point():
        diff = (a.double() - b.double()).abs()
        n = int((a != b).sum())
        return f"{n} of {a.numel()} elements differ, by up to {float(diff.max()):.3g}"
    return f"{int((a != b).sum())} of {a.numel()} elements differ"


def compare_objects(a: dict[str, Any], b: dict[str, Any]) -> list[ObjectDiff]:
    """Every object of `a["objects"]` and `b["objects"]`, in name order."""
    objs_a, objs_b = a.get("objects", {}), b.get("objects", {})
    out = []
    for name in sorted(set(objs_a) | set(objs_b)):
        if name not in objs_a or name not in objs_b:
            where = "the first" if name not in objs_a else "the second"
            out.append(ObjectDiff(name, False, None, f"not registered in {where} run"))
            continue
        out.append(_compare_one(name, objs_a[name], objs_b[name]))
    return out


def _compare_one(name: str, a: Any, b: Any) -> ObjectDiff:
    left, right = dict(_leaves(a)), dict(_leaves(b))
    for path in sorted(set(left) | set(right)):
        if path not in left or path not in right:
            return ObjectDiff(name, False, path, "present in one run only")
        x, y = left[path], right[path]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            why = _tensor_diff(x, y)
            if why is not None:
                return ObjectDiff(name, False, path, why)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return ObjectDiff(name, False, path, "a tensor in one run only")
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = (
                isinstance(x, np.ndarray)
                and isinstance(y, np.ndarray)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and x.tobytes() == y.tobytes()
            )
            if not same:
                return ObjectDiff(name, False, path, "numpy arrays differ")
        elif x != y and not (x != x and y != y):  # NaN equals NaN here
            return ObjectDiff(name, False, path, f"{x!r} vs {y!r}")
    return ObjectDiff(name, True)

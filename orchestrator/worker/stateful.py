"""What ``ctx.register`` accepts: objects with state_dict()/load_state_dict(), and random
generators, which have none (``torch.Generator``, ``numpy.random.Generator``/``RandomState``,
``random.Random``), through adapters that give them one; so does a PowerSGD comm hook's
``PowerSGDState``, whose error feedback, warm-start matrices, iteration and random generator
change every step (docs/exactness.md).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState


class _TorchGenerator:
    def __init__(self, g: torch.Generator):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g.set_state(state["state"])


class _NumpyGenerator:
    def __init__(self, g: np.random.Generator | np.random.RandomState):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.g, np.random.RandomState):
            return {"legacy": self.g.get_state(legacy=False)}
        return {"bit_generator": self.g.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "legacy" in state:
            self.g.set_state(state["legacy"])
        else:
            self.g.bit_generator.state = state["bit_generator"]


class _PythonRandom:
    def __init__(self, g: random.Random):
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.g.getstate()
        return {"version": version, "internal": list(internal), "gauss": gauss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g.setstate((state["version"], tuple(state["internal"]), state["gauss"]))


class _PowerSGD:
    """What a PowerSGDState changes as the hook runs; its settings (rank, start iteration,
    ...) are the loop's, set again when it builds the state. Keyed by stalwart's bucket
    index, which is the same in every generation (worker/buckets.py)."""

    _COUNTERS = (
        "iter",
        "next_stats_report",
        "total_numel_before_compression",
        "total_numel_after_compression",
    )
    _TENSORS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, state: PowerSGDState):
        self.hook_state = state  # the name worker/exactness.py looks through

    def state_dict(self) -> dict[str, Any]:
        s = self.hook_state
        return {
            **{k: getattr(s, k) for k in self._COUNTERS},
            # String keys: checkpoint formats key values by their path (DCP's FQNs).
            **{k: {str(i): t for i, t in getattr(s, k).items()} for k in self._TENSORS},
            "rng": s.rng.get_state(legacy=False),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.hook_state
        for k in self._COUNTERS:
            setattr(s, k, state[k])
        for k in self._TENSORS:
            setattr(s, k, {int(i): t for i, t in state[k].items()})
        s.rng.set_state(state["rng"])


def stateful(name: str, obj: Any) -> Any:
    """`obj`, or an adapter giving a random generator or a PowerSGDState
    state_dict/load_state_dict."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, np.random.Generator | np.random.RandomState):
        return _NumpyGenerator(obj)
    if isinstance(obj, random.Random):
        return _PythonRandom(obj)
    if isinstance(obj, PowerSGDState):
        return _PowerSGD(obj)
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise TypeError(
            f"ctx.register({name}=...): needs state_dict() and load_state_dict() (or a "
            f"torch, numpy or python random generator), got {type(obj).__name__}"
        )
    return obj

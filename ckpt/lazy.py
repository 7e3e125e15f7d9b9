"""A module imported on its first use: the supervisor and the node agents import the
checkpoint modules for their data types and byte handling, and start without torch (2 s of
CPU each, on the nodes where a job's workers import it at the same moment)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    """Stands for module `name`; the first attribute read imports it, and each attribute
    read is kept, so the next read of it is a plain one."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__name__), attr)
        setattr(self, attr, value)
        return value


def is_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor, without importing torch: a process that has not
    imported it holds none (the node agents check payloads that are numpy arrays). Nor
    does one whose import of torch, on another thread, has not defined the class yet
    (sys.modules holds a module from the start of its import)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(obj, tensor)

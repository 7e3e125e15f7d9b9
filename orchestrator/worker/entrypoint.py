"""Resolve a job's entrypoint ('package.module:function' or 'path/to/file.py:function')."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EntrypointError(ValueError):
    pass


def load_entrypoint(entrypoint: str, base_dir: str | None = None) -> Callable[[Any], Any]:
    target, _, func = entrypoint.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise EntrypointError(f"entrypoint {entrypoint!r}: file {path} does not exist")
            name = f"stalwart_entry_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            # Modules next to the job spec are importable, as they are for `python -m`.
            if base_dir is not None and base_dir not in sys.path:
                sys.path.insert(0, base_dir)
            module = importlib.import_module(target)
    except EntrypointError:
        raise
    except Exception as e:
        missing = (
            isinstance(e, ModuleNotFoundError)
            and e.name
            and (target == e.name or target.startswith(e.name + "."))
        )
        # The module itself is absent: the traceback is importlib's, not the user's.
        tb = "" if missing else "\n" + traceback.format_exc(limit=-5).rstrip()
        raise EntrypointError(
            f"entrypoint {entrypoint!r}: cannot import {target}: {type(e).__name__}: {e}{tb}"
        ) from None
    fn = getattr(module, func, None)
    if fn is None:
        raise EntrypointError(f"entrypoint {entrypoint!r}: {target} has no attribute {func!r}")
    if not callable(fn):
        raise EntrypointError(
            f"entrypoint {entrypoint!r}: {func} is a {type(fn).__name__}, not callable"
        )
    return fn

"""The jobs `stalwart run` drives from this machine, so that `stalwart status NAME` (no
--address) attaches to the cluster that job runs on and to no other: one small JSON file per
running job in $XDG_CACHE_HOME/stalwart/jobs/ (else ~/.cache/stalwart/jobs/), written when the
driver has connected and removed when it ends. A file whose driver is gone (SIGKILL) is
ignored and removed by the next lookup."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any


def _folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stalwart" / "jobs"


def _path(name: str) -> Path:
    return _folder() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"


def record(name: str, address: str, run_dir: str) -> None:
    """Note that this process drives job `name` on the Ray at `address` (best effort: a
    read-only home only loses `status NAME` without --address)."""
    path = _path(name)
    entry = {"name": name, "address": address, "run_dir": run_dir, "pid": os.getpid()}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(path)


def forget(name: str) -> None:
    path = _path(name)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def lookup(name: str) -> dict[str, Any] | None:
    """The running job `name` driven from this machine: {address, run_dir, pid}, or None."""
    path = _path(name)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not _alive(entry.get("pid")):
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return entry


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

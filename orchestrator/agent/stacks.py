"""A process's Python stacks read from the outside (py-spy), for a worker that cannot answer
itself: its interpreter is stuck in C code holding the GIL (the node agent's `dump_stacks`,
for the hang detector's stacks of every rank)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def py_spy_dump(pid: int, timeout_s: float) -> dict[str, Any]:
    try:
        out = subprocess.run(
            [_py_spy(), "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        text = out.stdout if out.returncode == 0 else f"py-spy failed: {out.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"py-spy failed: {e}"
    return {"pid": pid, "via": "py-spy", "text": text}


def _py_spy() -> str:
    """py-spy from this interpreter's environment (Ray installs it), else from PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else "py-spy"

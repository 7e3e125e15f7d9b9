"""Chaos actions a worker carries out on itself or its node when a fault's step comes.

The job spec's ``chaos.faults`` name a rank and a step; the worker holding that rank calls
``carry_out`` from its training thread. Process-level faults (kill_worker, hang) act on the
worker; node-level faults (kill_node, kill_raylet, gpu_xid) act on the node hosting it. A
kill_node kills the raylet and everything under it only on a cluster the command itself
started (scope "raylet"); elsewhere it kills the job's own processes on that node (scope
"job"). A kill_raylet kills the raylet alone, and only on a cluster the command started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.orchestrator.worker import zygote


def _parent(pid: int) -> int | None:
    """`pid`'s parent, from /proc (None if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return int(text[text.rindex(")") + 2 :].split()[1])


def _children(pid: int) -> list[int]:
    return [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if _parent(int(stat.parent.name)) == pid
    ]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children before their parents' siblings."""
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def raylet_of_this_worker() -> int:
    """The raylet that started this worker process: its parent, or for a worker forked
    from the node's zygote (worker/zygote.py) the raylet Ray names in its environment."""
    forked = os.environ.get("RAY_RAYLET_PID", "")
    ppid = os.getppid()
    if forked.isdigit() and int(forked) != ppid and zygote.serves(ppid) is not None:
        ppid = int(forked)
    cmdline = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")[0]
    if not cmdline.endswith(b"raylet"):
        raise RuntimeError(
            f"killing the node's raylet: this worker's parent (pid {ppid}, "
            f"{cmdline.decode(errors='replace')}) "
            "is not a raylet; refusing to guess which processes make up the node"
        )
    return ppid


def kill_node() -> None:
    """Kill every Ray process of this node: the raylet, all its workers and the zygotes that
    fork them with theirs (this process last)."""
    raylet = raylet_of_this_worker()
    me = os.getpid()
    doomed = [*reversed(descendants(raylet)), raylet]
    for forks in zygote.zygotes_of(raylet):
        doomed[:0] = [*reversed(descendants(forks)), forks]
    for pid in doomed:
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def kill_raylet() -> None:
    """Kill this node's raylet alone; this rank then stops where it is (as a process whose
    raylet is gone makes no progress) until Ray takes it down with its raylet. Never
    returns."""
    os.kill(raylet_of_this_worker(), signal.SIGKILL)
    hang_forever()


def kill_if_sibling(pid: int) -> bool:
    """SIGKILL `pid` if it is a Ray worker ("ray::...") of this process's raylet: its child,
    or a child of a zygote serving it (worker/zygote.py). A pid a dead rank left behind,
    reused by another process since, is left alone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    raylet = os.getppid()
    parent = _parent(pid)
    ours = parent == raylet or (parent is not None and zygote.serves(parent) == raylet)
    if not ours or not cmdline.startswith(b"ray::"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        return True
    return False


FILL_SHM_MAX_BYTES = 4 << 30  # fill_shm refuses a larger file system: it would be RAM


def fill_file_system(directory: str, seconds: float) -> int:
    """Chaos fill_shm: allocate every free byte of `directory`'s file system in one file,
    removed after `seconds`. Returns the bytes taken. Refuses a file system larger than
    FILL_SHM_MAX_BYTES (a machine-sized /dev/shm is the machine's memory)."""
    st = os.statvfs(directory)
    total = st.f_blocks * st.f_frsize
    if total > FILL_SHM_MAX_BYTES:
        raise RuntimeError(
            f"fill_shm: {directory} is a {total >> 20} MiB file system, larger than "
            f"{FILL_SHM_MAX_BYTES >> 20} MiB: filling it would take the machine's memory "
            "(give the job a small checkpoint.shm_dir, e.g. a scenario's cluster.shm_bytes)"
        )
    path = os.path.join(directory, f".stalwart-fill-{os.getpid()}")
    taken = 0
    with open(path, "wb") as f:
        chunk = st.f_bavail * st.f_frsize
        while chunk >= 4096:
            try:
                os.posix_fallocate(f.fileno(), taken, chunk)
                taken += chunk
            except OSError:
                chunk //= 2
    timer = threading.Timer(seconds, _unlink, (path,))
    timer.daemon = True
    timer.start()
    return taken


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def hang_forever() -> None:
    """Block the calling thread as a deadlock would: no exception, no return."""
    while True:
        time.sleep(3600)


def carry_out(
    fault: dict[str, Any],
    *,
    slow_down: Callable[[float], None],
    inject_gpu_fault: Callable[[int], None],
    drop_replicas: Callable[[], None] | None = None,
    storage_outage: Callable[[float], None] | None = None,
    kill_supervisor: Callable[[], None] | None = None,
    kill_job_on_node: Callable[[], None] | None = None,
    corrupt_shards: Callable[[], None] | None = None,
    fill_shm: Callable[[float], None] | None = None,
    poison_model: Callable[[], None] | None = None,
) -> None:
    kind = fault["kind"]
    if kind == "kill_worker":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "kill_node" and fault.get("scope") == "raylet":
        kill_node()
    elif kind == "kill_raylet":
        kill_raylet()
    elif kind == "kill_node" and kill_job_on_node is not None:
        # Not our cluster: the job's processes on this node, never its raylet.
        kill_job_on_node()
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        hang_forever()
    elif kind == "slow":
        slow_down(fault["factor"])
    elif kind == "gpu_xid":
        inject_gpu_fault(fault["xid"])
    elif kind == "drop_replicas" and drop_replicas is not None:
        drop_replicas()
    elif kind == "storage_unavailable" and storage_outage is not None:
        storage_outage(fault["seconds"])
    elif kind == "kill_supervisor" and kill_supervisor is not None:
        kill_supervisor()
    elif kind == "corrupt_shard" and corrupt_shards is not None:
        corrupt_shards()
    elif kind == "fill_shm" and fill_shm is not None:
        fill_shm(fault["seconds"])
    elif kind == "nan_loss" and poison_model is not None:
        poison_model()
    else:
        raise ValueError(f"unknown chaos fault kind {kind!r}")

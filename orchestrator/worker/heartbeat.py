"""What a rank's heartbeat says (left for its node agent, which relays it to the supervisor
with the node's report): its step, recent step times, what it waits on (a collective, its
checkpoint copies), memory, GPU and the timings of its generation's phases. It goes into
the rank's snapshot ring as JSON (`encode`, ckpt/ring.py's heartbeat area) while the rank
has one open, else by a call to the agent."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from stalwart.orchestrator.worker.context import Progress
from stalwart.orchestrator.worker.copy_wait import CopyWait


def beat(
    rank: int,
    generation: int,
    progress: Progress | None,
    collective_since: float | None,
    copy_wait: CopyWait | None,
    gpu_index: int | None,
    timings: dict[str, float],
    snapshot_stats: dict[str, Any],
    train_thread: int | None = None,
) -> dict[str, Any]:
    """`train_thread`: the native id of the thread running the train loop, whose CPU time
    tells a busy long step from a hang (health/hang_timeout.py)."""
    p = progress
    return {
        "rank": rank,
        "generation": generation,
        "pid": os.getpid(),
        "step": p.step if p else 0,
        "metrics": dict(p.metrics) if p else {},
        "samples": p.processed_samples if p else 0.0,
        "tokens": p.processed_tokens if p else 0.0,
        "compute_seconds": p.compute_seconds if p else 0.0,
        "collective_seconds": p.collective_seconds if p else 0.0,
        "recent": list(p.recent) if p else [],
        "collective_since": collective_since,
        # checkpoint.max_lag_steps: waiting for its copies since (wall clock), and in all
        "copies_since": copy_wait.since if copy_wait else None,
        "copy_wait_seconds": copy_wait.seconds if copy_wait else 0.0,
        "rss_bytes": _rss_bytes(),
        "train_cpu_s": thread_cpu_seconds(train_thread) if train_thread else None,
        "gpu_index": gpu_index,
        "sent_at": time.time(),
        "timings": {**timings, **_phases(p)},
        "snapshot": snapshot_stats,
    }


def encode(beat: dict[str, Any]) -> bytes | None:
    """The beat as the ring carries it (None: not JSON, which a call still carries)."""
    try:
        return json.dumps(beat, separators=(",", ":")).encode()
    except (TypeError, ValueError):
        return None


def _phases(p: Progress | None) -> dict[str, float]:
    if p is None:
        return {}
    out: dict[str, float] = {}
    if p.restored_at:
        for k, v in (
            ("setup_done", p.setup_done_at),
            ("fetched", p.fetched_at),
            ("restored", p.restored_at),
        ):
            if v is not None:
                out[k] = v
    if p.first_step_done_at:
        out["first_step_done"] = p.first_step_done_at
    return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def thread_cpu_seconds(native_id: int) -> float | None:
    """CPU seconds (user and system) the thread `native_id` of this process has used; None
    if it is gone or this is not Linux."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command's ")": state is field 3 of proc(5); utime 14, stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

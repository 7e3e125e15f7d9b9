"""What a job's progress looks like from its supervisor (a view: it keeps no state)."""

from __future__ import annotations

import time
from typing import Any


def progress_of(sup: Any) -> dict[str, Any]:
    """The job's progress now, of the supervisor `sup` (its actor): what `stalwart status`,
    the driver's display and the throughput events show."""
    beats = sup.detect.current_beats(sup.gen.number)
    # A finished rank stops beating; its outcome holds its last step.
    steps = [b["step"] for b in beats] + sup.gen.steps()
    losses = [b["metrics"]["loss"] for b in beats if "loss" in b.get("metrics", {})]
    with sup._lock:
        cordoned = len(sup.pool.bad.cordons.active(time.time()))
        scores = sorted(sup.detect.monitor.last_scores.items(), key=lambda kv: kv[1], reverse=True)
    return {
        "state": sup.sm.state.value,
        "generation": sup.gen.number,
        "step": max(steps) if steps else 0,
        "total_steps": sup.spec.steps,
        "committed_step": sup.ckpt.commit.committed,
        "memory_bytes": sum(sup.ckpt.held_bytes.values()),
        "loss": sum(losses) / len(losses) if losses else None,
        "samples": sum(b.get("samples", 0.0) for b in beats),
        "failures": len(sup.ledger.failures),
        "restarts": sup.recovery.restarts,
        "goodput": sup.metrics.goodput,
        "steps_per_s": sup.ledger.last_rate,
        "workers": len(sup.pool.workers),
        "spares": len(sup.pool.spares),
        "standbys": sup.pool.standbys.count(),
        "hang_timeout_s": sup.detect.monitor.hang_timeouts().step_s,
        "cordoned": cordoned,
        "slowest": scores[:3],
        "now": time.time(),
    }

"""The worker actor's class as the supervisor creates it: the supervisor's process must not
import torch to start workers (2 s of CPU on its node, before it asks for the first one).

`WorkerActor` builds the real TrainWorker (orchestrator/worker/actor.py) in the worker's own
process and forwards the control API to it, method by method (Ray's actor handles know the
methods a class had when it was made remote, so each is defined here by name).
"""

from __future__ import annotations

import gc
from typing import Any

# TrainWorker's control API: what the supervisor, the pool and the chaos tools call.
METHODS = (
    "ready",
    "attach",
    "assume",
    "run",
    "abort",
    "status",
    "add_fault",
    "shutdown",
    "preflight_matmul",
    "preflight_allreduce",
    "quiesce",
    "stacks",
)


def import_train_worker() -> type:
    """TrainWorker's class, its imports (torch's, ~3 s of CPU, and torch._dynamo's, ~2 s)
    made with the garbage collector paused: the ~540,000 objects they build would otherwise
    be traversed again and again by collections as they grow (a fifth of the imports' CPU,
    in a replacement's start as in the job's). torch._dynamo is imported here because every
    torch.optim optimizer imports it when built: no loop skips it. Then one collection
    (what the imports left in cycles), and what is left is frozen (gc.freeze): out of every
    later collection of the train loop. Measured: a 4-rank job's first step ~3 s sooner on
    2 cores (docs/benchmarks.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401

        from stalwart.orchestrator.worker.actor import TrainWorker
    finally:
        if enabled:
            # Once, for what the imports left behind in cycles (~200,000 objects of
            # ~540,000): frozen, they would be kept for good.
            gc.collect()
        gc.freeze()  # before the collector is back: the objects it counted start none
        if enabled:
            gc.enable()
    return TrainWorker


class WorkerActor:
    def __init__(self, **kwargs: Any) -> None:
        self._worker = import_train_worker()(**kwargs)


def _forward(name: str):
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in METHODS:
    setattr(WorkerActor, _name, _forward(_name))

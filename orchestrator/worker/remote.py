"""The worker actor's class as the supervisor creates it: the supervisor's process must not
import torch to start workers (2 s of CPU on its node, before it asks for the first one).

`WorkerActor` builds the real TrainWorker (orchestrator/worker/actor.py) in the worker's own
process and forwards the control API to it, method by method (Ray's actor handles know the
methods a class had when it was made remote, so each is defined here by name).
"""

from __future__ import annotations

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


class WorkerActor:
    def __init__(self, **kwargs: Any) -> None:
        from stalwart.orchestrator.worker.actor import TrainWorker

        self._worker = TrainWorker(**kwargs)


def _forward(name: str):
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in METHODS:
    setattr(WorkerActor, _name, _forward(_name))

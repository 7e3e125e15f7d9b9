"""Check a job's resource request against the cluster before asking Ray to place it.

Ray would otherwise wait forever for a placement group that can never be satisfied.
"""

from __future__ import annotations

from typing import Any

from stalwart.orchestrator.spec import JobSpec


class SchedulingError(RuntimeError):
    pass


def worker_bundle(spec: JobSpec) -> dict[str, float]:
    bundle = {"CPU": spec.resources.cpu, "GPU": spec.resources.gpu, **spec.resources.custom}
    return {k: v for k, v in bundle.items() if v}


_FIELD = {"CPU": "resources.cpu", "GPU": "resources.gpu"}


def check_capacity(spec: JobSpec, nodes: list[dict[str, Any]]) -> None:
    alive = [n for n in nodes if n.get("Alive")]
    bundle = worker_bundle(spec)
    for key, per_worker in bundle.items():
        field = _FIELD.get(key, f"resources.custom.{key}")
        total = sum(n["Resources"].get(key, 0.0) for n in alive)
        need = per_worker * spec.max_workers
        if need > total:
            raise SchedulingError(
                f"{field}: the job needs {need:g} {key} ({spec.max_workers} workers x "
                f"{per_worker:g}), the cluster has {total:g}"
            )
        largest = max((n["Resources"].get(key, 0.0) for n in alive), default=0.0)
        if per_worker > largest:
            raise SchedulingError(
                f"{field}: one worker needs {per_worker:g} {key}, the largest node has {largest:g}"
            )

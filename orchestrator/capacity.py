"""Whether this machine (an embedded Ray) or a Ray cluster can hold a job, asked before
anything starts (`stalwart validate`, `stalwart run`, `stalwart verify`).

An embedded Ray is given as many logical CPUs as the job asks (driver.connect), so Ray
itself would start `workers: 400` on a laptop: 400 processes that each import torch. This
module refuses a job that needs more processes than a multiple of the machine's cores or
more memory than it has, and the GPUs or custom resources an embedded Ray does not have.
Against a cluster it asks what the supervisor checks before placing the workers
(supervisor/resources.py: the cluster's alive nodes now; an autoscaler may add more).
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.ckpt.footprint import NodeNeed, free_bytes, judge
from stalwart.orchestrator.spec import JobSpec

PROCESSES_PER_CORE = 8  # an embedded Ray's ranks and spares, at most, per core of this machine
PROCESS_MB = 300  # the least one rank's process takes: Python, torch, Ray's core worker


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def this_machine(
    spec: JobSpec,
    num_cpus: int | None = None,
    cores: int | None = None,
    memory: int | None = None,
    gpus: int | None = None,
) -> list[str]:
    """What keeps `spec` from running on an embedded Ray here, one line each (none: it
    fits). `num_cpus` is `--num-cpus`; the others default to this machine's."""
    cores = cores or os.cpu_count() or 1
    memory = memory if memory is not None else _memory_bytes()
    spares = spec.failure.spares
    processes = spec.max_workers + spares
    them = f"{spec.max_workers} workers" + (
        f" + {spares} spare{'s' if spares > 1 else ''}" if spares else ""
    )
    cluster = "run it on a cluster (--address)"
    problems = []
    limit = PROCESSES_PER_CORE * cores
    if processes > limit:
        problems.append(
            f"workers: {them} are {processes} processes, more than this machine's {cores} "
            f"CPU cores hold ({PROCESSES_PER_CORE} per core: {limit}); {cluster}"
        )
    need_mb = processes * PROCESS_MB
    if memory and need_mb * 2**20 > memory:
        problems.append(
            f"workers: {them} need at least {need_mb / 1024:.1f} GiB of memory "
            f"({PROCESS_MB} MB per process), this machine has {memory / 2**30:.1f} GiB; "
            f"{cluster}"
        )
    state = spec.checkpoint.state_size_per_rank
    if state is not None:
        # Every rank and every copy on this one machine (ckpt/footprint.py).
        need = NodeNeed(
            spec.max_workers, int(state), spec.checkpoint.replicas, spec.checkpoint.versions
        )
        why = judge(need, memory, free_bytes(spec.checkpoint.shm_dir))
        if why:
            problems.append(f"the in-memory checkpoints do not fit this machine: {why}; {cluster}")
    r = spec.resources
    if num_cpus is not None and spec.max_workers * r.cpu > num_cpus:
        problems.append(
            f"resources.cpu: the job needs {spec.max_workers * r.cpu:g} CPU "
            f"({spec.max_workers} workers x {r.cpu:g}), --num-cpus gives the embedded Ray "
            f"{num_cpus}"
        )
    if r.gpu:
        have = _local_gpus() if gpus is None else gpus
        need = spec.max_workers * r.gpu
        if need > have:
            problems.append(
                f"resources.gpu: the job needs {need:g} GPU ({spec.max_workers} workers x "
                f"{r.gpu:g}), this machine has {have}; {cluster}"
            )
    for key, amount in r.custom.items():
        if amount:
            problems.append(
                f"resources.custom.{key}: an embedded Ray has no custom resources; run it on "
                f"a cluster whose nodes declare {key} (--address)"
            )
    return problems


def cluster(spec: JobSpec, nodes: list[dict[str, Any]]) -> list[str]:
    """What keeps `spec` from being placed on a cluster whose nodes (`ray.nodes()`) are
    these, as the supervisor would find before placing it (none: it fits)."""
    from stalwart.orchestrator.supervisor.resources import SchedulingError, check_capacity

    try:
        check_capacity(spec, nodes)
    except SchedulingError as e:
        return [str(e)]
    return []

"""Preflight checks, run by the workers before a node trains (judged in health/preflight.py).

Each worker times a square matmul on its device, and pairs of workers time a small
all-reduce between them (in the spirit of MegaScale's and DLRover's node checks). It costs
well under a second per node: a node that fails or is far slower than its peers is cordoned
before it can slow the job down.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stalwart.orchestrator.worker.collective import _wrap_backend

ALLREDUCE_ELEMENTS = 256 * 1024  # 1 MiB of float32
ALLREDUCE_REPEATS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


TRIALS = 3


def time_matmul(device: torch.device, size: int, repeats: int, slow_factor: float = 1.0) -> float:
    """Seconds for `repeats` size x size matmuls on `device`: the best of three trials'
    median single matmul, times `repeats`. A slow node is slow in every trial; a healthy
    one on a busy shared machine is fast in at least one.
    On a CPU the seconds are the thread's own CPU time, not the wall clock's: a core's speed,
    which a machine's load does not change (on two cores shared by several Ray nodes'
    processes, a node whose workers were importing torch beside its matmul read 3x slower by
    the wall clock and was cordoned). A GPU's is the wall clock, synchronised.
    `slow_factor` > 1 is the chaos `slow` fault at step 0: this node computes that much slower.
    """
    if device.type == "cpu":
        # One thread: a node's per-core speed in the calling thread, whose CPU time is the
        # measure, without the thread pool's barriers.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _time_matmul(device, size, repeats, slow_factor, time.thread_time)
        finally:
            torch.set_num_threads(threads)
    return _time_matmul(device, size, repeats, slow_factor, time.perf_counter)


def _time_matmul(
    device: torch.device,
    size: int,
    repeats: int,
    slow_factor: float,
    clock: Callable[[], float],
) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device)
    b = torch.randn(size, size, generator=gen).to(device)
    for _ in range(3):
        (a @ b).sum().item()
    _sync(device)
    trials = []
    for _ in range(TRIALS):
        times = []
        for _ in range(repeats):
            t0 = clock()
            c = a @ b
            _sync(device)
            if slow_factor > 1:
                _slow_down(clock, (slow_factor - 1) * (clock() - t0))
            times.append(clock() - t0)
        trials.append(statistics.median(times))
    del c
    return min(trials) * repeats


def _slow_down(clock: Callable[[], float], seconds: float) -> None:
    """The chaos fault's extra time, on `clock`: a thread's CPU time passes only while it
    computes, so on a CPU the slow node computes (spins) for it; the wall clock sleeps."""
    if clock is time.perf_counter:
        time.sleep(seconds)
        return
    until = clock() + seconds
    while clock() < until:
        pass


def time_pair_allreduce(
    rendezvous: dict[str, Any],
    key: str,
    pair_rank: int,
    backend: str,
    device: torch.device,
    hostname: str,
    timeout_s: float,
) -> tuple[float, Any]:
    """Form a 2-rank group under `key` in the rendezvous store and time a few all-reduces.
    Returns the seconds and the group (keep it referenced until both sides are done)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(rendezvous["host"], rendezvous["port"], None, False, timeout=timeout)
    prefix = dist.PrefixStore(f"preflight/{key}", store)
    pg, be, _ = _wrap_backend(prefix, pair_rank, 2, backend, timeout, device, hostname)
    t = torch.ones(ALLREDUCE_ELEMENTS, device=device)
    pg.allreduce([t]).wait()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(ALLREDUCE_REPEATS):
        pg.allreduce([t]).wait()
    _sync(device)
    return time.perf_counter() - t0, (pg, be, store)

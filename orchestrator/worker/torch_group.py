"""torch.distributed's default group, as user code sees it: every collective abortable.

A train loop calls ``torch.distributed.all_reduce``, ``barrier``, ``broadcast``,
``all_gather(_into_tensor)``, ``reduce_scatter(_tensor)``, and a DistributedDataParallel it
builds itself reduces its buckets through the default group's ``allreduce``. None of these
goes through stalwart's own calls, and gloo's ``abort()`` does not release a rank blocked in
one (orchestrator/worker/collective.py). So the default group is a Python ProcessGroup
(torch's pybind trampoline lets a Python subclass override its collectives, C++ callers
like DDP's reducer included) that hands each call to the generation's real gloo/NCCL group
and returns a Work whose future stalwart owns: the recovery's abort fails it at once, and
the blocked rank unwinds as it does from ``ctx.all_reduce``.

Subgroups (``dist.new_group``, and every DeviceMesh a loop builds with
``init_device_mesh``) are made the same way: torch hands ``new_group`` to a default group
that implements it, and ours returns another AbortableProcessGroup on a gloo/NCCL group of
the generation's store, so a rank blocked in a subgroup's collective (an FSDP2
reduce-scatter on the shard dimension, an HSDP all-reduce on the replicate one) is
released by the same abort.

A Work that has no future (gloo's reduce_scatter, for one) is waited for by the group's
completion thread, in issue order (a group's collectives complete in that order). That
thread may stay blocked on a dead peer's socket after an abort; like the old group itself,
it is left to die with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# The ProcessGroup methods torch.distributed's functions and DDP call (torch 2.13 names,
# and the older ones where they still exist). monitored_barrier is synchronous (no Work):
# it goes to the generation's group as it is, not abortable.
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "_allgather_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "_reduce_scatter_base",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
)


class _OwnedWork(dist._Work):
    """The Work a collective returns: done when stalwart's future is (or fails with it).
    `waited(seconds)` hears how long each wait() blocked its caller."""

    def __init__(self, future: torch.futures.Future, waited: Callable[[float], None]):
        super().__init__()
        self._future = future
        self._waited = waited

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.monotonic()
        try:
            self._future.wait()  # raises GroupAborted when a recovery aborted the collective
        finally:
            self._waited(time.monotonic() - t0)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and not self._failed()

    def _failed(self) -> bool:
        try:
            self._future.value()
        except Exception:
            return True
        return False

    def exception(self) -> Any:
        return None

    def result(self) -> list[torch.Tensor]:
        value = self._future.value()
        return value if isinstance(value, list) else []


class AbortableProcessGroup(dist.ProcessGroup):
    """`inner` (one generation's gloo or NCCL group) with every collective's completion
    routed through `track`, which returns the future stalwart owns and can fail; `ready`
    raises (GroupAborted) when the generation is aborted or over, before anything is sent."""

    def __init__(
        self,
        inner: dist.ProcessGroup,
        backends: list[tuple[torch.device, Any, Any]],
        backend_name: str,
        ready: Callable[[], object],
        track: Callable[[torch.futures.Future], torch.futures.Future],
        new_future: Callable[[], torch.futures.Future] = torch.futures.Future,
        subgroup: Callable[..., dist.ProcessGroup | None] | None = None,
        observe: Callable[[str, bool], None] | None = None,
        waited: Callable[[float], None] = lambda seconds: None,
    ):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self._backend_name = backend_name
        self._ready = ready
        self._track = track
        self._new_future = new_future
        self._waits: queue.Queue | None = None
        self._lock = threading.Lock()
        self._subgroup = subgroup
        self._observe = observe  # (method, issued?): before and after each collective
        self._waited = waited  # seconds a caller blocked in a Work's wait()
        # The real backends, registered here too: torch asks a group for its backend by
        # device (DDP's logger, ProcessGroup.abort, NCCL's stream handling).
        for device, kind, be in backends:
            self._register_backend(device, kind, be)
        self._set_default_backend(backends[0][1])

    def new_group(
        self,
        ranks: list[int],
        timeout: Any = None,
        pg_options: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
    ) -> dist.ProcessGroup | None:
        """torch.distributed.new_group on this (the default) group: torch hands subgroup
        creation to a default group that has this method, so every DeviceMesh dimension's
        group and every ``dist.new_group`` is one of ours, abortable and tied to the
        generation (ElasticGroup.subgroup). None where this rank is not a member."""
        if self._subgroup is None:
            raise RuntimeError("this process group makes no subgroups (only the default one)")
        return self._subgroup(ranks, timeout, group_name, group_desc)

    def getBackendName(self) -> str:  # torch's name for it
        return self._backend_name

    def name(self) -> str:
        return self._backend_name

    def _owned(self, work: dist.Work) -> dist.Work:
        try:
            done = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            done = self._wait_in_thread(work)
        return _OwnedWork(self._track(done), self._waited)

    def _wait_in_thread(self, work: dist.Work) -> torch.futures.Future:
        fut = self._new_future()
        with self._lock:
            if self._waits is None:
                self._waits = queue.Queue()
                threading.Thread(
                    target=_complete, args=(self._waits,), name="stalwart-collective", daemon=True
                ).start()
        self._waits.put((work, fut))
        return fut


# The kinds a chaos fault may fire in (spec: in_collective), by the methods that do them.
KINDS = {
    "all_gather": (
        "allgather",
        "allgather_coalesced",
        "allgather_into_tensor_coalesced",
        "all_gather_single",
        "all_gather_single_coalesced",
        "_allgather_base",
    ),
    "reduce_scatter": (
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor_coalesced",
        "_reduce_scatter_base",
    ),
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "broadcast": ("broadcast",),
}
KIND_OF = {method: kind for kind, methods in KINDS.items() for method in methods}


def _complete(waits: queue.Queue) -> None:
    while True:
        work, fut = waits.get()
        try:
            work.wait()
            try:
                value = work.result()
            except RuntimeError:  # "result() not implemented": the caller reads its outputs
                value = []
            fut.set_result(value)
        except Exception as e:  # the transport failed: the waiter gets it
            fut.set_exception(e)


def _forward(method: str) -> Callable[..., dist.Work | None]:
    def collective(self: AbortableProcessGroup, *args: Any, **kwargs: Any) -> dist.Work | None:
        self._ready()
        observe = self._observe
        if observe is not None:
            observe(method, False)
        work = getattr(self.inner, method)(*args, **kwargs)
        # NCCL hands back no Work for a synchronous collective (its options' asyncOp False,
        # torch's lightweight path): it is ordered on the caller's stream and torch's
        # function waits for nothing. Nothing to own; an abort of the communicator
        # releases a kernel blocked in it.
        work = None if work is None else self._owned(work)
        if observe is not None:
            observe(method, True)
        return work

    collective.__name__ = collective.__qualname__ = method
    return collective


for _method in COLLECTIVES:
    if hasattr(dist.ProcessGroup, _method):
        setattr(AbortableProcessGroup, _method, _forward(_method))

"""A process group that survives recoveries: reconfigured underneath, abortable from outside.

Why: on a failure, survivors may sit in a collective waiting for a dead peer. Gloo's own
``abort()`` does not release such a waiter (checked on torch 2.13), and its timeout is
minutes. So every collective stalwart issues returns a future that we own: ``abort()`` fails
all pending futures at once, the blocked rank unwinds, and the old gloo group is left to
die (its worker threads may stay blocked on a socket; we keep it referenced so its
destructor never joins them on the training thread).

Each generation's group is installed as torch.distributed's default group behind a Python
ProcessGroup (worker/torch_group.py) whose collectives complete through futures we own too:
code that takes a ``process_group`` or calls ``torch.distributed`` directly
(ZeroRedundancyOptimizer, a user's ``dist.barrier``, a DDP the loop builds) runs on the
current generation, and an abort releases it as it releases ours. The previous generation's
group leaves torch's registry without ``shutdown()`` (that would join its possibly blocked
threads). This uses two private torch.distributed helpers (``_register_pg_in_world``,
``_cleanup_process_group_global_state``; orchestrator/compat.py checks them at import, and
tests/unit/test_collective_world.py fails on an upgrade that changes their behaviour).

A DDP on that group (``ctx.prepare_model``'s, or one the loop builds: worker/torchrun.py)
reduces its gradients in stalwart's own buckets (worker/buckets.py): a layout fixed by the
model's parameters alone, not DDP's, which differs between a fresh DDP and one that has
rebuilt its buckets, so the floating-point sums are the same in a recovered run; each
bucket's all-reduce (``all_reduce_async``, abortable) starts as soon as its gradients are
in, overlapping the rest of the backward.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from stalwart.orchestrator.compat import require_torch
from stalwart.orchestrator.worker.buckets import reduce_in_buckets
from stalwart.orchestrator.worker.torch_group import KIND_OF, AbortableProcessGroup

require_torch()  # the private helpers below: a clear error now, not in a recovery

# The default group's name, the same in every generation: DTensor caches sharding
# decisions by mesh, and a mesh of an earlier generation compares equal to the one the loop
# builds again on the same thread, so a cached decision may name the earlier mesh's groups.
# With stable names (subgroups: ElasticGroup.subgroup) those resolve to this generation's.
WORLD_NAME = "stalwart-world"


class GroupAborted(RuntimeError):
    """Raised in the training thread when a recovery aborts the current process group."""


class StaleGroup(RuntimeError):
    """A subgroup (a DeviceMesh's, a ``dist.new_group``) of an earlier generation was used:
    the loop kept it across a recovery instead of building it again (a user error)."""


def _wrap_backend(
    store,
    rank: int,
    size: int,
    backend_name: str,
    timeout: datetime.timedelta,
    device: torch.device,
    hostname: str | None = None,
) -> tuple[dist.ProcessGroup, dist.Backend, list[tuple[torch.device, Any, dist.Backend]]]:
    """The generation's real group, its backend, and (device, kind, backend) registered."""
    pg = dist.ProcessGroup(store, rank, size)
    if backend_name == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        be = dist.ProcessGroupNCCL(store, rank, size, opts)
        kind = dist.ProcessGroup.BackendType.NCCL
        pg._register_backend(device, kind, be)
        registered = [(device, kind, be)]
        # CPU tensors (e.g. a loss scalar) still need a CPU transport.
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        if hostname:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        be = dist.ProcessGroupGloo(store, rank, size, opts)
        kind = dist.ProcessGroup.BackendType.GLOO
        pg._register_backend(torch.device("cpu"), kind, be)
        registered = [(torch.device("cpu"), kind, be)]
    pg._set_default_backend(kind)
    return pg, be, registered


def local_group(store: dist.Store | None = None) -> dist.ProcessGroup:
    """A one-rank gloo group on an in-process store, for building DDP without peers."""
    pg, _, _ = _wrap_backend(
        store or dist.HashStore(),
        0,
        1,
        "gloo",
        datetime.timedelta(seconds=30),
        torch.device("cpu"),
        hostname="127.0.0.1",
    )
    return pg


_solo: dist.ProcessGroup | None = None


def solo_group() -> dist.ProcessGroup:
    """A one-rank job's process group (installed as the default group once per process)."""
    global _solo
    if _solo is None:
        store = dist.HashStore()
        _solo = local_group(store)
        install_default_group(_solo, store, "gloo", torch.device("cpu"))
    return _solo


def install_default_group(pg: dist.ProcessGroup, store, backend: str, device: torch.device) -> None:
    """Make `pg` torch.distributed's default (WORLD) group, replacing any earlier one."""
    previous = c10d._world.default_pg
    if previous is not None:
        forget_group(previous)
    name = WORLD_NAME
    pg._set_group_name(name)
    c10d._register_pg_in_world(
        pg,
        backend_name=backend,
        store=store,
        group_name=name,
        backend_config=f"{device.type}:{backend}",
        rank_mapping={i: i for i in range(pg.size())},
        add_to_default_tag=True,
    )
    c10d._update_default_pg(pg)


def forget_group(pg: dist.ProcessGroup) -> None:
    """Take `pg` out of torch.distributed's registry without shutting it down."""
    c10d._cleanup_process_group_global_state(pg)
    if c10d._world.default_pg is pg:
        c10d._update_default_pg(None)


def retire_group(pg: dist.ProcessGroup) -> None:
    """Take a subgroup of a generation that is over out of torch.distributed's registries
    (its name and tags go to the next generation's), except what lets a direct use of the
    object (a loop that kept it) reach its own check and be refused with StaleGroup
    rather than with torch's "not initialized in the world group map"."""
    kept = c10d._world.pg_map.get(pg), c10d._world.pg_group_ranks.get(pg)
    forget_group(pg)
    c10d._unregister_process_group(pg.group_name)
    if kept[0] is not None:
        c10d._world.pg_map[pg] = kept[0]
    if kept[1] is not None:
        c10d._world.pg_group_ranks[pg] = kept[1]


class ElasticGroup:
    """The current generation's process group behind a stable handle."""

    def __init__(self) -> None:
        self._pg: dist.ProcessGroup | None = None
        self._torch_pg: AbortableProcessGroup | None = None  # the default group users see
        self._backend: dist.Backend | None = None
        self._lock = threading.Lock()
        self._pending: dict[torch.futures.Future, float] = {}  # future -> issued at
        self._aborted: str | None = "not configured"
        self._graveyard: list[tuple[dist.ProcessGroup, dist.Backend]] = []
        # Joining a generation's group blocks (gloo connects to every peer through the
        # store) until every rank has joined: a rank killed before it joined would hold the
        # others there until the collective timeout. The join runs on a helper thread; an
        # abort of the generation being joined wakes the training thread (configure).
        self._joining: tuple[int, threading.Event] | None = None
        self._cancelled: tuple[int, str] | None = None  # the newest generation aborted
        # This generation's subgroups (DeviceMesh dimensions, dist.new_group) and how many
        # were made on each set of ranks (their names and store keys).
        self._subgroups: list[tuple[AbortableProcessGroup, dist.Backend]] = []
        self._made: dict[tuple[int, ...], int] = {}
        self._store = None
        self._hostname: str | None = None
        self._timeout = datetime.timedelta(minutes=30)
        # Chaos (in_collective): (kind, fire) for the next collective of that kind.
        self._trap: tuple[str, Callable[[bool], None]] | None = None
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.backend = "gloo"
        self.device = torch.device("cpu")
        self.restoring = False  # a restore follows this generation's start (set by the worker)
        # Seconds the training thread was blocked waiting for collectives: the time a rank
        # spends waiting for its peers (straggler detection subtracts it from step time).
        # Not the time a collective was in flight: DDP's bucket all-reduces and FSDP2's
        # prefetched all-gathers overlap the rank's own compute (`waited`).
        self.collective_seconds = 0.0

    def pending_since(self) -> float | None:
        """When the oldest collective still pending was issued (monotonic), if any."""
        with self._lock:
            return min(self._pending.values(), default=None)

    def configure(
        self,
        store,
        rank: int,
        world_size: int,
        generation: int,
        backend: str,
        device: torch.device,
        hostname: str | None,
        timeout: datetime.timedelta,
    ) -> None:
        """Join generation `generation`'s group; blocks until every rank has joined, or
        raises GroupAborted as soon as the generation is aborted (a peer died first)."""
        pg, be, registered = self._join(
            generation,
            lambda: _wrap_backend(store, rank, world_size, backend, timeout, device, hostname),
        )
        self.device = device
        owned = AbortableProcessGroup(
            pg,
            registered,
            backend,
            ready=lambda: self._group(generation),
            track=self._own,
            new_future=self.new_future,
            subgroup=self.subgroup,
            observe=self._on_collective,
            waited=self.waited,
        )
        owned.elastic = self  # a DDP built on it reduces through this (worker/torchrun.py)
        with self._lock:
            if self._pg is not None:
                self._graveyard.append((self._pg, self._backend))
            for sub, sub_backend in self._subgroups:
                retire_group(sub)  # not shut down: its threads may be blocked on a socket
                self._graveyard.append((sub, sub_backend))
            self._subgroups, self._made = [], {}
            self._trap = None  # armed in the generation that is over
            install_default_group(owned, store, backend, device)
            self._pg, self._backend, self._torch_pg = pg, be, owned
            self.rank, self.world_size, self.generation = rank, world_size, generation
            self.backend = backend
            self._store, self._hostname, self._timeout = store, hostname, timeout
            self._aborted = None

    def _join(self, generation: int, build: Callable[[], Any]) -> Any:
        """`build()` (which blocks until every rank joined) on a helper thread, returning
        what it returns; GroupAborted once `generation` is aborted. A group built after the
        abort goes to the graveyard with the rest (its threads may be blocked)."""
        wake = threading.Event()
        outcome: dict[str, Any] = {}
        with self._lock:
            if self._cancelled is not None and self._cancelled[0] == generation:
                raise GroupAborted(self._cancelled[1])
            self._joining = (generation, wake)

        def run() -> None:
            try:
                built, error = build(), None
            except BaseException as e:  # handed to the training thread
                built, error = None, e
            with self._lock:
                outcome.update(group=built, error=error)
                if outcome.get("abandoned") and built is not None:
                    self._graveyard.append(built[:2])
            wake.set()

        threading.Thread(target=run, name=f"stalwart-join-gen{generation}", daemon=True).start()
        wake.wait()
        with self._lock:
            self._joining = None
            cancelled = self._cancelled
            if cancelled is not None and cancelled[0] == generation:
                if outcome.get("group") is not None:
                    self._graveyard.append(outcome["group"][:2])
                outcome["abandoned"] = True
                raise GroupAborted(cancelled[1])
        if outcome["error"] is not None:
            raise outcome["error"]
        return outcome["group"]

    def subgroup(
        self,
        ranks: list[int],
        timeout: datetime.timedelta | None,
        group_name: str | None,
        group_desc: str | None,
    ) -> AbortableProcessGroup | None:
        """This generation's group of `ranks` (torch.distributed.new_group, a DeviceMesh
        dimension): a gloo/NCCL group on the generation's store whose collectives are
        abortable and end with the generation; None where this rank is not in `ranks`.

        Its name and store keys come from the ranks and how many groups of those ranks the
        generation made before, not from torch's group counter: a replacement's fresh
        process and a survivor have made different numbers of groups, yet must meet; and
        the group of the same ranks has the same name in every generation (WORLD_NAME
        says why), registered under it besides torch's own name for it."""
        ranks = [int(r) for r in ranks]
        with self._lock:
            generation, store, rank = self.generation, self._store, self.rank
            n = self._made.get(tuple(ranks), 0)
            self._made[tuple(ranks)] = n + 1
        if rank not in ranks:
            return None
        tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        name = f"stalwart-{tag}-{n}"
        sub_store = dist.PrefixStore(f"subgroup/{name}", store)
        # A collective stuck past stalwart's own timeout is a hang the supervisor finds.
        wait = min(timeout, self._timeout) if timeout is not None else self._timeout
        pg, be, registered = _wrap_backend(
            sub_store,
            ranks.index(rank),
            len(ranks),
            self.backend,
            wait,
            self.device,
            self._hostname,
        )
        owned = AbortableProcessGroup(
            pg,
            registered,
            self.backend,
            ready=lambda: self._sub_ready(generation, ranks),
            track=self._own,
            new_future=self.new_future,
            observe=self._on_collective,
            waited=self.waited,
        )
        owned._set_group_name(name)
        if group_desc is not None:
            owned._set_group_desc(group_desc)
        with self._lock:
            if generation != self.generation:  # a recovery began meanwhile
                raise GroupAborted(f"generation {generation} is over")
            c10d._register_process_group(name, owned)
            self._subgroups.append((owned, be))
        return owned

    def arm(self, kind: str, fire: Callable[[bool], None]) -> None:
        """Chaos (in_collective): call `fire(issued)` around this rank's next collective of
        `kind` ("all_gather", ...), on any group, before it is issued and after; `fire`
        acts on one of the two (a hang before, a kill after) and never returns there."""
        self._trap = (kind, fire)

    def _on_collective(self, method: str, issued: bool) -> None:
        trap = self._trap
        if trap is None or KIND_OF.get(method) != trap[0]:
            return
        if issued:
            self._trap = None
        trap[1](issued)

    def _sub_ready(self, generation: int, ranks: list[int]) -> None:
        with self._lock:
            if self._aborted is not None and generation == self.generation:
                raise GroupAborted(self._aborted)
            if generation != self.generation:
                raise StaleGroup(
                    f"a process group of ranks {_brief(ranks)} made in generation "
                    f"{generation} was used in generation {self.generation}: a recovery "
                    "calls train_loop again with new process groups, so build the "
                    "DeviceMesh (init_device_mesh) and any dist.new_group inside train_loop, "
                    "not once outside it"
                )

    def new_future(self) -> torch.futures.Future:
        """A future for this group's results: on CUDA one that records the streams its
        value was set on, so a waiter's stream waits for NCCL's kernels (a plain future
        would hand over tensors the GPU has not finished writing)."""
        if self.device.type == "cuda":
            return torch.futures.Future(devices=[self.device])
        return torch.futures.Future()

    def abort(self, reason: str, generation: int | None = None) -> None:
        """Fail every pending and future collective of this generation with GroupAborted;
        with `generation`, also a join of that generation in progress or still to come."""
        with self._lock:
            self._aborted = reason
            if generation is not None:
                self._cancelled = (generation, reason)
                if self._joining is not None and self._joining[0] == generation:
                    self._joining[1].set()
            pending, self._pending = list(self._pending), {}
            backend = self._backend
            subgroups = [be for _, be in self._subgroups]
        if backend is not None and self.backend == "nccl":
            # NCCL kernels stuck on the GPU must be aborted too, or the stream never drains.
            for be in [backend, *subgroups]:
                be.abort()
        for fut in pending:
            if not fut.done():
                fut.set_exception(GroupAborted(reason))

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def abort_error(self) -> GroupAborted | None:
        """What a waiter on this generation fails with once it is aborted (None before)."""
        reason = self._aborted
        return None if reason is None else GroupAborted(reason)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """This generation's torch ProcessGroup, torch.distributed's default group: its
        collectives are abortable like ours (worker/torch_group.py)."""
        self._group()
        return self._torch_pg

    def _track(self, work: dist.Work, result: Callable[[], object]) -> torch.futures.Future:
        return self._own(work.get_future(), lambda _: result())

    def _own(
        self,
        done: torch.futures.Future,
        result: Callable[[torch.futures.Future], object] = lambda f: f.value(),
    ) -> torch.futures.Future:
        """A future that completes with `done` (its value mapped by `result`), or fails
        with GroupAborted when this generation is aborted first."""
        out = self.new_future()
        with self._lock:
            if self._aborted is not None:
                out.set_exception(GroupAborted(self._aborted))
                return out
            self._pending[out] = time.monotonic()

        def finished(fut: torch.futures.Future) -> None:
            with self._lock:
                if out not in self._pending:
                    return  # aborted meanwhile: the exception is already set
                del self._pending[out]
            try:
                fut.value()
                value = result(fut)
            except Exception as e:  # a transport error: hand it to the waiter
                out.set_exception(e)
                return
            out.set_result(value)

        done.add_done_callback(finished)
        return out

    def _group(self, generation: int | None = None) -> dist.ProcessGroup:
        """The current group; GroupAborted once aborted (or when `generation` is over)."""
        with self._lock:
            if self._aborted is not None:
                raise GroupAborted(self._aborted)
            if generation is not None and generation != self.generation:
                raise GroupAborted(f"generation {generation} is over")
            return self._pg

    def all_reduce_async(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.futures.Future:
        pg = self._group()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = pg.allreduce([tensor], opts)
        return self._track(work, lambda: tensor)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        fut = self.all_reduce_async(tensor, op)
        t0 = time.monotonic()
        try:
            return fut.wait()
        finally:
            self.waited(time.monotonic() - t0)

    def waited(self, seconds: float) -> None:
        """The training thread was blocked `seconds` waiting for a collective (a Work's
        wait(), the end of a backward waiting for DDP's buckets: worker/buckets.py)."""
        with self._lock:
            self.collective_seconds += seconds


def _brief(ranks: list[int]) -> str:
    return f"[{', '.join(map(str, ranks[:8]))}{', ...' if len(ranks) > 8 else ''}]"


def make_ddp(
    module: torch.nn.Module, group: ElasticGroup, device: torch.device, **ddp_kwargs
) -> torch.nn.parallel.DistributedDataParallel:
    """DistributedDataParallel on the generation's group (its construction broadcasts rank
    0's parameters and buffers, as DDP does), its gradients reduced in stalwart's fixed
    buckets (worker/buckets.py)."""
    if ddp_kwargs.get("find_unused_parameters"):
        raise ValueError(
            "prepare_model does not support find_unused_parameters: every parameter must get "
            "a gradient in every step"
        )
    device_ids = [device.index] if device.type == "cuda" else None
    if group.restoring:
        ddp_kwargs.setdefault("init_sync", False)  # the restore overwrites what it would send
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    ddp = ddp_cls(module, process_group=group.process_group, device_ids=device_ids, **ddp_kwargs)
    if not hasattr(ddp, "_stalwart_reducer"):  # worker/torchrun.install() not run
        reduce_in_buckets(ddp, group, ddp_cls.register_comm_hook)
    return ddp

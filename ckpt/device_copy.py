"""A snapshot of GPU state without stopping the training thread.

SnapshotBuffer.capture() copies the state to the host and then calls torch.cuda.synchronize(),
so every snapshot step waits for the whole device-to-host copy. AsyncCapture issues the copy
and returns; the training thread waits only where the copy could otherwise read a changed
value, and then on the device (a stream waits for an event), not on the host.

At capture(step, state), on the training thread:

1. An event is recorded on each device's current stream (the training stream): everything the
   step queued so far, its optimizer step included, comes before it.
2. A side stream (one per device, made once) waits for that event, then copies every CUDA
   tensor into a pinned host buffer (non_blocking=True) and records a completion event. The
   copy therefore reads the values of this step, never an older one.
3. CPU tensors are copied at once on the host; the skeleton is pickled and allow-list checked
   as SnapshotBuffer does. capture() returns a PendingSnapshot; nothing waited on the host.

What the copy reads must not change or disappear before the completion event:

- Parameters and optimizer state change only in optimizer.step(). guard(optimizer) registers
  a step pre-hook that makes the stream the step runs on wait for the completion event
  (fence()), so the in-place update is queued behind the copy. That costs the training stream
  the rest of the copy only if the forward and backward were shorter than it.
- Any other CUDA tensor in the state (a BatchNorm's running statistics, changed in place by
  the next forward; a tensor state_dict() made) is cloned on the training stream at capture
  time (unguarded="clone", the default), and the side stream copies the clone: later changes
  cannot reach it. unguarded="trust" skips the clones: the caller then promises to call
  fence() before anything changes such a tensor (the tests use it to show the race is real).
- Memory: a tensor freed while the side stream still reads it (state_dict() may hand out
  fresh tensors; a clone is dropped after the copy) could be handed out again by the caching
  allocator and overwritten. Each source gets tensor.record_stream(side stream), so its block
  is not reused before the side stream's work queued at its release is done, and the
  PendingSnapshot holds the references until wait() has seen the completion event.

Host buffers: two pinned buffers alternate, allocated once per layout (the views into them
built once). A PendingSnapshot owns its buffer until release(); a third capture while both
are held waits for one (backpressure, as in SnapshotPipeline). A consumer thread calls
wait() (event.synchronize(): the copy is complete), copies the Snapshot on (shared memory)
and calls release(). A state with no CUDA tensor takes the plain, synchronous path.

Every CUDA call goes through a device API object (CudaApi here; tests/unit/test_device_copy.py
has a fake that runs the logic on CPU and records the order of operations). Not for use under
CUDA graph capture: the fence would be captured into the graph.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from stalwart.ckpt import dtensor
from stalwart.ckpt.snapshot import Flattener, Snapshot, TensorMeta, views_of


class DeviceApi(Protocol):
    """The CUDA calls AsyncCapture makes (CudaApi); a fake one runs the logic on CPU."""

    def is_device(self, t: torch.Tensor) -> bool: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def new_stream(self, device: torch.device) -> Any: ...
    def new_event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def copy(self, stream: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None: ...
    def record_stream(self, t: torch.Tensor, stream: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...


class CudaApi:
    """The real one."""

    def is_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, stream: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        with torch.cuda.stream(stream):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def query(self, event: Any) -> bool:
        return event.query()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass
class CaptureStats:
    captures: int = 0
    capture_seconds: float = 0.0  # on the training thread, issuing included
    wait_seconds: float = 0.0  # the training thread waiting for a free buffer (backpressure)
    cloned_bytes: int = 0  # unguarded CUDA tensors cloned on the device, last capture
    last_bytes: int = 0


class _Slot:
    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.metas: tuple[TensorMeta, ...] | None = None
        self.views: list[torch.Tensor] = []


class PendingSnapshot:
    """One capture in flight. wait() on any thread, then release() when done with it."""

    def __init__(self, owner: AsyncCapture, slot: _Slot, snapshot: Snapshot, events, held):
        self.step = snapshot.step
        self._owner, self._slot, self._snapshot = owner, slot, snapshot
        self._events: list[Any] = events  # one completion event per device
        self._held: list[torch.Tensor] = held  # what the side streams read, until complete
        self._released = False

    def ready(self) -> bool:
        """The copy is complete (never blocks)."""
        return all(self._owner.api.query(e) for e in self._events)

    def wait(self) -> Snapshot:
        """Block until the copy is complete; the Snapshot's payload is the pinned buffer,
        valid until release()."""
        if self._released:
            raise RuntimeError(f"the snapshot of step {self.step} was released")
        for e in self._events:
            self._owner.api.synchronize(e)
        self._held = []
        return self._snapshot

    def release(self) -> None:
        """Give the buffer back for a later capture (waits for the copy first)."""
        if not self._released:
            self.wait()
            self._released = True
            self._owner._free_slot(self._slot)

    def __enter__(self) -> Snapshot:
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.release()


class AsyncCapture:
    """Two pinned host buffers that a rank's state is copied into from the GPU off the
    training thread. api: a DeviceApi (default CudaApi when CUDA is available, else none:
    every capture is synchronous, into ordinary memory)."""

    def __init__(
        self,
        api: DeviceApi | None = None,
        unguarded: Literal["clone", "trust"] = "clone",
        buffers: int = 2,
    ):
        if api is None and torch.cuda.is_available():
            api = CudaApi()
        if unguarded not in ("clone", "trust"):
            raise ValueError(f"unguarded must be 'clone' or 'trust', not {unguarded!r}")
        self.api = api
        self.unguarded = unguarded
        self.stats = CaptureStats()
        self._slots = [_Slot() for _ in range(buffers)]
        self._free: deque[_Slot] = deque(self._slots)
        self._cond = threading.Condition()
        self._side: dict[torch.device, Any] = {}
        self._pending: dict[torch.device, Any] = {}  # each device's newest copy's event
        self._guarded: list[torch.optim.Optimizer] = []
        self._flattener = Flattener()

    # --- the training thread ----------------------------------------------------------------

    def guard(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Make optimizer.step() wait (on the device) for the copy in flight. Returns what
        undoes it."""
        hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.fence())
        self._guarded.append(optimizer)

        def remove() -> None:
            hook.remove()
            if optimizer in self._guarded:
                self._guarded.remove(optimizer)

        return remove

    def fence(self) -> None:
        """Queue everything the current streams do from now on behind the copy in flight."""
        for device, event in self._pending.items():
            self.api.wait_event(self.api.current_stream(device), event)

    def capture(self, step: int, state: Any, timeout: float | None = None) -> PendingSnapshot:
        t0 = time.perf_counter()
        slot = self._take_slot(timeout)
        t1 = time.perf_counter()
        try:
            pending = self._capture(slot, step, state)
        except BaseException:
            self._free_slot(slot)
            raise
        self.stats.captures += 1
        self.stats.wait_seconds += t1 - t0
        self.stats.capture_seconds += time.perf_counter() - t1
        self.stats.last_bytes = pending._snapshot.nbytes
        return pending

    def _capture(self, slot: _Slot, step: int, state: Any) -> PendingSnapshot:
        api = self.api
        # Refused here, before anything is issued (docs/checkpoints.md, "What a snapshot may
        # hold"), as SnapshotBuffer does.
        flat = self._flattener.flatten(state)
        tensors, metas, total, pickled = flat.tensors, flat.metas, flat.nbytes, flat.skeleton
        views = self._views(slot, metas, total)
        by_device: dict[torch.device, list[int]] = {}
        host: list[int] = []
        for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
            if m.nbytes:
                on_device = api is not None and api.is_device(t)
                (by_device.setdefault(t.device, []) if on_device else host).append(i)
        events: dict[torch.device, Any] = {}
        held: list[torch.Tensor] = []
        self.stats.cloned_bytes = 0
        guarded = self._guarded_storages() if by_device and self.unguarded == "clone" else None
        for device, idx in by_device.items():
            current = api.current_stream(device)
            srcs = [self._source(tensors[i], guarded) for i in idx]
            side = self._side.get(device)
            if side is None:
                side = self._side[device] = api.new_stream(device)
            issued = api.new_event()
            api.record(issued, current)  # after the step's work and the clones above
            api.wait_event(side, issued)
            api.copy(side, [views[i] for i in idx], srcs)
            for s in srcs:
                api.record_stream(s, side)
            done = api.new_event()
            api.record(done, side)
            events[device] = done
            held += srcs
        if host:  # CPU tensors: copied now, as SnapshotBuffer does
            torch._foreach_copy_([views[i] for i in host], [tensors[i].detach() for i in host])
        self._pending.update(events)
        snapshot = Snapshot(step, pickled, metas, slot.buf[:total])
        return PendingSnapshot(self, slot, snapshot, list(events.values()), held)

    def _source(self, t: torch.Tensor, guarded: set[int] | None) -> torch.Tensor:
        t = t.detach()
        if guarded is None or t.untyped_storage().data_ptr() in guarded:
            return t
        self.stats.cloned_bytes += t.numel() * t.element_size()
        return t.clone()  # on the training stream: this step's value, whatever comes next

    def _guarded_storages(self) -> set[int]:
        """The storages that only a guarded optimizer's step changes (a DTensor's: its local
        shard's, which is what a snapshot copies: ckpt/dtensor.py)."""
        ptrs = set()
        for opt in self._guarded:
            for group in opt.param_groups:
                ptrs.update(_storage(p) for p in group["params"])
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        ptrs.add(_storage(v))
        return ptrs

    def _views(self, slot: _Slot, metas, total: int) -> list[torch.Tensor]:
        if slot.buf is None or slot.buf.numel() < total:
            n = max(total, 1)
            slot.buf = self.api.pinned(n) if self.api else torch.empty(n, dtype=torch.uint8)
            slot.metas = None
        if metas != slot.metas:
            slot.views = views_of(slot.buf, metas)
            slot.metas = metas
        return slot.views

    # --- buffers ----------------------------------------------------------------------------

    def _take_slot(self, timeout: float | None) -> _Slot:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(
                    f"no snapshot buffer came free in {timeout} s: the consumer holds all "
                    f"{len(self._slots)} (release() each PendingSnapshot)"
                )
            return self._free.popleft()

    def _free_slot(self, slot: _Slot) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def free_buffers(self) -> int:
        with self._cond:
            return len(self._free)


def _storage(t: torch.Tensor) -> int:
    if dtensor.is_dtensor(t):
        t = dtensor.local_shard(t)
    return t.untyped_storage().data_ptr()

"""A rank's snapshots written straight into its node's shared memory: one copy, no call.

The training thread takes the state apart (its skeleton checked as SnapshotBuffer does),
copies its tensors into a free slot of the rank's ring (ckpt/ring.py) and publishes it;
that copy is the snapshot's whole cost to the rank. The node agent finds the slot, takes
its checksum and keeps it as the rank's shard. A ring is asked for once per tensor layout
(`open_ring`, a call to the agent); when there is none to be had (no usable shared memory
on the node, or it filled up) snapshots go the other way, `fallback()`'s pipeline, which
hands them to the agent through Ray.

On a GPU (`device`, a ckpt/device_copy.py AsyncCapture) the training thread only issues
the device-to-host copy into a pinned buffer on a side stream and goes on; a background
thread waits for that copy, copies the buffer into the ring and publishes it. The next
optimizer step waits, on the device, for the copy (`guard`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from stalwart.ckpt.pipeline import PipelineStats
from stalwart.ckpt.ring import RingWriter, wait_free
from stalwart.ckpt.snapshot import Flattener, TensorMeta, _as_numpy, copy_tensors

VOID = -1  # the step a slot is published with when its copy failed: passed over


class RingPipeline:
    def __init__(
        self,
        open_ring: Callable[[tuple[TensorMeta, ...], int, int], tuple[str, str | None] | None],
        fallback: Callable[[], Any],
        generation: Callable[[], int],
        torn: Callable[[int], Any] | None = None,
        die: Callable[[Any], None] | None = None,
        wait_s: float = 60.0,
        device: Any = None,
        lean: bool = False,
    ):
        """`open_ring(metas, payload_nbytes, skeleton_nbytes)`: (ring path, doorbell path)
        of a new ring for this layout, or None (no shared memory: use `fallback()`).
        `torn(step)`: a chaos fault that kills the rank half-way through this step's copy
        (`die(fault)` carries it out). `wait_s`: how long a snapshot waits for a free slot
        before it is given up (counted in stats.errors; the step stays uncommitted).
        `device`: an AsyncCapture for a rank whose state is on a GPU. `lean`: the lean
        rule (ckpt/ring.py, the floor): before a snapshot takes a slot, the rank's shards
        older than its previous one of this generation go."""
        self._open_ring = open_ring
        self._make_fallback = fallback
        self._generation = generation
        self._torn = torn
        self._die = die
        self._wait_s = wait_s
        self._lean = lean
        self._restored: tuple[int, int] | None = None  # (generation, the step it restored)
        self._flattener = Flattener()
        self._writer: RingWriter | None = None
        self._fallback: Any = None
        self._last: tuple[int, Any] | None = None
        self.stats = PipelineStats()
        self._device = device
        self._copies: queue.Queue[Any] = queue.Queue()
        self._copying = 0  # device snapshots queued or being copied into the ring
        self._copy_lock = threading.Lock()
        if device is not None:
            threading.Thread(target=self._copy_loop, name="stalwart-snapshot", daemon=True).start()

    def guard(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """On a GPU, the optimizer's next step waits (on the device) for the snapshot copy
        in flight. Returns what undoes it."""
        if self._device is None or getattr(self._device, "api", None) is None:
            return lambda: None
        return self._device.guard(optimizer)

    @property
    def transport(self) -> str:
        return "ray" if self._fallback is not None else "shm"

    def _use_fallback(self) -> None:
        """Snapshots go through Ray from now on (the fall-back counts in the same stats)."""
        if self._fallback is None:
            self._fallback = self._make_fallback()
            self._fallback.stats = self.stats

    def submit(self, step: int, state: Any) -> None:
        if self._fallback is not None:
            self._fallback.submit(step, state)
            return
        if self._device is not None:
            return self._submit_device(step, state)
        self._last = (step, state)  # for drain(), should the ring close under it
        t0 = time.perf_counter()
        flat = self._flattener.flatten(state)  # refuses an unsafe state before any copy
        writer = self._writer_for(flat.metas, flat.nbytes, len(flat.skeleton))
        if writer is None:
            self._use_fallback()
            self._fallback.submit(step, state)
            return
        t1 = time.perf_counter()
        slot = self._wait_free(writer, step)
        t2 = time.perf_counter()
        if slot is None and writer.ring.closed:
            return self.submit(step, state)  # a new ring, or Ray
        self.stats.wait_seconds += t2 - t1
        if slot is None:
            self._no_slot(writer, step)
            return
        self._write(writer, slot, step, flat.skeleton, lambda views: flat.tensors)
        t3 = time.perf_counter()
        self.stats.captures += 1
        self.stats.capture_seconds += (t1 - t0) + (t3 - t2)
        self.stats.last_bytes = flat.nbytes

    def restored(self, generation: int, step: int | None) -> None:
        """Generation `generation` starts from `step` (None: from scratch), a step every
        rank restored: the lean rule's floor until it publishes one of its own."""
        self._restored = None if step is None else (generation, step)

    def _wait_free(self, writer: RingWriter, step: int) -> int | None:
        if self._lean:
            generation = self._generation()
            for floor in (writer.last_published(), self._restored):
                if floor is not None and floor[0] == generation and floor[1] < step:
                    writer.set_floor(*floor)
                    break
        return wait_free(writer, self._wait_s)

    def _no_slot(self, writer: RingWriter, step: int) -> None:
        self.stats.errors += 1
        self.stats.last_error = (
            f"no free snapshot slot within {self._wait_s:g} s: the node agent kept all "
            f"{writer.ring.slots}; step {step} was not checkpointed"
        )

    def _write(self, writer: RingWriter, slot: int, step: int, skeleton: bytes, sources) -> None:
        """Copy into `slot` (`sources(views)`: the tensors to copy into the slot's views)
        and publish it."""
        writer.begin(slot)
        published = False
        try:
            views = writer.views(slot)
            tensors = sources(views)
            fault = self._torn(step) if self._torn is not None else None
            if fault is not None and self._die is not None:
                half = len(views) // 2  # chaos during: snapshot, a torn write
                copy_tensors(views[:half], tensors[:half])
                self._die(fault)
            copy_tensors(views, tensors)
            if any(t.device.type == "cuda" for t in tensors):
                torch.cuda.synchronize()
            writer.publish(slot, step, self._generation(), skeleton)
            published = True
        finally:
            if not published:  # the copy failed: the slot goes back, holding nothing
                writer.publish(slot, VOID, self._generation(), b"")

    # --- on a GPU ---------------------------------------------------------------------------

    def _submit_device(self, step: int, state: Any) -> None:
        """Issue the device-to-host copy and return; the copy thread takes it from there."""
        with self._copy_lock:
            self._copying += 1
        try:
            pending = self._device.capture(step, state, timeout=self._wait_s)
        except BaseException:
            with self._copy_lock:
                self._copying -= 1
            raise
        self.stats.captures += 1
        self.stats.capture_seconds = self._device.stats.capture_seconds
        self.stats.wait_seconds = self._device.stats.wait_seconds
        self.stats.last_bytes = self._device.stats.last_bytes
        self._copies.put(pending)

    def _copy_loop(self) -> None:
        while True:
            pending = self._copies.get()
            t0 = time.perf_counter()
            try:
                with pending as snap:
                    self._to_ring(snap)
            except Exception as e:  # the step stays uncommitted; training goes on
                self.stats.errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
            finally:
                self.stats.handover_seconds += time.perf_counter() - t0
                with self._copy_lock:
                    self._copying -= 1

    def _to_ring(self, snap: Any) -> None:
        payload = _as_numpy(snap.payload)
        while True:
            writer = self._writer_for(snap.metas, snap.nbytes, len(snap.skeleton))
            if writer is None:
                # No shared memory (any more): the next snapshots go through Ray; this one
                # is not checkpointed (its buffer is the device capture's, given back now).
                self._use_fallback()
                self.stats.errors += 1
                self.stats.last_error = f"no snapshot ring: step {snap.step} was not checkpointed"
                return
            slot = self._wait_free(writer, snap.step)
            if slot is not None:
                break
            if not writer.ring.closed:
                self._no_slot(writer, snap.step)
                return
        flat_src = [torch.from_numpy(payload[m.offset : m.offset + m.nbytes]) for m in snap.metas]
        self._write(
            writer,
            slot,
            snap.step,
            snap.skeleton,
            lambda views: [
                s.view(v.dtype).view(v.shape) for s, v in zip(flat_src, views, strict=True)
            ],
        )

    # --- the ring -----------------------------------------------------------------------------

    def _writer_for(self, metas: tuple, nbytes: int, skel_len: int) -> RingWriter | None:
        w = self._writer
        if (
            w is not None
            and not w.ring.closed
            and w.ring.metas == metas
            and skel_len <= w.ring.skel_cap
        ):
            return w
        self.forget()
        # The agent can close a ring between its answer and our mapping (its shared memory
        # filled and it fell back, unlinking every ring): the file is gone, which is a ring
        # closed before its first write. Ask again: the agent then answers None (send
        # through Ray) or a ring opened after the close. Twice is enough: a fall-back
        # happens once per node, and a second close of a new ring means the rank was
        # forgotten, which its next snapshot deals with.
        for _ in range(2):
            opened = self._open_ring(metas, nbytes, skel_len)
            if opened is None:
                return None
            try:
                self._writer = RingWriter(*opened)
            except FileNotFoundError:
                continue
            return self._writer
        return None

    def drain(self, timeout: float) -> bool:
        """Wait until the agent has dealt with every published snapshot."""
        deadline = time.monotonic() + timeout
        while self._copying:  # device snapshots still on their way into the ring
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        if self._fallback is not None:
            return self._fallback.drain(max(0.0, deadline - time.monotonic()))
        w = self._writer
        while w is not None and w.pending():
            if w.ring.closed and self._last is not None:
                # Closed under the last snapshot (its rank was renumbered or forgotten):
                # training has stopped, so its state is still the one to hand over.
                self.submit(*self._last)
                self._last = None
                w = self._writer
                continue
            if w.ring.closed or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def copies(self) -> tuple[int, tuple[int, int] | None] | None:
        """What the agent says of this rank's copies on peer nodes, from the ring's words
        (ckpt/ring.py `RingFile.replication`); None without an open ring to read them from
        (snapshots go through Ray, or none was written yet): ask the agent instead."""
        w = self._writer
        if self._fallback is not None or w is None or w.ring.closed:
            return None
        return w.ring.replication()

    def write_beat(self, raw: bytes | None) -> bool:
        """The rank's heartbeat into its open ring (ckpt/ring.py), for its agent to read;
        False where there is none (no snapshot yet, or snapshots go through Ray) or the beat
        does not fit: the caller sends it by call."""
        w = self._writer
        if raw is None or self._fallback is not None or w is None or w.ring.closed:
            return False
        return w.ring.write_beat(raw)

    def forget(self) -> None:
        """Stop using the current ring (ranks are renumbered: the next snapshot asks the
        agent for one under the new rank)."""
        if self._writer is not None:
            self._writer.close()
        self._writer = None

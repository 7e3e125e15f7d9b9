"""A rank's snapshot ring: a few slots in one shared-memory file, written by the rank and
announced to its node agent through the file itself, with no call per snapshot.

The node agent creates the file (it owns it: the slots outlive a killed worker) and the
rank maps it. The rank copies each snapshot's tensors straight from its state into a free
slot (the only copy on the training thread), then its skeleton, and publishes the slot by
its sequence number; the agent finds new slots by reading the sequence numbers (a byte
on the node's doorbell FIFO wakes it, see `ring_bell`), holds the ones it keeps as
shards and releases them when they are trimmed.

Every word below has one writer. Per slot:

    seq   (the rank)   odd while the rank writes the slot, even once it is published
    step, skel_len, generation (the rank)  what the published slot holds
    ack   (the agent)  the last seq the agent has dealt with
    hold  (the agent)  the step it keeps from the slot as a shard, or -1

The rank writes a slot only when ack == seq (the agent has decided about what was there)
and hold == -1 (it keeps none of it), so a slot the agent holds is never written under
it, and a slot the rank is writing (seq odd) is never taken: a rank killed half-way
through a copy leaves a slot the agent never reads. The ring's state word (the agent)
says it is closed: its rank must open another (the node's shards moved out of shared
memory, or ranks were renumbered).

Under a tight memory budget (the lean rule, ckpt/footprint.py) one more word, the rank's
floor, lets the rank give its older shards back without a round trip: copies are made
before the next step (max_lag_steps 0), so a rank about to write step s knows that every
rank's shard of its previous snapshot is on every peer (each rank passed that wait before
the collectives of the steps since); it names that step (with its generation: the floor
of a generation a roll back fenced off counts for nothing) as its floor, and the agent
releases the slots of older ones that nothing is reading.

The rank's heartbeat goes through the file too: a small area (BEAT_CAP bytes, after the
layout) holds the newest one the rank wrote, guarded by its own sequence word (odd while
the rank writes it), which the agent reads when it reports to the supervisor. A beat is
a few KB of JSON a rank writes several times a second; as a Ray call each cost ~1 ms of
CPU in the rank and ~1 ms in its agent (four ranks at 20 beats/s: 8 % of two cores).

Two more words of the ring's (the agent) bound how far the copies on peer nodes may lag
(ckpt/replicas.py `lag_gate`): the replication stride (the steps the node sends to its
peers; 0: it has none, nothing to wait for) and the rank's newest shard that reached every
peer, with the generation that wrote it (`pack_replicated`). The rank reads them at each
step boundary and waits there while its copies are too far behind: no call per step.

The words are aligned 8-byte stores, so a reader never sees half of one; the order of the
stores (the data, then seq) is kept on x86-64's total store order, which this layout
assumes (as the seqlock of DLRover's flash checkpoint does).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stalwart.ckpt.lazy import LazyModule
from stalwart.ckpt.snapshot import TensorMeta, views_of

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

MAGIC = 0x5354_414C_5249_4E47  # "STALRING"
VERSION = 2  # 2: the heartbeat area
PAGE = 4096
WORDS = PAGE  # the ring's words (then the layout, JSON): its header is a page or more
SLOT_WORDS = 16  # per slot: 0-7 the rank's, 8-15 the agent's (separate cache lines)
OPEN, CLOSED = 0, 1
# ring words
W_MAGIC, W_VERSION, W_SLOTS, W_PAYLOAD, W_SKEL_CAP, W_STRIDE, W_STATE, W_LAYOUT_LEN = range(8)
W_HEADER = 8
W_REPL_STRIDE, W_REPLICATED = 9, 10  # the agent's: see the module's docstring
W_BEAT_OFF, W_BEAT_CAP = 11, 12  # where the heartbeat area is, and its size (fixed)
W_FLOOR = 16  # the rank's (its own cache line): see the module's docstring
W_BEAT_SEQ, W_BEAT_LEN = 17, 18  # the rank's: the heartbeat's sequence word and length
W_SLOT0 = 64
# slot words
S_SEQ, S_STEP, S_SKEL_LEN, S_GENERATION = 0, 1, 2, 3
S_ACK, S_HOLD = 8, 9
BELL = "bell"
BEAT_CAP = 16384  # a beat is ~2 KB of JSON; a larger one goes as a call
BEAT_TRIES = 8  # reads of a beat the rank is rewriting before the agent gives up on it

NOT_REPLICATED = -1
_STEP_BITS = 40  # 10^12 steps; the generation above them (one aligned word: never torn)


def pack_replicated(generation: int, step: int) -> int:
    assert 0 <= step < 1 << _STEP_BITS and 0 <= generation < 1 << (63 - _STEP_BITS)
    return generation << _STEP_BITS | step


def unpack_replicated(word: int) -> tuple[int, int] | None:
    if word < 0:
        return None
    return word >> _STEP_BITS, word & ((1 << _STEP_BITS) - 1)


def _round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def metas_to_json(metas: tuple[TensorMeta, ...]) -> bytes:
    return json.dumps([asdict(m) for m in metas], separators=(",", ":")).encode()


def metas_from_json(raw: bytes) -> tuple[TensorMeta, ...]:
    """The layout, from JSON (never unpickled)."""
    return tuple(
        TensorMeta(
            int(m["offset"]), int(m["nbytes"]), str(m["dtype"]), tuple(m["shape"]), str(m["device"])
        )
        for m in json.loads(raw)
    )


class RingFile:
    """The mapping of one ring file, as either side sees it."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+")
        if len(self._map) < WORDS:
            raise ValueError(f"{self.path}: not a stalwart snapshot ring (too short)")
        self.words = self._map[:WORDS].view(np.int64)
        w = self.words
        if int(w[W_MAGIC]) != MAGIC or int(w[W_VERSION]) != VERSION:
            raise ValueError(f"{self.path}: not a stalwart snapshot ring of version {VERSION}")
        self.slots = int(w[W_SLOTS])
        self.payload_nbytes = int(w[W_PAYLOAD])
        self.skel_cap = int(w[W_SKEL_CAP])
        self.stride = int(w[W_STRIDE])
        self.header = int(w[W_HEADER])
        self.beat_off, self.beat_cap = int(w[W_BEAT_OFF]), int(w[W_BEAT_CAP])
        layout = bytes(
            self._map[W_SLOT0 * 8 + 8 * SLOT_WORDS * self.slots :][: int(w[W_LAYOUT_LEN])]
        )
        self.metas = metas_from_json(layout)

    @staticmethod
    def create(
        path: str | Path,
        slots: int,
        metas: tuple[TensorMeta, ...],
        payload_nbytes: int,
        skel_cap: int,
    ) -> RingFile:
        """Allocate the file now (a full file system fails here with ENOSPC, not with a
        SIGBUS in the rank writing through its mapping) and write its header."""
        layout = metas_to_json(metas)
        if W_SLOT0 + SLOT_WORDS * slots > WORDS // 8:
            raise ValueError(f"a ring has at most {(WORDS // 8 - W_SLOT0) // SLOT_WORDS} slots")
        beat_off = _round(W_SLOT0 * 8 + 8 * SLOT_WORDS * slots + len(layout))
        header = beat_off + _round(BEAT_CAP)
        skel_cap = _round(max(skel_cap, 1))
        stride = skel_cap + _round(max(payload_nbytes, 1))
        size = header + slots * stride
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        m = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        w = m[:WORDS].view(np.int64)
        w[W_VERSION], w[W_SLOTS], w[W_PAYLOAD] = VERSION, slots, payload_nbytes
        w[W_SKEL_CAP], w[W_STRIDE], w[W_STATE] = skel_cap, stride, OPEN
        w[W_LAYOUT_LEN], w[W_HEADER] = len(layout), header
        w[W_REPL_STRIDE], w[W_REPLICATED] = 0, NOT_REPLICATED
        w[W_FLOOR] = -1
        w[W_BEAT_OFF], w[W_BEAT_CAP], w[W_BEAT_SEQ], w[W_BEAT_LEN] = beat_off, BEAT_CAP, 0, 0
        start = W_SLOT0 * 8 + 8 * SLOT_WORDS * slots
        m[start : start + len(layout)] = np.frombuffer(layout, dtype=np.uint8)
        for i in range(slots):
            w[W_SLOT0 + SLOT_WORDS * i + S_HOLD] = -1
        w[W_MAGIC] = MAGIC  # last: a half-made ring is never taken for one
        m.flush()
        del m
        return RingFile(path)

    def word(self, slot: int, index: int) -> int:
        return int(self.words[W_SLOT0 + SLOT_WORDS * slot + index])

    def set_word(self, slot: int, index: int, value: int) -> None:
        self.words[W_SLOT0 + SLOT_WORDS * slot + index] = value

    @property
    def closed(self) -> bool:
        return int(self.words[W_STATE]) == CLOSED

    def replication(self) -> tuple[int, tuple[int, int] | None]:
        """(the node's replication stride, 0 without peers; (generation, step) of the rank's
        newest shard on every peer, or None)."""
        return int(self.words[W_REPL_STRIDE]), unpack_replicated(int(self.words[W_REPLICATED]))

    def set_replication(self, stride: int | None = None, replicated: int | None = None) -> None:
        """The agent's side of `replication` (`replicated`: a `pack_replicated` word)."""
        if stride is not None:
            self.words[W_REPL_STRIDE] = stride
        if replicated is not None:
            self.words[W_REPLICATED] = replicated

    @property
    def floor(self) -> tuple[int, int] | None:
        """The rank's floor, (generation, step): its shards of steps before it may go
        (None: none named)."""
        return unpack_replicated(int(self.words[W_FLOOR]))

    def close_for_writers(self) -> None:
        self.words[W_STATE] = CLOSED

    def _beat_area(self) -> np.ndarray:
        return self._map[self.beat_off : self.beat_off + self.beat_cap].view(np.ndarray)

    def write_beat(self, raw: bytes) -> bool:
        """The rank's side: `raw` is its newest heartbeat (False: too large for the area,
        send it another way)."""
        if len(raw) > self.beat_cap:
            return False
        w = self.words
        w[W_BEAT_SEQ] = int(w[W_BEAT_SEQ]) + 1  # odd: being written
        self._beat_area()[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        w[W_BEAT_LEN] = len(raw)
        w[W_BEAT_SEQ] = int(w[W_BEAT_SEQ]) + 1  # even: whole
        return True

    def read_beat(self) -> bytes | None:
        """The agent's side: the rank's newest heartbeat, whole (None: none written yet, or
        it was being rewritten at every try: the next report reads it)."""
        w = self.words
        for _ in range(BEAT_TRIES):
            seq = int(w[W_BEAT_SEQ])
            if seq == 0:
                return None
            if seq % 2 == 0:
                n = int(w[W_BEAT_LEN])
                raw = bytes(self._beat_area()[: min(max(n, 0), self.beat_cap)])
                if int(w[W_BEAT_SEQ]) == seq:
                    return raw
            time.sleep(0.0001)
        return None

    def payload_offset(self, slot: int) -> int:
        return self.header + slot * self.stride + self.skel_cap

    def payload(self, slot: int) -> np.ndarray:
        start = self.payload_offset(slot)
        return self._map[start : start + self.payload_nbytes].view(np.ndarray)

    def skeleton_area(self, slot: int) -> np.ndarray:
        start = self.header + slot * self.stride
        return self._map[start : start + self.skel_cap].view(np.ndarray)


class RingWriter:
    """The rank's side: copy a state into a free slot and publish it."""

    def __init__(self, path: str, bell: str | None = None):
        self.ring = RingFile(path)
        self._views: dict[int, list[torch.Tensor]] = {}
        self._last: int | None = None  # the slot published last: the next is after it
        self._bell = _open_bell(bell)

    def free_slot(self) -> int | None:
        """A slot the agent has dealt with and keeps nothing of, the oldest first."""
        r = self.ring
        start = 0 if self._last is None else self._last + 1
        for k in range(r.slots):
            i = (start + k) % r.slots
            if r.word(i, S_ACK) == r.word(i, S_SEQ) and r.word(i, S_HOLD) < 0:
                return i
        return None

    def pending(self) -> bool:
        """A published slot the agent has not dealt with yet."""
        r = self.ring
        return any(r.word(i, S_ACK) != r.word(i, S_SEQ) for i in range(r.slots))

    def views(self, slot: int) -> list[torch.Tensor]:
        views = self._views.get(slot)
        if views is None:
            buf = torch.from_numpy(self.ring.payload(slot))
            views = self._views[slot] = views_of(buf, self.ring.metas)
        return views

    def last_published(self) -> tuple[int, int] | None:
        """(generation, step) of the slot this writer published last."""
        if self._last is None:
            return None
        r = self.ring
        return r.word(self._last, S_GENERATION), r.word(self._last, S_STEP)

    def set_floor(self, generation: int, step: int) -> None:
        """The lean rule: this rank's shards of steps before `step` are no longer needed
        (every rank's shard of `step` is on every peer); the agent releases their slots,
        unless `generation` is one it fenced off."""
        word = pack_replicated(generation, step)
        if int(self.ring.words[W_FLOOR]) != word:
            self.ring.words[W_FLOOR] = word
            ring_bell(self._bell)

    def begin(self, slot: int) -> None:
        """The slot is being written: odd sequence number."""
        self.ring.set_word(slot, S_SEQ, self.ring.word(slot, S_SEQ) + 1)

    def publish(self, slot: int, step: int, generation: int, skeleton: bytes) -> None:
        r = self.ring
        if len(skeleton) > r.skel_cap:
            raise ValueError("the skeleton outgrew its ring")
        area = r.skeleton_area(slot)
        area[: len(skeleton)] = np.frombuffer(skeleton, dtype=np.uint8)
        r.set_word(slot, S_STEP, step)
        r.set_word(slot, S_SKEL_LEN, len(skeleton))
        r.set_word(slot, S_GENERATION, generation)
        r.set_word(slot, S_SEQ, r.word(slot, S_SEQ) + 1)  # even: published
        self._last = slot
        ring_bell(self._bell)

    def close(self) -> None:
        if self._bell is not None:
            with contextlib.suppress(OSError):
                os.close(self._bell)
            self._bell = None


class RingReader:
    """The agent's side of one ring."""

    def __init__(self, ring: RingFile, rank: int):
        self.ring = ring
        self.rank = rank

    def published(self) -> list[tuple[int, int, int, bytes]]:
        """(slot, step, generation, skeleton) of each slot published since the agent last
        dealt with it; each must then be held or passed over (`settle`)."""
        r, out = self.ring, []
        for i in range(r.slots):
            seq = r.word(i, S_SEQ)
            if seq % 2 or seq == r.word(i, S_ACK):
                continue  # being written, or seen
            n = r.word(i, S_SKEL_LEN)
            skeleton = bytes(r.skeleton_area(i)[:n])
            out.append((i, r.word(i, S_STEP), r.word(i, S_GENERATION), skeleton))
        return sorted(out, key=lambda x: x[1])

    def settle(self, slot: int, hold_step: int | None) -> None:
        """Dealt with: keep the slot as the shard of `hold_step`, or (None) pass it over."""
        r = self.ring
        r.set_word(slot, S_HOLD, -1 if hold_step is None else hold_step)
        r.set_word(slot, S_ACK, r.word(slot, S_SEQ))  # after hold: the rank reads ack first

    def release(self, slot: int) -> None:
        """The shard in `slot` was dropped: the rank may write the slot again."""
        self.ring.set_word(slot, S_HOLD, -1)

    def held(self) -> list[int]:
        return [i for i in range(self.ring.slots) if self.ring.word(i, S_HOLD) >= 0]

    def held_steps(self) -> list[int]:
        """The steps of the shards kept in this ring's slots, oldest first."""
        return sorted(self.ring.word(i, S_HOLD) for i in self.held())


def make_bell(path: str) -> int:
    """The node's doorbell: a FIFO the agent reads (and keeps a write end of, so it never
    sees end-of-file); returns the read end, non-blocking."""
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # held for the agent's lifetime
    return fd


def _open_bell(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None  # no agent reading: it finds the slot at its next poll


def ring_bell(fd: int | None) -> None:
    """One byte on the doorbell (a full pipe is fine: the agent is about to read it)."""
    if fd is None:
        return
    try:
        os.write(fd, b"\1")
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EPIPE):
            raise


def drain_bell(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def wait_free(writer: RingWriter, timeout_s: float) -> int | None:
    """A free slot, waiting up to `timeout_s` for the agent to release one (backpressure:
    a snapshot never overwrites a shard the agent keeps)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0002
    while True:
        slot = writer.free_slot()
        if slot is not None or writer.ring.closed or time.monotonic() > deadline:
            return slot
        time.sleep(delay)
        delay = min(delay * 2, 0.005)

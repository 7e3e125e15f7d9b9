"""Turn a nested state (state_dicts, RNG states, counters) into one flat byte buffer plus a
small skeleton, and back.

The copy into the buffer is the only part on the training step's critical path, so the
buffer is preallocated and reused: copying into existing memory runs at memory bandwidth,
allocating fresh memory every step is up to 10x slower.
"""

from __future__ import annotations

import hashlib
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stalwart.ckpt import dtensor
from stalwart.ckpt.lazy import LazyModule, is_tensor
from stalwart.ckpt.skeleton import RECHECK, SkeletonUnpickler, check, leaf_kind
from stalwart.ckpt.skeleton import dumps as skeleton_dumps

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor inside the skeleton."""

    index: int


@dataclass(frozen=True)
class TensorMeta:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str


def _split(obj: Any, tensors: list[torch.Tensor], leaves: set[type]) -> Any:
    """The skeleton of `obj`, its tensors appended to `tensors` and the types of its other
    leaves (what the allow-list judges) added to `leaves`. A DTensor's local shard is the
    tensor kept; its ShardRef says how to put it back (ckpt/dtensor.py)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and dtensor.is_dtensor(obj):
            tensors.append(dtensor.local_shard(obj))
            return dtensor.shard_ref(obj, len(tensors) - 1)
        tensors.append(obj)
        return TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        # OrderedDict stays one (state_dicts are); other dict subclasses become plain dicts.
        kind = OrderedDict if isinstance(obj, OrderedDict) else dict
        leaves.update(map(type, obj))
        return kind((k, _split(v, tensors, leaves)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_split(v, tensors, leaves) for v in obj]
    if isinstance(obj, tuple):
        # Named tuples become plain tuples: the skeleton holds built-in types only.
        return tuple(_split(v, tensors, leaves) for v in obj)
    leaves.add(leaf_kind(obj))
    return obj


Rebuild = Callable[[dtensor.ShardRef, "torch.Tensor"], Any]


def _join(obj: Any, tensors: list[torch.Tensor], rebuild: Rebuild) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dtensor.ShardRef):
        return rebuild(obj, tensors[obj.index])
    if isinstance(obj, dict):
        return type(obj)((k, _join(v, tensors, rebuild)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_join(v, tensors, rebuild) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_join(v, tensors, rebuild) for v in obj)
    return obj


_ALIGN = 64


def _layout(tensors: list[torch.Tensor]) -> tuple[tuple[TensorMeta, ...], int]:
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(
            TensorMeta(
                offset, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape), str(t.device)
            )
        )
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return tuple(metas), offset


@dataclass
class Snapshot:
    """One rank's state at one step: the skeleton (small, pickled) and the flat payload."""

    step: int
    skeleton: bytes
    metas: tuple[TensorMeta, ...]
    payload: Any  # a 1-D uint8 numpy array or torch tensor
    # adler32 of the payload, taken where it was handed over (None: not taken): a torn or
    # corrupted copy is found at the restore, not trained on.
    checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def payload_checksum(self) -> int:
        return payload_checksum(self.payload)

    def intact(self) -> bool:
        """The payload still has the checksum it was handed over with (or has none)."""
        return self.checksum is None or self.payload_checksum() == self.checksum

    def digest(self) -> str:
        """sha256 over the skeleton and each tensor's bytes (not the alignment padding)."""
        h = hashlib.sha256()
        h.update(self.skeleton)
        raw = _as_numpy(self.payload)
        for m in self.metas:
            h.update(memoryview(raw[m.offset : m.offset + m.nbytes]))
        return h.hexdigest()


def payload_checksum(payload: Any) -> int:
    """A 64-bit sum of a payload's 8-byte words (its tail bytes folded in), with its length.

    It finds what it is for, a changed byte (damaged memory, a chaos corrupt_shard) or a
    copy that stopped half-way: any change to one word changes the sum. It is not a hash
    (two words changed by opposite amounts cancel), and it costs one pass at memory speed,
    0.3 ms for 5 MB here where adler32 took 2.5 ms: it runs once per snapshot per rank.
    """
    raw = np.ascontiguousarray(_as_numpy(payload)).reshape(-1).view(np.uint8)
    whole = len(raw) // 8 * 8
    total = int(raw[:whole].view(np.uint64).sum(dtype=np.uint64)) if whole else 0
    tail = zlib.adler32(memoryview(raw[whole:])) if whole < len(raw) else 0
    return (total + (tail << 8) + len(raw)) & 0xFFFF_FFFF_FFFF_FFFF


def _as_numpy(payload: Any):
    if is_tensor(payload):
        return payload.numpy()
    return payload


class SnapshotBuffer:
    """A reusable CPU buffer that one rank's state is copied into at each snapshot."""

    def __init__(self, pin_memory: bool = False):
        self._buf: torch.Tensor | None = None
        self._pin = pin_memory
        # Views into the buffer for the last layout: the layout rarely changes (an optimizer
        # creates its state on the first step), so the views are built once, not per step.
        self._metas: tuple[TensorMeta, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._checker = Flattener()

    def capture(self, step: int, state: Any) -> Snapshot:
        flat = self._checker.flatten(state)
        total = flat.nbytes
        if self._buf is None or self._buf.numel() < total:
            self._buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=self._pin)
            self._metas = None
        buf = self._buf
        if flat.metas != self._metas:
            self._views = views_of(buf, flat.metas)
            self._metas = flat.metas
        copy_tensors(self._views, flat.tensors)
        if any(t.device.type == "cuda" for t in flat.tensors):
            torch.cuda.synchronize()
        return Snapshot(step, flat.skeleton, flat.metas, buf[:total])


@dataclass
class Flat:
    """A state taken apart: its pickled skeleton, its tensors and where each goes."""

    skeleton: bytes
    metas: tuple[TensorMeta, ...]
    tensors: list[torch.Tensor]
    nbytes: int


class Flattener:
    """Takes states apart for their snapshots, checking their skeletons' values against the
    allow-list whenever a kind of value first appears (docs/checkpoints.md, "What a
    snapshot may hold"): an unsafe state is refused now, with the value's path, rather
    than at the first restore."""

    def __init__(self) -> None:
        self._checked: set[type] = set()
        # The last layout, by its tensors' dtypes, shapes and devices: it rarely changes,
        # and building it again costs more than the comparison (0.4 ms for 119 tensors).
        self._shapes: list[tuple] | None = None
        self._layout: tuple[tuple[TensorMeta, ...], int] = ((), 0)

    def flatten(self, state: Any) -> Flat:
        tensors: list[torch.Tensor] = []
        leaves: set[type] = set()
        skeleton = _split(state, tensors, leaves)
        shapes = [(t.dtype, t.shape, t.device) for t in tensors]
        if shapes != self._shapes:
            self._layout, self._shapes = _layout(tensors), shapes
        metas, total = self._layout
        pickled = skeleton_dumps(skeleton, state)
        if not leaves <= self._checked:
            check(pickled, state, TensorRef)
            self._checked |= leaves - {RECHECK}
        return Flat(pickled, metas, tensors, total)


def views_of(buf: torch.Tensor, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
    """Views into the flat uint8 `buf`, one per tensor of the layout `metas` (built once per
    layout, not per snapshot)."""
    return [
        buf[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)
        for m in metas
    ]


def copy_tensors(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy each tensor into its view (one batched copy; GPU sources are copied without a
    synchronize: the caller decides when to wait)."""
    pairs = [(d, t.detach()) for d, t in zip(views, tensors, strict=True) if d.numel()]
    if pairs:
        dsts, srcs = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)


def restore(
    snapshot: Snapshot,
    device: torch.device | str = "cpu",
    rebuild: Rebuild = dtensor.no_meshes,
    borrow: bool = False,
) -> Any:
    """Rebuild the nested state with fresh tensors (copies, safe to keep); `rebuild` makes
    a DTensor's shard a DTensor again (dtensor.rebuilder: on the job's live meshes).
    `borrow`: a CPU tensor is a read-only view of the payload instead of a copy, valid as
    long as the payload is and never to be kept (worker/restore.py copies out of it)."""
    skeleton = SkeletonUnpickler(snapshot.skeleton, TensorRef).load()
    with warnings.catch_warnings():
        # A payload read from Ray's object store (or mapped from a node's file) is
        # read-only; a tensor below is a clone, or a view its borrower only reads.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.as_tensor(_as_numpy(snapshot.payload))
    tensors = []
    for m in snapshot.metas:
        dtype = getattr(torch, m.dtype)
        target = m.device if m.device.startswith("cpu") else device
        if m.nbytes == 0:
            t = torch.empty(m.shape, dtype=dtype)
        else:
            t = raw[m.offset : m.offset + m.nbytes].view(dtype).view(m.shape)
            # A copy to another device is a copy already.
            if not borrow and torch.device(target).type == "cpu":
                t = t.clone()
        tensors.append(t.to(target))
    return _join(skeleton, tensors, rebuild)


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict in sorted key order: name, dtype, shape, bytes. A DTensor
    counts as its full tensor (gathered from its shards, a collective every rank of its
    mesh makes in this same order), so a sharded model's digest is the digest of the same
    model unsharded, whatever the world size."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = dtensor.full_tensor(state_dict[name]).detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def nested_digest(state: Any) -> str:
    """sha256 over any state dict (an optimizer's, nested): every tensor's path, dtype,
    shape and bytes (a DTensor's full tensor, as in state_digest), every other leaf's path
    and repr, in a fixed order."""
    h = hashlib.sha256()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = dtensor.full_tensor(obj).detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, np.ndarray):  # its repr elides long arrays
            h.update(f"{path}:{obj.dtype}:{obj.shape}".encode())
            h.update(np.ascontiguousarray(obj).tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=repr):
                walk(obj[key], f"{path}/{key!r}")
        elif isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
        else:
            h.update(f"{path}={obj!r}".encode())

    walk(state, "")
    return h.hexdigest()

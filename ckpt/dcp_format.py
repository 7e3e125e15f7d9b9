"""A durable step as a DCP checkpoint (``torch.distributed.checkpoint``'s format): what each
rank's node writes from its memory, and DCP's index of the whole step.

A step directory holds ``__R_0.distcp`` per rank R (DCP's file names; ``__R_0.genG.distcp``
when a job's generation G wrote it, so a generation a recovery fenced off, still writing,
never overwrites a file another generation's manifest lists), ``.metadata`` (DCP's index,
pickled, as torch writes it) and stalwart's ``manifest.json`` (ckpt/manifest.py).
Inside a rank's file every blob is what DCP's file system writer writes: a tensor's
``torch.save`` bytes, or a value's; DCP's reader finds them through ``.metadata``.

What is under which key (DCP FQNs, flattened the way ``dcp.save`` flattens a nested state):

* An object registered under NAME whose state holds DTensor shards (a model sharded with
  FSDP2 and its optimizer, keyed by FQN: ckpt/fsdp.py) is written as ``dcp.save({NAME:
  state})`` would: ``NAME.<path>``. A DTensor shard is a chunk of its global tensor at its
  offset, written once, by the rank first along the mesh's replicate dimensions (HSDP's
  replicas hold the same chunk); its other tensors and values are written by rank 0. So
  ``dcp.load({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m,
  o)}, checkpoint_id=STEP_DIR)`` loads it, at any world size, without stalwart.
* Every other tensor of rank R's snapshot (its RNG states, a DDP model, ZeRO's shard, a
  data position) is in ``stalwart.rank<R>``, one flat uint8 tensor holding them one after
  another: state that is the rank's own, which only stalwart restores (one blob, not one
  ``torch.save`` per tensor: 69 of them cost a small DDP rank 8 ms to write instead of 1).

Nothing is written that only stalwart can read: the skeleton that puts a rank's tensors
back into its snapshot (and its other values) is in the manifest, as JSON and base64.
Why not ``dcp.save``/``async_save`` on the ranks: they stage and write on the training
processes, collectively; here each node writes the committed step from its memory, off the
training path, and the supervisor makes the index, as DCP's coordinator would.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import re
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stalwart.ckpt.dtensor import ShardRef
from stalwart.ckpt.lazy import LazyModule
from stalwart.ckpt.manifest import Location, RankLayout, meta_from_json, meta_to_json
from stalwart.ckpt.skeleton import SkeletonUnpickler
from stalwart.ckpt.snapshot import Snapshot, TensorMeta, TensorRef

if TYPE_CHECKING:
    import torch
else:  # the supervisor and the node agents import this module and start without torch
    torch = LazyModule("torch")

PER_RANK = "stalwart"
METADATA_NAME = ".metadata"


class CheckpointMismatch(ValueError):
    """A DCP checkpoint does not hold what the state being loaded needs (another model)."""


def load_blob(blob: bytes) -> Any:
    """A blob's value: torch.load without running a checkpoint's code."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def shard_signature(skeleton: bytes) -> str | None:
    """What identifies the DTensor chunks a rank's snapshot holds (their meshes, offsets and
    shapes), or None when it holds none: ranks with the same signature hold the same shards
    (HSDP's replicate dimension), which replica placement keeps apart (ckpt/replicas.py)."""
    refs: list[ShardRef] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, ShardRef):
            refs.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk(SkeletonUnpickler(skeleton, TensorRef).load())
    if not refs:
        return None
    text = repr([(r.mesh, r.placements, r.shape, r.offset) for r in refs])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def rank_file(rank: int, generation: int | None = None) -> str:
    """Rank `rank`'s data file, named as DCP's file system writer names it, with the
    generation that writes it when known (DCP's reader finds files through ``.metadata``,
    whatever their names)."""
    if generation is None:
        return f"__{rank}_0.distcp"
    return f"__{rank}_0.gen{generation}.distcp"


def file_generation(name: str) -> int | None:
    """The generation a rank's data file names (`rank_file`), None when it names none."""
    m = _GEN_FILE.fullmatch(name)
    return int(m.group(1)) if m else None


_GEN_FILE = re.compile(r"__\d+_0\.gen(\d+)\.distcp")


@dataclass
class Item:
    """One blob a rank writes: a DTensor's chunk, a whole tensor, or a value."""

    key: str
    kind: str  # "chunk" | "tensor" | "bytes"
    index: int | None = None  # the tensor's in the snapshot
    value: Any = None  # a "bytes" item's
    size: tuple[int, ...] | None = None  # a chunk's global tensor
    offsets: tuple[int, ...] | None = None  # a chunk's place in it


@dataclass
class RankPlan:
    items: list[Item]
    # per tensor of the snapshot: ("item", i) written here as items[i]; ("own", start) at
    # byte `start` of this rank's own blob; or ("chunk", key, offsets) written by the rank
    # that is first along the replicate dimensions
    refs: list[tuple]
    own: list[int] = field(default_factory=list)  # the tensors in the rank's own blob
    planner_data: dict[str, tuple] = field(default_factory=dict)
    sharded: bool = False


def _has_shards(obj: Any) -> bool:
    if isinstance(obj, ShardRef):
        return True
    if isinstance(obj, dict):
        return any(_has_shards(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_shards(v) for v in obj)
    return False


def plan_rank(snapshot: Snapshot, rank: int) -> RankPlan:
    """What rank `rank` writes of `snapshot`, in order (see the module doc)."""
    skeleton = SkeletonUnpickler(snapshot.skeleton, TensorRef).load()
    items: list[Item] = []
    refs: list[tuple | None] = [None] * len(snapshot.metas)
    plan = RankPlan(items, refs)  # type: ignore[arg-type]
    objects = skeleton.get("objects", {}) if isinstance(skeleton, dict) else {}
    for name, state in objects.items():
        if not _has_shards(state):
            continue
        # torch.distributed.checkpoint: 0.5 s to import, only where there is sharded state
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        plan.sharded = True
        flat, mapping = flatten_state_dict({name: state})
        for key, leaf in flat.items():
            plan.planner_data[key] = mapping[key]
            if isinstance(leaf, ShardRef):
                refs[leaf.index] = ("chunk", key, leaf.offset)
                if leaf.primary:
                    items.append(
                        Item(key, "chunk", leaf.index, size=leaf.shape, offsets=leaf.offset)
                    )
            elif rank == 0 and isinstance(leaf, TensorRef):
                refs[leaf.index] = ("item", len(items))
                items.append(Item(key, "tensor", leaf.index))
            elif rank == 0:
                items.append(Item(key, "bytes", value=leaf))
    start = 0
    for i, ref in enumerate(refs):
        if ref is None:
            refs[i] = ("own", start)
            plan.own.append(i)
            start += snapshot.metas[i].nbytes
    if plan.own:
        key = f"{PER_RANK}.rank{rank}"
        plan.planner_data[key] = (PER_RANK, f"rank{rank}")
        items.append(Item(key, "own", size=(start,)))
    return plan


def _tensor(raw: np.ndarray, m: TensorMeta) -> torch.Tensor:
    """The tensor `m` describes in the flat payload `raw`, sharing only its own bytes (so
    that torch.save writes those, not the whole payload)."""
    dtype = getattr(torch, m.dtype)
    if m.nbytes == 0:
        return torch.empty(m.shape, dtype=dtype)
    with warnings.catch_warnings():
        # A payload read from Ray's object store is read-only; nothing writes through it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(raw[m.offset : m.offset + m.nbytes])
    return flat.view(dtype).view(m.shape)


def _own_blob(raw: np.ndarray, metas: tuple[TensorMeta, ...], own: list[int]) -> torch.Tensor:
    """A rank's own tensors' bytes one after another, as one flat uint8 tensor."""
    parts = [raw[metas[i].offset : metas[i].offset + metas[i].nbytes] for i in own]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.uint8))


def _save(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def write_rank(
    write: Callable[[bytes], Any],
    snapshot: Snapshot,
    plan: RankPlan,
    rank: int,
    generation: int | None = None,
) -> dict[str, Any]:
    """Write rank `rank`'s blobs of `snapshot` through `write` (one file, in order); returns
    what the supervisor needs of them for the manifest and DCP's index (plain values)."""
    from stalwart.ckpt.snapshot import _as_numpy

    raw = np.ascontiguousarray(_as_numpy(snapshot.payload)).reshape(-1).view(np.uint8)
    name, pos, whole = rank_file(rank, generation), 0, hashlib.sha256()
    entries: dict[str, Any] = {}
    where: list[Location] = []
    own_at: Location | None = None
    for item in plan.items:
        if item.kind == "bytes":
            blob = _save(item.value)
        elif item.kind == "own":
            blob = _save(_own_blob(raw, snapshot.metas, plan.own))
        else:
            blob = _save(_tensor(raw, snapshot.metas[item.index]))
        write(blob)
        whole.update(blob)
        at = Location(name, pos, len(blob), hashlib.sha256(blob).hexdigest())
        where.append(at)
        pos += len(blob)
        if item.kind == "bytes":
            entries[item.key] = {"kind": "bytes", "at": at.to_list()}
            continue
        if item.kind == "own":
            own_at = at
            entries[item.key] = {
                "kind": "tensor",
                "dtype": "uint8",
                "size": list(item.size),
                "chunks": [{"offsets": [0], "sizes": list(item.size), "at": at.to_list()}],
            }
            continue
        m = snapshot.metas[item.index]
        size = list(item.size) if item.size is not None else list(m.shape)
        offsets = list(item.offsets) if item.offsets is not None else [0] * len(m.shape)
        entries[item.key] = {
            "kind": "tensor",
            "dtype": m.dtype,
            "size": size,
            "chunks": [{"offsets": offsets, "sizes": list(m.shape), "at": at.to_list()}],
        }
    refs = []
    for i, r in enumerate(plan.refs):
        if r[0] == "item":
            refs.append(["at", where[r[1]].to_list()])
        elif r[0] == "own":
            part = Location(*own_at.to_list(), part=(r[1], snapshot.metas[i].nbytes))
            refs.append(["at", part.to_list()])
        else:
            refs.append(["chunk", r[1], list(r[2])])
    return {
        "rank": rank,
        "record": {"rank": rank, "file": name, "nbytes": pos, "sha256": whole.hexdigest()},
        "entries": entries,
        "planner_data": {k: list(v) for k, v in plan.planner_data.items()},
        "layout": {
            "skeleton": base64.b64encode(bytes(snapshot.skeleton)).decode("ascii"),
            "metas": [meta_to_json(m) for m in snapshot.metas],
            "refs": refs,
        },
        "sharded": plan.sharded,
    }


def merge(writes: list[dict[str, Any]]) -> tuple[dict, dict, list[RankLayout], bool]:
    """Every rank's write -> (DCP's entries, its planner data, the ranks' layouts in rank
    order, whether the state is sharded). ValueError when the ranks disagree on a tensor
    or a shard's chunk was written by no rank."""
    entries: dict[str, Any] = {}
    planner: dict[str, list] = {}
    for w in sorted(writes, key=lambda w: w["rank"]):
        planner.update(w["planner_data"])
        for key, e in w["entries"].items():
            have = entries.get(key)
            if have is None:
                entries[key] = {**e, "chunks": list(e["chunks"])} if e["kind"] == "tensor" else e
            elif e["kind"] == "tensor" and have["kind"] == "tensor":
                if (have["dtype"], have["size"]) != (e["dtype"], e["size"]):
                    raise ValueError(
                        f"{key}: rank {w['rank']} holds a {e['dtype']} tensor of {e['size']}, "
                        f"another rank a {have['dtype']} tensor of {have['size']}"
                    )
                have["chunks"] += e["chunks"]
    layouts = []
    for w in sorted(writes, key=lambda w: w["rank"]):
        lay = w["layout"]
        tensors = []
        for i, ref in enumerate(lay["refs"]):
            if ref[0] == "at":
                tensors.append(Location.from_list(ref[1], f"rank {w['rank']} tensor {i}"))
                continue
            _, key, offsets = ref
            chunk = next(
                (c for c in entries.get(key, {}).get("chunks", ()) if c["offsets"] == offsets),
                None,
            )
            if chunk is None:
                raise ValueError(
                    f"{key} at {offsets}: rank {w['rank']}'s shard was written by no rank"
                )
            tensors.append(Location.from_list(chunk["at"], key))
        layouts.append(
            RankLayout(
                base64.b64decode(lay["skeleton"]),
                tuple(meta_from_json(m, 1 << 62) for m in lay["metas"]),
                tuple(tensors),
            )
        )
    return entries, planner, layouts, any(w["sharded"] for w in writes)


def dcp_metadata(entries: dict[str, Any], planner_data: dict[str, list], checkpoint_id: str):
    """torch's Metadata (what ``.metadata`` holds) for a step's `entries`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, e in entries.items():
        if e["kind"] == "bytes":
            state[key] = BytesStorageMetadata()
            file, offset, length, _ = e["at"]
            storage[MetadataIndex(key)] = _StorageInfo(file, offset, length)
            continue
        chunks = []
        for i, c in enumerate(e["chunks"]):
            chunks.append(ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])))
            file, offset, length, _ = c["at"]
            storage[MetadataIndex(key, torch.Size(c["offsets"]), i)] = _StorageInfo(
                file, offset, length
            )
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, e["dtype"])), torch.Size(e["size"]), chunks
        )
    return Metadata(
        state,
        planner_data={k: tuple(v) for k, v in planner_data.items()},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
    )


def metadata_bytes(entries: dict[str, Any], planner_data: dict[str, list], where: str) -> bytes:
    """``.metadata``'s content, as DCP's writer makes it (a pickle of torch's Metadata: DCP's
    reader unpickles it; stalwart reads its own steps' index from the manifest instead)."""
    return pickle.dumps(dcp_metadata(entries, planner_data, where))


def layout_blobs(
    read: Callable[[str, int, int], bytes], tensors: Iterable[Location], where: str
) -> list[bytes]:
    """The blob of each of `tensors` (a rank layout's), each read once (several tensors are
    parts of one) and checked against its sha256, grouped by file and read in order."""
    wanted = list(tensors)
    blobs: dict[tuple[str, int], bytes] = {}
    by_file: dict[str, list[Location]] = defaultdict(list)
    for at in wanted:
        by_file[at.file].append(at)
    for file, ats in by_file.items():
        for at in sorted(ats, key=lambda a: a.offset):
            if (file, at.offset) in blobs:
                continue
            blob = read(file, at.offset, at.length)
            if hashlib.sha256(blob).hexdigest() != at.sha256:
                raise CheckpointMismatch(
                    f"{where}: a tensor in {file} is corrupt (sha256 mismatch)"
                )
            blobs[(file, at.offset)] = blob
    return [blobs[(at.file, at.offset)] for at in wanted]


def rebuild_snapshot(
    step: int, layout: RankLayout, read: Callable[[str, int, int], bytes], where: str
) -> Snapshot:
    """A rank's snapshot from a DCP step: its tensors' blobs (each checked against its
    sha256) copied into a payload laid out as when it was captured. CheckpointMismatch
    says what is wrong."""
    blobs = layout_blobs(read, layout.tensors, where)
    loaded: dict[int, Any] = {}  # id of a blob -> its tensor (a rank's own blob: once)
    payload = np.zeros(layout.payload_nbytes, dtype=np.uint8)
    for i, (m, at, blob) in enumerate(zip(layout.metas, layout.tensors, blobs, strict=True)):
        try:
            t = loaded.get(id(blob))
            if t is None:
                t = loaded[id(blob)] = load_blob(blob)
        except Exception as e:  # not a tensor's torch.save bytes
            raise CheckpointMismatch(f"tensor {i} does not load ({e})") from None
        if not isinstance(t, torch.Tensor):
            raise CheckpointMismatch(f"tensor {i} is not a tensor")
        if at.part is not None:
            start, nbytes = at.part
            if t.dtype != torch.uint8 or start + nbytes > t.numel() or nbytes != m.nbytes:
                raise CheckpointMismatch(f"tensor {i} is not where its layout says")
            flat = t[start : start + nbytes].numpy()
        elif str(t.dtype).removeprefix("torch.") != m.dtype or tuple(t.shape) != m.shape:
            raise CheckpointMismatch(f"tensor {i} is not the one laid out")
        else:
            flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        if m.nbytes:
            payload[m.offset : m.offset + m.nbytes] = flat
    return Snapshot(step, layout.skeleton, layout.metas, payload)

"""Reading DCP checkpoints without running a checkpoint's code: stalwart's own durable steps
(ckpt/dcp_format.py) and any DCP directory (a torchrun or torchtitan job's, for
``checkpoint.init_from``), into the state the loop built (ckpt/reshard.py does the loading).

DCP's own reader unpickles ``.metadata`` and, in the default planner, every value blob
(``torch.load(weights_only=False)``). Here instead:

* a stalwart step's index comes from its manifest's JSON (no ``.metadata`` at all); a
  foreign directory's ``.metadata`` is unpickled with an allow-list of DCP's metadata
  classes, torch's sizes and dtypes and paths (`read_foreign_metadata`);
* tensors are ``torch.load(weights_only=True)``, and values too (`SafeLoadPlanner`);
* every blob a stalwart manifest lists is checked against its sha256 as it is read.

`MemoryReader` is the same reader over snapshots in the nodes' memory (an elastic resize
of a sharded job: the old world's shards, fetched from the agents that hold them).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from stalwart.ckpt.dcp_format import CheckpointMismatch, dcp_metadata, load_blob
from stalwart.ckpt.snapshot import Snapshot

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f".metadata refers to {module}.{name}, refused")


def read_foreign_metadata(data: bytes, where: str) -> Metadata:
    """A DCP directory's ``.metadata`` (not stalwart's), unpickled with the allow-list."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointMismatch(f"{where}: not a DCP checkpoint's metadata ({e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointMismatch(f"{where}: .metadata holds a {type(metadata).__name__}")
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its values loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start or length != t.shape[dim]:
            t = t.narrow(dim, start, length)
    return t


class _Reader(StorageReader):
    """What the readers share: the index (`metadata`) and where each item comes from:
    `fetch(storage indices) -> {index: blob bytes, or the tensor itself}`."""

    def __init__(
        self, metadata: Metadata, fetch: Callable[[list[Any]], dict[Any, bytes | torch.Tensor]]
    ):
        super().__init__()
        self.metadata = metadata
        self._fetch = fetch

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **kw) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        blobs = self._fetch([req.storage_index for req in plan.items])
        for req in plan.items:
            blob = blobs[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(blob))
                continue
            whole = blob if isinstance(blob, torch.Tensor) else load_blob(blob)
            tensor = _narrow(whole, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointMismatch(
                    f"{req.storage_index.fqn}: the checkpoint's piece is {tuple(tensor.size())}, "
                    f"the state being loaded wants {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class StepReader(_Reader):
    """A DCP step directory read through `read(file, offset, length) -> bytes` (the durable
    store's, with its retries). With `entries` (a stalwart manifest's DCP index) every blob
    is checked against its sha256; else `metadata` is a foreign directory's."""

    def __init__(
        self,
        read: Callable[[str, int, int], bytes],
        where: str,
        *,
        entries: dict[str, Any] | None = None,
        planner_data: dict[str, list] | None = None,
        metadata: Metadata | None = None,
    ):
        shas: dict[tuple[str, int], str] = {}
        if entries is not None:
            metadata = dcp_metadata(entries, planner_data or {}, where)
            for e in entries.values():
                for at in [e["at"]] if e["kind"] == "bytes" else [c["at"] for c in e["chunks"]]:
                    shas[(at[0], at[1])] = at[3]
        assert metadata is not None
        self.where = where

        def fetch(indices: list[Any]) -> dict[Any, bytes]:
            out = {}
            for index in indices:
                info = metadata.storage_data[index]
                blob = read(info.relative_path, info.offset, info.length)
                want = shas.get((info.relative_path, info.offset))
                if want is not None and hashlib.sha256(blob).hexdigest() != want:
                    raise CheckpointMismatch(
                        f"{where}: {index.fqn}'s bytes in {info.relative_path} are corrupt "
                        "(sha256 mismatch)"
                    )
                out[index] = blob
            return out

        super().__init__(metadata, fetch)


class MemoryReader(_Reader):
    """The sharded objects of a step in the nodes' memory, as a DCP checkpoint: `layouts`
    are the old world's ranks' (skeleton, metas) by rank, `fetch(rank)` that rank's whole
    snapshot, fetched only when a chunk this rank needs is in it, each once. What goes
    under which key is what a durable step of them would hold (dcp_format.plan_rank)."""

    def __init__(self, layouts: dict[int, tuple[bytes, tuple]], fetch: Callable[[int], Snapshot]):
        from stalwart.ckpt.dcp_format import PER_RANK, plan_rank

        entries: dict[str, Any] = {}
        planner: dict[str, list] = {}
        items: dict[tuple[str, int], tuple[int, Any]] = {}  # (file, offset) -> (rank, item)
        first = min(layouts) if layouts else 0
        for rank, (skeleton, metas) in sorted(layouts.items()):
            # The lowest rank writes what is not sharded, as rank 0 does (plan_rank).
            plan = plan_rank(Snapshot(-1, skeleton, metas, None), rank - first)
            for pos, item in enumerate(plan.items):
                if item.key.startswith(PER_RANK + "."):
                    continue  # the rank's own state: restored from its own snapshot
                planner[item.key] = list(plan.planner_data[item.key])
                at = [f"rank{rank}", pos, 0, "0" * 64]
                items[(at[0], pos)] = (rank, item)
                if item.kind == "bytes":
                    entries.setdefault(item.key, {"kind": "bytes", "at": at})
                    continue
                m = metas[item.index]
                e = entries.setdefault(
                    item.key,
                    {
                        "kind": "tensor",
                        "dtype": m.dtype,
                        "size": list(item.size or m.shape),
                        "chunks": [],
                    },
                )
                offsets = list(item.offsets or [0] * len(m.shape))
                if all(c["offsets"] != offsets for c in e["chunks"]):
                    e["chunks"].append({"offsets": offsets, "sizes": list(m.shape), "at": at})
        self.ranks_read: set[int] = set()
        snapshots: dict[int, Snapshot] = {}

        def fetch_items(indices: list[Any]) -> dict[Any, bytes | torch.Tensor]:
            from stalwart.ckpt.dcp_format import _save, _tensor
            from stalwart.ckpt.snapshot import _as_numpy

            out: dict[Any, bytes | torch.Tensor] = {}
            for index in indices:
                info = self.metadata.storage_data[index]
                rank, item = items[(info.relative_path, info.offset)]
                if item.kind == "bytes":
                    out[index] = _save(item.value)
                    continue
                if rank not in snapshots:
                    snapshots[rank] = fetch(rank)
                    self.ranks_read.add(rank)
                snap = snapshots[rank]
                out[index] = _tensor(_as_numpy(snap.payload).reshape(-1), snap.metas[item.index])
            return out

        super().__init__(dcp_metadata(entries, planner, "memory"), fetch_items)

"""A durable checkpoint's manifest (``manifest.json``, written last: it is what makes a step
complete) and the errors of the durable tier.

Two formats are read:

* ``stalwart-manifest-2`` (written since issue 22): the step directory is a DCP checkpoint
  (ckpt/dcp_format.py). ``shards`` lists each rank's data file with its size and sha256;
  ``layouts`` holds, per rank, what rebuilds its snapshot exactly (the skeleton, the tensor
  layout and where each tensor's bytes are, with their sha256); ``dcp`` holds DCP's index of
  the whole checkpoint as JSON (what ``.metadata`` holds pickled, so that stalwart reads
  its own checkpoints without unpickling anything) and the ``.metadata`` file's sha256.
* ``stalwart-manifest-1``: one safetensors file per rank holding its flat snapshot
  (ckpt/legacy_shard.py), still read to resume older jobs.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stalwart.ckpt.lazy import LazyModule
from stalwart.ckpt.snapshot import TensorMeta

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

MANIFEST_FORMAT = "stalwart-manifest-2"
MANIFEST_FORMAT_V1 = "stalwart-manifest-1"
MANIFEST_NAME = "manifest.json"

_SHA256 = re.compile(r"[0-9a-f]{64}")
_ANY_SIZE = 1 << 62  # a layout's payload is as large as its tensors make it


class DurableError(Exception):
    """A write or read failed after retries (message names the path and the cause)."""


class CorruptCheckpoint(Exception):
    """A checkpoint failed verification: ``step`` is the step, ``reason`` what is wrong,
    ``where`` its step directory."""

    def __init__(self, step: int, reason: str, where: str = ""):
        super().__init__(step, reason, where)
        self.step = step
        self.reason = reason
        self.where = where

    def __str__(self) -> str:
        place = self.where or f"step-{self.step:012d}"
        return f"checkpoint step {self.step} ({place}) is unusable: {self.reason}"


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    file: str  # relative to the step directory
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Location:
    """Where one blob (a tensor's torch.save bytes, a value's) lies in the step directory;
    with `part`, the tensor is bytes part[0]..part[0]+part[1] of the blob's (a flat uint8
    tensor holding several of a rank's own tensors)."""

    file: str
    offset: int
    length: int
    sha256: str
    part: tuple[int, int] | None = None

    def to_list(self) -> list[Any]:
        out: list[Any] = [self.file, self.offset, self.length, self.sha256]
        return out + list(self.part) if self.part is not None else out

    @classmethod
    def from_list(cls, value: Any, where: str) -> Location:
        if (
            not isinstance(value, list)
            or len(value) not in (4, 6)
            or not isinstance(value[0], str)
            or not all(_natural(v) for v in (*value[1:3], *value[4:]))
            or not (isinstance(value[3], str) and _SHA256.fullmatch(value[3]))
        ):
            raise ValueError(f"{where} is not a [file, offset, length, sha256] location")
        part = (value[4], value[5]) if len(value) == 6 else None
        return cls(value[0], value[1], value[2], value[3], part)


@dataclass(frozen=True)
class RankLayout:
    """What rebuilds one rank's snapshot from a DCP step: its skeleton, its tensors' layout
    in the snapshot's flat buffer, and where each tensor's bytes are stored."""

    skeleton: bytes
    metas: tuple[TensorMeta, ...]
    tensors: tuple[Location, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "skeleton": base64.b64encode(self.skeleton).decode("ascii"),
            "metas": [meta_to_json(m) for m in self.metas],
            "tensors": [t.to_list() for t in self.tensors],
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> RankLayout:
        if not isinstance(doc, dict):
            raise ValueError(f"{where} is not an object")
        try:
            skeleton = base64.b64decode(_field(doc, "skeleton", str, f"{where}."), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}.skeleton is not base64") from None
        metas = _field(doc, "metas", list, f"{where}.")
        tensors = _field(doc, "tensors", list, f"{where}.")
        if len(metas) != len(tensors):
            raise ValueError(f"{where}: {len(metas)} tensors laid out, {len(tensors)} stored")
        return cls(
            skeleton,
            tuple(meta_from_json(m, _ANY_SIZE) for m in metas),
            tuple(Location.from_list(t, f"{where}.tensors[{i}]") for i, t in enumerate(tensors)),
        )

    @property
    def payload_nbytes(self) -> int:
        return max((m.offset + m.nbytes for m in self.metas), default=0)


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    created_at: float
    extra: dict = field(default_factory=dict)
    # Format 2 (a DCP step): per rank (in rank order) and DCP's own index; () / None in 1.
    layouts: tuple[RankLayout, ...] = ()
    dcp: dict | None = None
    sharded: bool = False  # some rank held DTensor shards: readable at another world size

    @property
    def format(self) -> str:
        return MANIFEST_FORMAT if self.dcp is not None else MANIFEST_FORMAT_V1

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "format": self.format,
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "shards": [
                {"rank": s.rank, "file": s.file, "nbytes": s.nbytes, "sha256": s.sha256}
                for s in self.shards
            ],
            "created_at": self.created_at,
            "extra": self.extra,
        }
        if self.dcp is not None:
            doc["sharded"] = self.sharded
            doc["layouts"] = [layout.to_json() for layout in self.layouts]
            doc["dcp"] = self.dcp
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest; ValueError says what is wrong with it."""
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        fmt = doc.get("format")
        if fmt not in (MANIFEST_FORMAT, MANIFEST_FORMAT_V1):
            raise ValueError(
                f"format is {fmt!r}, expected {MANIFEST_FORMAT!r} (or {MANIFEST_FORMAT_V1!r})"
            )
        job = _field(doc, "job", str)
        step = _field(doc, "step", int)
        world_size = _field(doc, "world_size", int)
        created_at = _field(doc, "created_at", (int, float))
        extra = _field(doc, "extra", dict)
        shards = []
        for i, s in enumerate(_field(doc, "shards", list)):
            if not isinstance(s, dict):
                raise ValueError(f"shards[{i}] is not an object")
            sha = _field(s, "sha256", str, f"shards[{i}].")
            if not _SHA256.fullmatch(sha):
                raise ValueError(f"shards[{i}].sha256 is not a sha256 hex digest")
            shards.append(
                ShardRecord(
                    _field(s, "rank", int, f"shards[{i}]."),
                    _field(s, "file", str, f"shards[{i}]."),
                    _field(s, "nbytes", int, f"shards[{i}]."),
                    sha,
                )
            )
        if fmt == MANIFEST_FORMAT_V1:
            return cls(job, step, world_size, tuple(shards), float(created_at), extra)
        layouts = tuple(
            RankLayout.from_json(d, f"layouts[{i}]")
            for i, d in enumerate(_field(doc, "layouts", list))
        )
        if len(layouts) != world_size:
            raise ValueError(f"{len(layouts)} rank layouts for a world of {world_size}")
        dcp = _field(doc, "dcp", dict)
        for key in ("metadata", "entries", "planner_data"):
            _field(dcp, key, dict, "dcp.")
        sharded = _field(doc, "sharded", bool)
        return cls(
            job, step, world_size, tuple(shards), float(created_at), extra, layouts, dcp, sharded
        )


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _field(doc: dict, key: str, kind, prefix: str = "") -> Any:
    if key not in doc:
        raise ValueError(f"{prefix}{key} is missing")
    value = doc[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{prefix}{key} is {value!r}, of the wrong type")
        return value
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{prefix}{key} is {value!r}, of the wrong type")
    return value


def meta_to_json(m: TensorMeta) -> dict[str, Any]:
    return {
        "offset": m.offset,
        "nbytes": m.nbytes,
        "dtype": m.dtype,
        "shape": list(m.shape),
        "device": m.device,
    }


def meta_from_json(d: Any, size: int) -> TensorMeta:
    """A tensor's place in a payload of `size` bytes; ValueError says what is wrong."""
    if not isinstance(d, dict) or set(d) != {"offset", "nbytes", "dtype", "shape", "device"}:
        raise ValueError(f"entry {d!r} is not a tensor description")
    ints = [d["offset"], d["nbytes"], *(d["shape"] if isinstance(d["shape"], list) else [None])]
    if any(not _natural(i) for i in ints):
        raise ValueError(f"entry {d!r} has a bad offset, size or shape")
    dtype = getattr(torch, d["dtype"], None) if isinstance(d["dtype"], str) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(d["device"], str):
        raise ValueError(f"entry {d!r} has a bad dtype or device")
    if d["nbytes"] != math.prod(d["shape"]) * dtype.itemsize:
        raise ValueError(f"entry {d!r}: size does not match shape and dtype")
    if d["offset"] + d["nbytes"] > size:
        raise ValueError(f"entry {d!r} reaches past the payload's {size} bytes")
    return TensorMeta(d["offset"], d["nbytes"], d["dtype"], tuple(d["shape"]), d["device"])

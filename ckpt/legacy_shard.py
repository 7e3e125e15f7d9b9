"""The shard file of durable format 1 (``stalwart-manifest-1``), still read to resume older
jobs: a valid safetensors file holding one tensor, ``payload`` (dtype U8, the snapshot's
flat buffer), whose ``__metadata__`` carries the format tag (``stalwart-shard-1``), the job,
step and rank, the pickled skeleton (base64) and the tensor layout (JSON). Any safetensors
reader can open it; restoring it needs only this module and ``ckpt.snapshot`` (the
skeleton goes through the allow-listed unpickler; ``torch.load`` is never used).
New checkpoints are DCP steps (ckpt/dcp_format.py); this writer stays for the tests that
make old checkpoints to read."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json

import numpy as np

from stalwart.ckpt.hashed_io import CHUNK, flat_bytes, hash_rest, read_into
from stalwart.ckpt.manifest import meta_from_json, meta_to_json
from stalwart.ckpt.snapshot import Snapshot

SHARD_FORMAT = "stalwart-shard-1"
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def shard_header(job: str, step: int, rank: int, snapshot: Snapshot, size: int) -> bytes:
    header = {
        "payload": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]},
        "__metadata__": {
            "format": SHARD_FORMAT,
            "job": job,
            "step": str(step),
            "rank": str(rank),
            "skeleton": base64.b64encode(bytes(snapshot.skeleton)).decode("ascii"),
            "metas": json.dumps([meta_to_json(m) for m in snapshot.metas], separators=(",", ":")),
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def parse_shard(job: str, step: int, rank: int, header: bytes, payload: np.ndarray) -> Snapshot:
    """The snapshot in a shard file's header and payload; ValueError says what is wrong
    (completing "rank R's shard FILE ...")."""
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"has an unparsable header ({e})") from None
    if not isinstance(doc, dict) or set(doc) != {"payload", "__metadata__"}:
        raise ValueError("has a header other than a stalwart shard's")
    meta, tensor = doc["__metadata__"], doc["payload"]
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"has format {fmt!r}, expected {SHARD_FORMAT!r}")
    size = len(payload)
    expected = {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}
    if tensor != expected:
        raise ValueError(f"describes its payload as {tensor!r}, expected {expected!r}")
    for key, want in (("job", job), ("step", str(step)), ("rank", str(rank))):
        if meta.get(key) != want:
            raise ValueError(f"says {key} {meta.get(key)!r}, expected {want!r}")
    try:
        skeleton = base64.b64decode(meta.get("skeleton", ""), validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ValueError("has an undecodable skeleton") from None
    try:
        metas = tuple(meta_from_json(d, size) for d in json.loads(meta.get("metas", "")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"has an invalid tensor layout ({e})") from None
    return Snapshot(step, skeleton, metas, payload)


def write_shard_file(f, job: str, step: int, rank: int, snapshot: Snapshot) -> tuple[int, str]:
    """Write `snapshot` as rank `rank`'s shard file to `f`: (its size, its sha256)."""
    data = flat_bytes(snapshot.payload)
    header = shard_header(job, step, rank, snapshot, len(data))
    h = hashlib.sha256()
    for piece in (len(header).to_bytes(8, "little"), header):
        f.write(piece)
        h.update(piece)
    for pos in range(0, len(data), CHUNK):
        chunk = data[pos : pos + CHUNK]
        f.write(chunk)
        h.update(chunk)
    return 8 + len(header) + len(data), h.hexdigest()


def read_shard_file(f, nbytes: int) -> tuple[bytes | None, np.ndarray | None, int, str]:
    """(header, payload, bytes read, sha256 of them) of a shard file said to be `nbytes`
    long; header and payload are None where the header's length cannot be right."""
    h = hashlib.sha256()
    head = bytearray(8)
    got = read_into(f, memoryview(head), h)
    n = int.from_bytes(head, "little")
    if got == 8 and n <= min(nbytes - 8, MAX_HEADER):
        header = bytearray(n)
        got += read_into(f, memoryview(header), h)
        payload = np.empty(max(nbytes - 8 - n, 0), dtype=np.uint8)
        got += read_into(f, memoryview(payload), h)
        got += hash_rest(f, h)
        return bytes(header), payload, got, h.hexdigest()
    got += hash_rest(f, h)  # a header length that cannot be right: hash the rest to say why
    return None, None, got, h.hexdigest()

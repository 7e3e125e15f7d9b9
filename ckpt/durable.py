"""The durable checkpoint tier: checkpoints on a local path or any fsspec URL (s3://, gs://,
memory://, ...), which outlive every node of the job.

Layout under ``<uri>/<job>/``::

    step-000000000040/
        rank-00000.safetensors    one file per rank, written by that rank's store
        rank-00001.safetensors
        manifest.json             written last, once every shard is in place

A shard file is a valid safetensors file holding one tensor, ``payload`` (dtype U8, the
snapshot's flat buffer); its ``__metadata__`` carries the format tag
(``stalwart-shard-1``), the job, step and rank, the pickled skeleton (base64) and the tensor
layout (JSON). Any safetensors reader can open it; ``restore`` needs only this module and
``ckpt.snapshot`` (the skeleton goes through its allow-listed unpickler, nothing else is
unpickled, ``torch.load`` is never used).

Guarantees:

* A step is complete exactly when its ``manifest.json`` exists. The manifest lists every
  rank's shard with its size and sha256; it is written after all shards, in one atomic step
  (a local temp file, fsync, rename; on an object store one put). A step directory without
  a manifest is a partial checkpoint (a writer died) and is never used.
* No file ever has its final name half-written on a local file system: shards and manifests
  are written to a hidden temp name in the same directory, fsynced, then renamed. On other
  file systems (object stores, whose puts are atomic) they are written to the final name and
  removed again, best effort, when the write fails; a partial object there is harmless, as
  no manifest lists it.
* Reads verify before they trust: ``verify`` checks the manifest against the job, step,
  world size and the shard files (presence, size, and with ``deep`` the sha256), and
  ``read_shard`` hashes the bytes it read before it parses the header. Anything wrong raises
  ``CorruptCheckpoint`` with a one-line reason; ``newest_valid`` walks back to the newest
  step that verifies and says why each newer one was skipped.
* I/O errors (``OSError``, ENOSPC included) are retried with exponential backoff; when the
  retries are used up ``DurableError`` names the path and the last error. A missing file is
  not an I/O error: it is a verification failure, reported at once.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import os
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from stalwart.ckpt.snapshot import Snapshot, TensorMeta

log = logging.getLogger(__name__)

SHARD_FORMAT = "stalwart-shard-1"
MANIFEST_FORMAT = "stalwart-manifest-1"
MANIFEST_NAME = "manifest.json"
CHUNK = 4 << 20  # bytes per write/read/hash call: streams a 1 GB payload without copying it
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

_STEP_DIR = re.compile(r"step-(\d+)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")


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
class Manifest:
    job: str
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    created_at: float
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "job": self.job,
                "step": self.step,
                "world_size": self.world_size,
                "shards": [
                    {"rank": s.rank, "file": s.file, "nbytes": s.nbytes, "sha256": s.sha256}
                    for s in self.shards
                ],
                "created_at": self.created_at,
                "extra": self.extra,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest; ValueError says what is wrong with it."""
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
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
        return cls(job, step, world_size, tuple(shards), float(created_at), extra)


def _field(doc: dict, key: str, kind, prefix: str = "") -> Any:
    if key not in doc:
        raise ValueError(f"{prefix}{key} is missing")
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{prefix}{key} is {value!r}, of the wrong type")
    return value


def parse_uri(uri: str) -> tuple[Any, str]:
    """(fsspec file system, root path in it) for a local path, file:// or any fsspec URL."""
    fs, root = url_to_fs(uri)
    if root != "/":
        root = root.rstrip("/")
    return fs, root


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def _join(*parts: str) -> str:
    return posixpath.join(*[p for p in parts if p])


def _flat_bytes(payload: Any) -> memoryview:
    """The payload's bytes as a flat memoryview, without copying a CPU buffer."""
    if isinstance(payload, torch.Tensor):
        payload = payload.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    arr = np.ascontiguousarray(payload).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    return memoryview(arr).cast("B")


def _shard_header(job: str, step: int, rank: int, snapshot: Snapshot, size: int) -> bytes:
    metas = [
        {
            "offset": m.offset,
            "nbytes": m.nbytes,
            "dtype": m.dtype,
            "shape": list(m.shape),
            "device": m.device,
        }
        for m in snapshot.metas
    ]
    header = {
        "payload": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]},
        "__metadata__": {
            "format": SHARD_FORMAT,
            "job": job,
            "step": str(step),
            "rank": str(rank),
            "skeleton": base64.b64encode(bytes(snapshot.skeleton)).decode("ascii"),
            "metas": json.dumps(metas, separators=(",", ":")),
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (best effort: not every platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_into(f, mv: memoryview, h) -> int:
    """Fill `mv` from `f` (hashing what was read); returns the bytes read (short at EOF)."""
    readinto = getattr(f, "readinto", None)
    pos = 0
    while pos < len(mv):
        want = min(CHUNK, len(mv) - pos)
        if readinto is not None:
            got = readinto(mv[pos : pos + want]) or 0
        else:
            data = f.read(want)
            got = len(data)
            mv[pos : pos + got] = data
        if not got:
            break
        h.update(mv[pos : pos + got])
        pos += got
    return pos


def _hash_rest(f, h) -> int:
    buf = memoryview(bytearray(CHUNK))
    total = 0
    while got := _read_into(f, buf, h):
        total += got
        if got < len(buf):
            break
    return total


class DurableStore:
    """Durable checkpoints of one job under a local path or fsspec URL (see the module doc).

    `clock` and `sleep` are injectable (tests drive them); `retries` is how many times a
    failed operation is retried, after backoff_s, 2*backoff_s, 4*backoff_s, ...
    """

    def __init__(
        self,
        uri: str,
        job: str,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not job or "/" in job or job in (".", ".."):
            raise ValueError(f"job name {job!r} is not a usable directory name")
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        self.uri = uri
        self.job = job
        self.retries = retries
        self.backoff_s = backoff_s
        self._clock = clock
        self._sleep = sleep
        self.fs, root = parse_uri(uri)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = _join(root, job)
        self._down_until: float | None = None
        self._down_for = 0.0

    # -- paths and messages ---------------------------------------------------------------

    @property
    def target(self) -> dict[str, Any]:
        """What another process (a node agent, a worker) needs to open this store again
        (`open_store`): plain values, so it travels through Ray."""
        return {
            "uri": self.uri,
            "job": self.job,
            "retries": self.retries,
            "backoff_s": self.backoff_s,
        }

    def describe(self) -> str:
        return self._show(self.root)

    def _show(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

    def step_dir(self, step: int) -> str:
        return _join(self.root, step_name(step))

    def _corrupt(self, step: int, reason: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(step, reason, self._show(self.step_dir(step)))

    # -- chaos and retries ----------------------------------------------------------------

    def fail_for(self, seconds: float) -> None:
        """Chaos: every storage operation fails with OSError for the next `seconds`."""
        self._down_for = seconds
        self._down_until = self._clock() + seconds

    def _check_up(self) -> None:
        if self._down_until is not None:
            if self._clock() < self._down_until:
                raise OSError(f"storage unavailable (injected by chaos for {self._down_for:g} s)")
            self._down_until = None

    def _retry(self, what: str, path: str, op: Callable[[], _T], missing_ok: bool = False) -> _T:
        """Run `op`, retrying OSError with backoff. With missing_ok, FileNotFoundError is
        not an I/O failure: it propagates at once for the caller to handle."""
        last: OSError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                self._check_up()
                return op()
            except OSError as e:
                if missing_ok and isinstance(e, FileNotFoundError):
                    raise
                last = e
            log.warning(
                "%s %s failed (attempt %d of %d): %s",
                what,
                self._show(path),
                attempt + 1,
                self.retries + 1,
                last,
            )
        raise DurableError(
            f"{what} {self._show(path)} failed after {self.retries + 1} attempts: {last}"
        ) from last

    # -- writing ------------------------------------------------------------------------

    def _write(self, path: str, produce: Callable[[Any], _T]) -> _T:
        """One attempt at writing `path` with `produce(file)`; never leaves a partial file
        under the final name on a local file system."""
        directory, name = posixpath.split(path)
        if self.local:
            os.makedirs(directory, exist_ok=True)
            tmp = _join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
            try:
                with open(tmp, "wb") as f:
                    result = produce(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(directory)
            return result
        self.fs.makedirs(directory, exist_ok=True)
        try:
            with self.fs.open(path, "wb") as f:
                return produce(f)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(path)
            raise

    def write_shard(self, step: int, rank: int, snapshot: Snapshot) -> ShardRecord:
        """Write `rank`'s shard of `step` (streamed, hashed while written)."""
        if snapshot.step != step:
            raise ValueError(f"snapshot is of step {snapshot.step}, not {step}")
        data = _flat_bytes(snapshot.payload)
        header = _shard_header(self.job, step, rank, snapshot, len(data))
        name = shard_name(rank)
        path = _join(self.step_dir(step), name)

        def produce(f) -> ShardRecord:
            h = hashlib.sha256()
            for piece in (len(header).to_bytes(8, "little"), header):
                f.write(piece)
                h.update(piece)
            for pos in range(0, len(data), CHUNK):
                chunk = data[pos : pos + CHUNK]
                f.write(chunk)
                h.update(chunk)
            return ShardRecord(rank, name, 8 + len(header) + len(data), h.hexdigest())

        return self._retry("writing shard", path, lambda: self._write(path, produce))

    def write_manifest(
        self, step: int, world_size: int, shards: list[ShardRecord], extra: dict | None = None
    ) -> Manifest:
        """Mark `step` complete. Call it last, after every rank's shard was written."""
        ordered = tuple(sorted(shards, key=lambda s: s.rank))
        ranks = [s.rank for s in ordered]
        if ranks != list(range(world_size)):
            raise ValueError(f"shards of ranks {ranks}, expected 0..{world_size - 1}")
        manifest = Manifest(self.job, step, world_size, ordered, time.time(), dict(extra or {}))
        data = manifest.to_json().encode()  # not JSON-serializable extra: TypeError here
        path = _join(self.step_dir(step), MANIFEST_NAME)
        if self.local:
            self._retry(
                "writing manifest", path, lambda: self._write(path, lambda f: f.write(data))
            )
        else:

            def put() -> None:
                self.fs.makedirs(self.step_dir(step), exist_ok=True)
                self.fs.pipe(path, data)

            self._retry("writing manifest", path, put)
        return manifest

    # -- listing and verifying ----------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps whose directory exists (complete or not), ascending."""

        def ls() -> list[dict]:
            self.fs.invalidate_cache(self.root)  # object-store listings are cached
            return self.fs.ls(self.root, detail=True)

        try:
            entries = self._retry("listing", self.root, ls, missing_ok=True)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            m = _STEP_DIR.fullmatch(posixpath.basename(e["name"].rstrip("/")))
            if m and e.get("type") == "directory":
                out.append(int(m.group(1)))
        return sorted(out)

    def manifest(self, step: int) -> Manifest:
        path = _join(self.step_dir(step), MANIFEST_NAME)
        try:
            raw = self._retry("reading manifest", path, lambda: self.fs.cat_file(path), True)
        except FileNotFoundError:
            raise self._corrupt(
                step, f"no {MANIFEST_NAME} (partial checkpoint: its writers did not finish)"
            ) from None
        try:
            return Manifest.from_json(raw)
        except ValueError as e:
            raise self._corrupt(step, f"unparsable {MANIFEST_NAME}: {e}") from None

    def verify(self, step: int, world_size: int | None = None, deep: bool = True) -> Manifest:
        """The manifest of `step` once the step checks out; CorruptCheckpoint otherwise."""
        m = self.manifest(step)
        if m.job != self.job:
            raise self._corrupt(step, f"manifest belongs to job {m.job!r}, not {self.job!r}")
        if m.step != step:
            raise self._corrupt(step, f"manifest is of step {m.step}, in the directory of {step}")
        if world_size is not None and m.world_size != world_size:
            raise self._corrupt(
                step, f"written by {m.world_size} ranks, the job now has {world_size}"
            )
        ranks = [s.rank for s in m.shards]
        if sorted(ranks) != list(range(m.world_size)):
            raise self._corrupt(
                step, f"manifest lists shards of ranks {ranks}, expected 0..{m.world_size - 1}"
            )
        for rec in sorted(m.shards, key=lambda s: s.rank):
            self._check_shard(step, rec, deep)
        return m

    def _shard_path(self, step: int, rec: ShardRecord) -> str:
        if posixpath.basename(rec.file) != rec.file or rec.file.startswith("."):
            raise self._corrupt(step, f"rank {rec.rank}'s shard file name {rec.file!r} is unsafe")
        return _join(self.step_dir(step), rec.file)

    def _check_shard(self, step: int, rec: ShardRecord, deep: bool) -> None:
        path = self._shard_path(step, rec)
        what = f"rank {rec.rank}'s shard {rec.file}"

        def stat() -> int:
            self.fs.invalidate_cache(posixpath.dirname(path))
            return int(self.fs.info(path)["size"])

        try:
            size = self._retry("checking shard", path, stat, missing_ok=True)
        except FileNotFoundError:
            raise self._corrupt(step, f"{what} is missing") from None
        if size != rec.nbytes:
            state = "truncated" if size < rec.nbytes else "longer than written"
            raise self._corrupt(
                step,
                f"{what} is {state} (size mismatch: {size} bytes, the manifest says {rec.nbytes})",
            )
        if not deep:
            return

        def digest() -> str:
            h = hashlib.sha256()
            with self.fs.open(path, "rb") as f:
                _hash_rest(f, h)
            return h.hexdigest()

        try:
            sha = self._retry("hashing shard", path, digest, missing_ok=True)
        except FileNotFoundError:
            raise self._corrupt(step, f"{what} is missing") from None
        if sha != rec.sha256:
            raise self._corrupt(
                step,
                f"{what} is corrupt (sha256 mismatch: {sha[:12]}..., written {rec.sha256[:12]}...)",
            )

    def newest_valid(
        self, world_size: int | None = None, at_most: int | None = None, deep: bool = True
    ) -> tuple[Manifest | None, list[tuple[int, str]]]:
        """The newest step (<= at_most) that verifies, and (step, reason) for each newer one
        skipped, newest first. Storage failures raise DurableError: they say nothing about
        the checkpoints."""
        skipped: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            try:
                return self.verify(step, world_size, deep), skipped
            except CorruptCheckpoint as e:
                skipped.append((step, e.reason))
        return None, skipped

    # -- reading ------------------------------------------------------------------------

    def read_shard(self, step: int, rank: int, manifest: Manifest | None = None) -> Snapshot:
        """`rank`'s snapshot of `step`, after checking its bytes against the manifest."""
        if manifest is None:
            manifest = self.manifest(step)
        rec = next((s for s in manifest.shards if s.rank == rank), None)
        if rec is None:
            raise self._corrupt(step, f"manifest lists no shard of rank {rank}")
        path = self._shard_path(step, rec)
        try:
            header, payload = self._retry(
                "reading shard", path, lambda: self._read(step, rec, path), missing_ok=True
            )
        except FileNotFoundError:
            raise self._corrupt(step, f"rank {rank}'s shard {rec.file} is missing") from None
        return self._parse(step, rank, rec, header, payload)

    def _read(self, step: int, rec: ShardRecord, path: str) -> tuple[bytes, np.ndarray]:
        """The header and payload of a shard whose bytes hash to the manifest's sha256."""
        what = f"rank {rec.rank}'s shard {rec.file}"
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            head = bytearray(8)
            got = _read_into(f, memoryview(head), h)
            n = int.from_bytes(head, "little")
            if got == 8 and n <= min(rec.nbytes - 8, MAX_HEADER):
                header = bytearray(n)
                got += _read_into(f, memoryview(header), h)
                payload = np.empty(max(rec.nbytes - 8 - n, 0), dtype=np.uint8)
                got += _read_into(f, memoryview(payload), h)
                got += _hash_rest(f, h)
            else:  # a header length that cannot be right: hash the rest to say why
                header, payload = None, None
                got += _hash_rest(f, h)
        if got != rec.nbytes:
            state = "truncated" if got < rec.nbytes else "longer than written"
            raise self._corrupt(
                step,
                f"{what} is {state} (size mismatch: {got} bytes, the manifest says {rec.nbytes})",
            )
        if h.hexdigest() != rec.sha256:
            raise self._corrupt(step, f"{what} is corrupt (sha256 mismatch)")
        if header is None:
            raise self._corrupt(step, f"{what} has a header length of {n} bytes, out of range")
        return bytes(header), payload

    def _parse(
        self, step: int, rank: int, rec: ShardRecord, header: bytes, payload: np.ndarray
    ) -> Snapshot:
        def bad(why: str) -> CorruptCheckpoint:
            return self._corrupt(step, f"rank {rank}'s shard {rec.file} {why}")

        try:
            doc = json.loads(header)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"has an unparsable header ({e})") from None
        if not isinstance(doc, dict) or set(doc) != {"payload", "__metadata__"}:
            raise bad("has a header other than a stalwart shard's")
        meta, tensor = doc["__metadata__"], doc["payload"]
        if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
            fmt = meta.get("format") if isinstance(meta, dict) else None
            raise bad(f"has format {fmt!r}, expected {SHARD_FORMAT!r}")
        size = len(payload)
        expected = {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}
        if tensor != expected:
            raise bad(f"describes its payload as {tensor!r}, expected {expected!r}")
        for key, want in (("job", self.job), ("step", str(step)), ("rank", str(rank))):
            if meta.get(key) != want:
                raise bad(f"says {key} {meta.get(key)!r}, expected {want!r}")
        try:
            skeleton = base64.b64decode(meta.get("skeleton", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise bad("has an undecodable skeleton") from None
        try:
            metas = tuple(_meta(d, size) for d in json.loads(meta.get("metas", "")))
        except (TypeError, ValueError) as e:
            raise bad(f"has an invalid tensor layout ({e})") from None
        return Snapshot(step, skeleton, metas, payload)

    def split_complete(self, steps: list[int]) -> tuple[list[int], list[int]]:
        """`steps` (ascending) as (those with a readable manifest, those without one)."""
        complete, incomplete = [], []
        for step in steps:
            try:
                self.manifest(step)
            except CorruptCheckpoint:
                incomplete.append(step)
            else:
                complete.append(step)
        return complete, incomplete

    # -- pruning ------------------------------------------------------------------------

    def prune(self, keep_last: int, newest: int | None = None) -> list[int]:
        """Keep the newest `keep_last` complete steps; delete older complete steps and the
        incomplete directories older than the newest complete step (left by failed
        writes). Incomplete directories newer than it may be being written: they stay.
        `newest`: the step the caller just wrote; steps above it (another run of the job
        that went further) are not counted and stay. Returns the deleted steps, ascending."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        steps = self.steps()
        if newest is not None:
            steps = [s for s in steps if s <= newest]
        complete, incomplete = self.split_complete(steps)
        if not complete:
            return []
        newest = complete[-1]
        doomed = sorted(complete[:-keep_last] + [s for s in incomplete if s < newest])
        for step in doomed:
            d = self.step_dir(step)
            manifest = _join(d, MANIFEST_NAME)
            # The manifest goes first: a step half-deleted by a crash is incomplete, never a
            # "complete" step with shards missing.
            with contextlib.suppress(FileNotFoundError):
                self._retry("deleting", manifest, lambda p=manifest: self.fs.rm_file(p), True)
            with contextlib.suppress(FileNotFoundError):
                self._retry("deleting", d, lambda p=d: self.fs.rm(p, recursive=True), True)
        if doomed:
            self.fs.invalidate_cache(self.root)
        return doomed


def _meta(d: Any, size: int) -> TensorMeta:
    if not isinstance(d, dict) or set(d) != {"offset", "nbytes", "dtype", "shape", "device"}:
        raise ValueError(f"entry {d!r} is not a tensor description")
    ints = [d["offset"], d["nbytes"], *(d["shape"] if isinstance(d["shape"], list) else [None])]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ints):
        raise ValueError(f"entry {d!r} has a bad offset, size or shape")
    dtype = getattr(torch, d["dtype"], None) if isinstance(d["dtype"], str) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(d["device"], str):
        raise ValueError(f"entry {d!r} has a bad dtype or device")
    if d["nbytes"] != math.prod(d["shape"]) * dtype.itemsize:
        raise ValueError(f"entry {d!r}: size does not match shape and dtype")
    if d["offset"] + d["nbytes"] > size:
        raise ValueError(f"entry {d!r} reaches past the payload's {size} bytes")
    return TensorMeta(d["offset"], d["nbytes"], d["dtype"], tuple(d["shape"]), d["device"])


def open_store(target: Mapping[str, Any]) -> DurableStore:
    """The store `DurableStore.target` describes."""
    return DurableStore(
        target["uri"], target["job"], retries=target["retries"], backoff_s=target["backoff_s"]
    )

"""The durable checkpoint tier: checkpoints on a local path or any fsspec URL (s3://, gs://,
memory://, ...), which outlive every node of the job.

Layout under ``<uri>/<job>/``::

    step-000000000040/
        __0_0.gen3.distcp         one file per rank (DCP's names, and the job's generation
        __1_0.gen3.distcp         that wrote it), written by a node holding its shard
        .metadata                 DCP's index of the step
        manifest.json             written last, once every file is in place

Each step directory is a DCP checkpoint (ckpt/dcp_format.py): ``dcp.load`` reads it without
stalwart. Steps written before (one safetensors file per rank, ``stalwart-manifest-1``:
ckpt/legacy_shard.py) are still read.

Guarantees:

* A step is complete exactly when its ``manifest.json`` exists. The manifest lists every
  file with its size and sha256 (and every blob in them with its own); it is written after
  all of them, in one atomic step (a local temp file, fsync, rename; on an object store one
  put). A step directory without a manifest is a partial checkpoint (a writer died) and is
  never used.
* No file ever has its final name half-written on a local file system: data files,
  ``.metadata`` and manifests are written to a hidden temp name in the same directory,
  fsynced, then renamed. On other file systems (object stores, whose puts are atomic) they
  are written to the final name and removed again, best effort, when the write fails; a
  partial object there is harmless, as no manifest lists it.
* Reads verify before they trust: ``verify`` checks the manifest against the job, step,
  world size and the files (presence, size, and with ``deep`` the sha256), and
  ``read_shard`` checks every blob it reads against its sha256 before it parses it. Nothing
  is unpickled but through allow-lists (the skeleton's; tensors with ``weights_only``).
  Anything wrong raises ``CorruptCheckpoint`` with a one-line reason; ``newest_valid``
  walks back to the newest step that verifies and says why each newer one was skipped.
* I/O errors (``OSError``, ENOSPC included) are retried with exponential backoff; when the
  retries are used up ``DurableError`` names the path and the last error
  (ckpt/durable_io.py: the retries, the atomic writes, the chaos outage). A missing file is
  not an I/O error: it is a verification failure, reported at once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from stalwart.ckpt import dcp_format, legacy_shard
from stalwart.ckpt.dcp_format import CheckpointMismatch, rebuild_snapshot
from stalwart.ckpt.durable_io import StorageIO
from stalwart.ckpt.hashed_io import CHUNK, hash_rest  # noqa: F401 (CHUNK: re-exported)
from stalwart.ckpt.manifest import (  # noqa: F401 (the durable tier's names, re-exported)
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    CorruptCheckpoint,
    DurableError,
    Manifest,
    RankLayout,
    ShardRecord,
)
from stalwart.ckpt.snapshot import Snapshot

_STEP_DIR = re.compile(r"step-(\d+)")


def parse_uri(uri: str) -> tuple[Any, str]:
    """(fsspec file system, root path in it) for a local path, file:// or any fsspec URL."""
    fs, root = url_to_fs(uri)
    if root != "/":
        root = root.rstrip("/")
    return fs, root


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def _join(*parts: str) -> str:
    return posixpath.join(*[p for p in parts if p])


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
        self.fs, root = parse_uri(uri)
        self.root = _join(root, job)
        self.io = StorageIO(self.fs, self._show, retries, backoff_s, clock, sleep)
        self.local = self.io.local  # a local file system (paths shown as they are)

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

    # -- chaos -------------------------------------------------------------------------

    def fail_for(self, seconds: float) -> None:
        """Chaos: every storage operation fails with OSError for the next `seconds`."""
        self.io.fail_for(seconds)

    # -- writing ------------------------------------------------------------------------

    def write_rank(
        self, step: int, rank: int, snapshot: Snapshot, generation: int | None = None
    ) -> dict[str, Any]:
        """Write `rank`'s file of `step` as DCP lays it out (ckpt/dcp_format.py; hashed as
        written), named for the job's `generation` writing it. Returns what
        `write_manifest` needs of it (plain values)."""
        if snapshot.step != step:
            raise ValueError(f"snapshot is of step {snapshot.step}, not {step}")
        plan = dcp_format.plan_rank(snapshot, rank)
        path = _join(self.step_dir(step), dcp_format.rank_file(rank, generation))

        def produce(f) -> dict[str, Any]:
            return dcp_format.write_rank(f.write, snapshot, plan, rank, generation)

        return self.io.retry("writing shard", path, lambda: self.io.write(path, produce))

    def write_shard(self, step: int, rank: int, snapshot: Snapshot) -> ShardRecord:
        """Write `rank`'s shard of `step` in format 1 (ckpt/legacy_shard.py: what steps
        written before DCP hold; kept for making such steps to read)."""
        if snapshot.step != step:
            raise ValueError(f"snapshot is of step {snapshot.step}, not {step}")
        name = legacy_shard.shard_name(rank)
        path = _join(self.step_dir(step), name)

        def produce(f) -> ShardRecord:
            nbytes, sha = legacy_shard.write_shard_file(f, self.job, step, rank, snapshot)
            return ShardRecord(rank, name, nbytes, sha)

        return self.io.retry("writing shard", path, lambda: self.io.write(path, produce))

    def write_manifest(
        self,
        step: int,
        world_size: int,
        shards: list[ShardRecord] | None = None,
        extra: dict | None = None,
        writes: list[dict[str, Any]] | None = None,
    ) -> Manifest:
        """Mark `step` complete. Call it last, after every rank's file was written: `writes`
        (the ranks' `write_rank` answers: DCP's ``.metadata`` is written first, then the
        manifest) or, for format 1, `shards`."""
        layouts: tuple[RankLayout, ...] = ()
        dcp = None
        sharded = False
        if writes is not None:
            shards = [ShardRecord(**w["record"]) for w in writes]
        ordered = tuple(sorted(shards or (), key=lambda s: s.rank))
        ranks = [s.rank for s in ordered]
        if ranks != list(range(world_size)):
            raise ValueError(f"shards of ranks {ranks}, expected 0..{world_size - 1}")
        if writes is not None:
            entries, planner, merged, sharded = dcp_format.merge(writes)
            layouts = tuple(merged)
            where = self._show(self.step_dir(step))
            index = dcp_format.metadata_bytes(entries, planner, where)
            path = _join(self.step_dir(step), dcp_format.METADATA_NAME)
            self.io.put("writing DCP metadata", path, index)
            dcp = {
                "metadata": {
                    "file": dcp_format.METADATA_NAME,
                    "nbytes": len(index),
                    "sha256": hashlib.sha256(index).hexdigest(),
                },
                "entries": entries,
                "planner_data": planner,
            }
        manifest = Manifest(
            self.job,
            step,
            world_size,
            ordered,
            time.time(),
            dict(extra or {}),
            layouts,
            dcp,
            sharded,
        )
        data = manifest.to_json().encode()  # not JSON-serializable extra: TypeError here
        self.io.put("writing manifest", _join(self.step_dir(step), MANIFEST_NAME), data)
        return manifest

    # -- listing and verifying ----------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps whose directory exists (complete or not), ascending."""

        def ls() -> list[dict]:
            self.fs.invalidate_cache(self.root)  # object-store listings are cached
            return self.fs.ls(self.root, detail=True)

        try:
            entries = self.io.retry("listing", self.root, ls, missing_ok=True)
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
            raw = self.io.retry("reading manifest", path, lambda: self.fs.cat_file(path), True)
        except FileNotFoundError:
            raise self._corrupt(
                step, f"no {MANIFEST_NAME} (partial checkpoint: its writers did not finish)"
            ) from None
        try:
            return Manifest.from_json(raw)
        except ValueError as e:
            raise self._corrupt(step, f"unparsable {MANIFEST_NAME}: {e}") from None

    def verify(
        self, step: int, world_size: int | None = None, deep: bool = True, reshard: bool = False
    ) -> Manifest:
        """The manifest of `step` once the step checks out; CorruptCheckpoint otherwise.
        With `reshard`, a step of another world size checks out if it holds sharded state
        (DTensors: it is loaded resharded, ckpt/reshard.py)."""
        m = self.manifest(step)
        if m.job != self.job:
            raise self._corrupt(step, f"manifest belongs to job {m.job!r}, not {self.job!r}")
        if m.step != step:
            raise self._corrupt(step, f"manifest is of step {m.step}, in the directory of {step}")
        if world_size is not None and m.world_size != world_size and not (reshard and m.sharded):
            why = "" if m.sharded else " (and holds no sharded state to reshard)"
            raise self._corrupt(
                step, f"written by {m.world_size} ranks, the job now has {world_size}{why}"
            )
        ranks = [s.rank for s in m.shards]
        if sorted(ranks) != list(range(m.world_size)):
            raise self._corrupt(
                step, f"manifest lists shards of ranks {ranks}, expected 0..{m.world_size - 1}"
            )
        for rec in sorted(m.shards, key=lambda s: s.rank):
            self._check_shard(step, rec, deep)
        if m.dcp is not None:
            index = m.dcp["metadata"]
            rec = ShardRecord(
                -1, index.get("file", ""), index.get("nbytes", -1), index.get("sha256", "")
            )
            self._check_shard(step, rec, deep, what=f"DCP's {dcp_format.METADATA_NAME}")
        return m

    def _file_path(self, step: int, file: str, what: str) -> str:
        allowed = file == dcp_format.METADATA_NAME or not file.startswith(".")
        if posixpath.basename(file) != file or not allowed or not file:
            raise self._corrupt(step, f"{what}'s file name {file!r} is unsafe")
        return _join(self.step_dir(step), file)

    def _shard_path(self, step: int, rec: ShardRecord) -> str:
        return self._file_path(step, rec.file, f"rank {rec.rank}'s shard")

    def _check_shard(self, step: int, rec: ShardRecord, deep: bool, what: str = "") -> None:
        what = what or f"rank {rec.rank}'s shard {rec.file}"
        path = self._file_path(step, rec.file, what)

        def stat() -> int:
            self.fs.invalidate_cache(posixpath.dirname(path))
            return int(self.fs.info(path)["size"])

        try:
            size = self.io.retry("checking shard", path, stat, missing_ok=True)
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
                hash_rest(f, h)
            return h.hexdigest()

        try:
            sha = self.io.retry("hashing shard", path, digest, missing_ok=True)
        except FileNotFoundError:
            raise self._corrupt(step, f"{what} is missing") from None
        if sha != rec.sha256:
            raise self._corrupt(
                step,
                f"{what} is corrupt (sha256 mismatch: {sha[:12]}..., written {rec.sha256[:12]}...)",
            )

    def newest_valid(
        self,
        world_size: int | None = None,
        at_most: int | None = None,
        deep: bool = True,
        reshard: bool = False,
    ) -> tuple[Manifest | None, list[tuple[int, str]]]:
        """The newest step (<= at_most) that verifies, and (step, reason) for each newer one
        skipped, newest first. Storage failures raise DurableError: they say nothing about
        the checkpoints."""
        skipped: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            try:
                return self.verify(step, world_size, deep, reshard), skipped
            except CorruptCheckpoint as e:
                skipped.append((step, e.reason))
        return None, skipped

    # -- reading ------------------------------------------------------------------------

    def read_shard(self, step: int, rank: int, manifest: Manifest | None = None) -> Snapshot:
        """`rank`'s snapshot of `step`, after checking its bytes against the manifest."""
        if manifest is None:
            manifest = self.manifest(step)
        if manifest.dcp is not None:
            return self._read_layout(step, rank, manifest)
        rec = next((s for s in manifest.shards if s.rank == rank), None)
        if rec is None:
            raise self._corrupt(step, f"manifest lists no shard of rank {rank}")
        path = self._shard_path(step, rec)
        try:
            header, payload = self.io.retry(
                "reading shard", path, lambda: self._read(step, rec, path), missing_ok=True
            )
        except FileNotFoundError:
            raise self._corrupt(step, f"rank {rank}'s shard {rec.file} is missing") from None
        return self._parse(step, rank, rec, header, payload)

    def _read(self, step: int, rec: ShardRecord, path: str) -> tuple[bytes, np.ndarray]:
        """The header and payload of a shard whose bytes hash to the manifest's sha256."""
        what = f"rank {rec.rank}'s shard {rec.file}"
        with self.fs.open(path, "rb") as f:
            header, payload, got, sha = legacy_shard.read_shard_file(f, rec.nbytes)
        if got != rec.nbytes:
            state = "truncated" if got < rec.nbytes else "longer than written"
            raise self._corrupt(
                step,
                f"{what} is {state} (size mismatch: {got} bytes, the manifest says {rec.nbytes})",
            )
        if sha != rec.sha256:
            raise self._corrupt(step, f"{what} is corrupt (sha256 mismatch)")
        if header is None:
            raise self._corrupt(step, f"{what} has a header length out of range")
        return header, payload

    def _parse(
        self, step: int, rank: int, rec: ShardRecord, header: bytes, payload: np.ndarray
    ) -> Snapshot:
        try:
            return legacy_shard.parse_shard(self.job, step, rank, header, payload)
        except ValueError as e:
            raise self._corrupt(step, f"rank {rank}'s shard {rec.file} {e}") from None

    def _read_layout(self, step: int, rank: int, manifest: Manifest) -> Snapshot:
        """`rank`'s snapshot rebuilt from a DCP step (every blob sha256-checked)."""
        if not 0 <= rank < len(manifest.layouts):
            raise self._corrupt(step, f"manifest lists no shard of rank {rank}")
        where = self._show(self.step_dir(step))
        read = functools.partial(self.read_range, step)
        try:
            return rebuild_snapshot(step, manifest.layouts[rank], read, where)
        except CheckpointMismatch as e:
            raise self._corrupt(step, f"rank {rank}'s {e}") from None

    def read_range(self, step: int, file: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of `file` in `step`'s directory."""
        path = self._file_path(step, file, file)

        def read() -> bytes:
            with self.fs.open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)

        try:
            data = self.io.retry("reading", path, read, missing_ok=True)
        except FileNotFoundError:
            raise self._corrupt(step, f"{file} is missing") from None
        if len(data) != length:
            raise self._corrupt(step, f"{file} is truncated")
        return data

    def reader(self, step: int, manifest: Manifest):
        """A DCP reader of `step` (its index from the manifest, every blob sha256-checked),
        for loading its sharded state at another world size."""
        from stalwart.ckpt.dcp_read import StepReader  # torch.distributed.checkpoint: 0.5 s

        if manifest.dcp is None:
            raise self._corrupt(
                step, "written in format 1, before DCP: it can be restored only at its world size"
            )
        return StepReader(
            functools.partial(self.read_range, step),
            self._show(self.step_dir(step)),
            entries=manifest.dcp["entries"],
            planner_data=manifest.dcp["planner_data"],
        )

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
                self.io.retry("deleting", manifest, lambda p=manifest: self.fs.rm_file(p), True)
            with contextlib.suppress(FileNotFoundError):
                self.io.retry("deleting", d, lambda p=d: self.fs.rm(p, recursive=True), True)
        if doomed:
            self.fs.invalidate_cache(self.root)
        return doomed


def open_store(target: Mapping[str, Any]) -> DurableStore:
    """The store `DurableStore.target` describes."""
    return DurableStore(
        target["uri"], target["job"], retries=target["retries"], backoff_s=target["backoff_s"]
    )

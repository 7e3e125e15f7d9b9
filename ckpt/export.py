"""Export one rank's durable checkpoint into standard formats: what `stalwart checkpoint
export` does (docs/checkpoints.md, "Keeping the result").

The durable tier keeps DCP steps (ckpt/durable.py; format 1: one flat buffer per rank plus
an allow-listed skeleton). This module is the bridge out of them:

* `locate` finds the store: a durable URI (``URI`` or ``URI/JOB``, with or without a job
  name), or a run directory, whose result.json names the job and its ``persist.uri`` (a run
  that never finished: the newest ``persisted`` event in its events.jsonl).
* `pick` chooses the step (the newest one whose manifest checks out and whose shard of the
  rank reads back sha256-intact, or exactly the step asked for) and reads the rank's shard.
* `export` restores it (``ckpt.snapshot.restore``: nothing is unpickled but the
  allow-listed skeleton) and writes each registered object's state dict to OUT as
  ``OBJECT.pt`` or ``OBJECT.safetensors`` (ckpt/export_formats.py), then
  ``manifest.json``, last: an OUT without it is an incomplete export. The RNG states are
  not exported: they only matter for resuming under stalwart. A sharded object (a model
  under fully_shard, its optimizer) is exported whole: its full tensors, assembled from
  every rank's chunks, keyed by parameter FQN (`rank_state`).

Errors: `ExportError` is the caller's input (no such directory, no durable tier, an unknown
step or rank, a non-empty OUT); `ExportFailed` and ckpt.durable's `CorruptCheckpoint` and
`DurableError` mean the checkpoint could not be read or the export not written.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from stalwart.ckpt.durable import (
    CorruptCheckpoint,
    DurableStore,
    Manifest,
    parse_uri,
    step_name,
)
from stalwart.ckpt.export_formats import (
    SUFFIX,
    WRITERS,
    ExportError,
    ExportFailed,
    atomic_write,
    plain,
    strip_wrapper_prefix,
    tensor_stats,
)
from stalwart.ckpt.snapshot import Snapshot

FORMATS = ("torch", "safetensors")
EXPORT_KIND = "stalwart-export-1"
MANIFEST_NAME = "manifest.json"
RUN_FILES = ("result.json", "events.jsonl")

_STEP_DIR = re.compile(r"step-\d+")
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


# -- where the checkpoint is ------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    uri: str  # the durable root, as DurableStore takes it (the job's directory is under it)
    job: str
    run_dir: str | None = None

    def store(self) -> DurableStore:
        try:
            return DurableStore(self.uri, self.job)
        except ValueError as e:
            raise ExportError(str(e)) from None


def locate(source: str, job: str | None = None) -> Location:
    """The store SOURCE names: a run directory (holding result.json or events.jsonl), a
    job's checkpoint directory (``URI/JOB``, holding step-* directories) or a durable root
    (``URI``: with `job`, or holding exactly one job's checkpoints)."""
    fs, root = parse_uri(source)
    local = isinstance(fs, LocalFileSystem)
    if local and not os.path.exists(root):
        raise ExportError(f"{source}: no such file or directory")
    if local and not os.path.isdir(root):
        raise ExportError(f"{source}: not a directory (expected a durable URI or a RUN_DIR)")
    if local and any(os.path.isfile(os.path.join(root, f)) for f in RUN_FILES):
        return _from_run_dir(root, job)
    if job is not None:
        return Location(source, job)
    try:
        entries = fs.ls(root, detail=True)
    except OSError as e:
        raise ExportError(f"{source}: cannot list it ({e})") from None
    dirs = [posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory"]
    if any(_STEP_DIR.fullmatch(d) for d in dirs):  # URI/JOB itself
        parent, name = posixpath.split(root)
        if not name:
            raise ExportError(f"{source}: step directories at the root of a file system")
        return Location(parent if local else fs.unstrip_protocol(parent), name)
    jobs = sorted(d for d in dirs if _has_steps(fs, posixpath.join(root, d)))
    if len(jobs) == 1:
        return Location(source, jobs[0])
    if jobs:
        raise ExportError(
            f"{source} holds the checkpoints of {len(jobs)} jobs ({', '.join(jobs)}): "
            "pass --job NAME"
        )
    raise ExportError(
        f"{source}: no durable checkpoints here (neither step-* directories nor a job "
        "directory holding them; a run directory holds result.json)"
    )


def _has_steps(fs: Any, path: str) -> bool:
    try:
        entries = fs.ls(path, detail=True)
    except OSError:
        return False
    return any(
        e["type"] == "directory" and _STEP_DIR.fullmatch(posixpath.basename(e["name"].rstrip("/")))
        for e in entries
    )


def _from_run_dir(run_dir: str, job: str | None) -> Location:
    result = os.path.join(run_dir, "result.json")
    if os.path.isfile(result):
        try:
            with open(result, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ExportError(f"{result}: unreadable ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            raise ExportError(f"{result}: no job name (field 'name')")
        name = doc["name"]
        if "persist" not in doc:
            raise ExportError(f"{result}: no field 'persist' (not a stalwart result.json?)")
        persist = doc["persist"]
        if persist is None:
            raise ExportError(
                f"{result}: persist is null: job {name!r} had no durable checkpoint tier, "
                "and in-memory checkpoints die with the job; set checkpoint.persist.uri "
                "in the job spec to keep checkpoints that can be exported"
            )
        uri = persist.get("uri") if isinstance(persist, dict) else None
        where = f"{result}: persist.uri"
    else:  # the run did not finish: its events say where it persisted
        events = os.path.join(run_dir, "events.jsonl")
        uri = _persisted_uri(events)
        if uri is None:
            raise ExportError(
                f"{run_dir}: no result.json (the run did not finish) and {events} records "
                "no durable checkpoint ('persisted' event); set checkpoint.persist.uri "
                "to keep checkpoints that can be exported"
            )
        name = uri.rstrip("/").rpartition("/")[2]
        where = f"{events}: persisted.uri"
    if not isinstance(uri, str) or not uri:
        raise ExportError(f"{where} is missing")
    base, _, last = uri.rstrip("/").rpartition("/")
    if last != name:
        raise ExportError(f"{where} {uri!r} does not end in the job's directory {name!r}")
    if job is not None and job != name:
        raise ExportError(f"--job {job!r} does not match {run_dir}'s job {name!r}")
    return Location(base or "/", name, run_dir)


def _persisted_uri(events: str) -> str | None:
    uri = None
    with contextlib.suppress(OSError), open(events, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"persisted"' not in line:
                continue
            with contextlib.suppress(json.JSONDecodeError):
                e = json.loads(line)
                if isinstance(e, dict) and e.get("type") == "persisted":
                    uri = e.get("uri") if isinstance(e.get("uri"), str) else uri
    return uri


# -- which step ---------------------------------------------------------------------------


@dataclass
class Picked:
    manifest: Manifest
    snapshot: Snapshot
    rank: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer steps, newest first


def pick(store: DurableStore, step: int | None = None, rank: int = 0) -> Picked:
    """`rank`'s shard of `step` (default: the newest step that reads back intact)."""
    steps = store.steps()
    if not steps:
        raise ExportError(
            f"no checkpoints of job {store.job!r} in {store.describe()} (no step-* directory)"
        )
    if step is not None:
        if step not in steps:
            raise ExportError(
                f"step {step} is not among the checkpoints of job {store.job!r} in "
                f"{store.describe()}; {_listing(store, steps)}"
            )
        return Picked(*_read(store, step, rank), rank)
    skipped: list[tuple[int, str]] = []
    for s in reversed(steps):
        try:
            manifest, snapshot = _read(store, s, rank)
        except CorruptCheckpoint as e:
            skipped.append((s, e.reason))
            continue
        return Picked(manifest, snapshot, rank, skipped)
    reasons = "; ".join(f"step {s}: {r}" for s, r in skipped[:3])
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    raise ExportFailed(
        f"no checkpoint of job {store.job!r} in {store.describe()} reads back intact "
        f"({reasons}{more})"
    )


def _read(store: DurableStore, step: int, rank: int) -> tuple[Manifest, Snapshot]:
    # Sizes of every shard, the bytes (sha256) of the one read: exporting rank 0 does not
    # read the other ranks' shards.
    manifest = store.verify(step, deep=False)
    if not 0 <= rank < manifest.world_size:
        raise ExportError(
            f"--rank {rank}: step {step} of job {store.job!r} was written by "
            f"{manifest.world_size} ranks (0..{manifest.world_size - 1})"
        )
    return manifest, store.read_shard(step, rank, manifest)


def _listing(store: DurableStore, steps: list[int]) -> str:
    complete, partial = store.split_complete(steps)
    out = f"steps there: {_brief(complete)}"
    return out + (f" (incomplete, no {MANIFEST_NAME}: {_brief(partial)})" if partial else "")


def _brief(steps: list[int], limit: int = 20) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-limit:]))
    return f"..., {shown}" if len(steps) > limit else shown


# -- restoring and checking OUT ----------------------------------------------------------


def rank_state(picked: Picked, store: DurableStore) -> dict[str, Any]:
    """The restored state ({"step", "objects", "rng"}) of the picked shard. An object
    holding DTensor shards (FSDP2, HSDP: a DCP step's) is assembled whole from every rank's
    chunks (ckpt/reshard.py): its full tensors, as the model unsharded has them."""
    from stalwart.ckpt.dcp_format import CheckpointMismatch
    from stalwart.ckpt.reshard import whole_state

    step, rank = picked.manifest.step, picked.rank
    try:
        state = whole_state(picked.snapshot, lambda: store.reader(step, picked.manifest))
    except CheckpointMismatch as e:
        raise ExportFailed(f"step {step}: a sharded object cannot be assembled: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError) as e:
        raise ExportFailed(
            f"rank {rank}'s state of step {step} does not restore here: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("objects"), dict):
        raise ExportFailed(
            f"rank {rank}'s state of step {step} is not a stalwart rank state (no 'objects')"
        )
    return state


def check_out(out: str) -> None:
    """OUT must be a new or empty directory (an export never overwrites files)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out}: exists and is not a directory")
    if os.path.isdir(out):
        held = sorted(os.listdir(out))
        if held:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise ExportError(
                f"{out}: not empty (holds {shown}); export into a new or empty directory"
            )


def require_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ExportError(
            "--format safetensors needs the safetensors package: pip install safetensors"
        ) from None


def export(
    source: str,
    out: str,
    fmt: str = "torch",
    *,
    step: int | None = None,
    rank: int = 0,
    job: str | None = None,
) -> dict[str, Any]:
    """Write rank `rank`'s registered objects of `step` of the checkpoint SOURCE names into
    OUT in `fmt`; returns the manifest written to OUT/manifest.json."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt == "safetensors":
        require_safetensors()
    check_out(out)
    location = locate(source, job)
    store = location.store()
    picked = pick(store, step, rank)
    state = rank_state(picked, store)
    manifest = picked.manifest
    names = list(state["objects"])
    for name in names:
        if not isinstance(name, str) or not _OBJECT_NAME.fullmatch(name):
            raise ExportFailed(f"registered object name {name!r} is not usable as a file name")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot create it ({e})") from None
    objects: dict[str, Any] = {}
    for name in names:
        notes: list[str] = []
        value = plain(state["objects"][name], name, notes)
        value, stripped = strip_wrapper_prefix(value)
        file = name + SUFFIX[fmt]
        count, nbytes = tensor_stats(value)
        path = os.path.join(out, file)
        try:
            extra = WRITERS[fmt](value, path)
        except OSError as e:
            raise ExportFailed(f"{path}: cannot write it ({e.strerror or e})") from None
        objects[name] = {
            "file": file,
            "tensors": count,
            "bytes": nbytes,
            "stripped_prefix": stripped,
            **extra,
            "converted": notes,
        }
    doc = {
        "kind": EXPORT_KIND,
        "format": fmt,
        "job": store.job,
        "step": manifest.step,
        "rank": rank,
        "world_size": manifest.world_size,
        "source": store.describe(),
        "source_step_dir": step_name(manifest.step),
        "run_dir": location.run_dir,
        "checkpoint_written_at": manifest.created_at,
        "exported_at": time.time(),
        "objects": objects,
        "files": [o["file"] for o in objects.values()],
        "skipped_steps": [{"step": s, "reason": r} for s, r in picked.skipped],
    }
    text = json.dumps(doc, indent=1)

    def write_manifest(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    path = os.path.join(out, MANIFEST_NAME)
    try:
        atomic_write(path, write_manifest)
    except OSError as e:
        raise ExportFailed(f"{path}: cannot write it ({e.strerror or e})") from None
    return doc

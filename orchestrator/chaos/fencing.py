"""The verdict's fencing check: no write from a fenced generation reached the durable store,
and what each path refused.

A recovery fences the generation it ends off: its ranks' hand-overs (the ring), its copies
(the replicas), its writes to storage (durable) and its processes' calls to the supervisor
are refused from then on, each with a `fenced` event (`persist_fenced` for storage). The
store itself is the evidence that matters: `audit` reads every step this run committed
(its manifest names the generation that wrote it and when it was committed) and the data
files beside it (each named for the generation that wrote it, ckpt/dcp_format.py);
`check` holds them against the job's `generation` events. A step passes when it was
committed before a later generation started and lists only its own generation's files;
a step a recovery found being written at or below its restore step, by nodes all alive,
counts as the next generation's (adopted: the job's history). A run that persisted steps
of which the store shows none fails the check: nothing could be read.
Files a fenced generation wrote that no manifest lists are harmless: reported, not failed.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stalwart.ckpt.dcp_format import file_generation
from stalwart.ckpt.durable import CorruptCheckpoint, DurableError, DurableStore
from stalwart.ckpt.manifest import MANIFEST_NAME

CHECK = "no write from a fenced generation"


@dataclass
class StepWrite:
    step: int
    generation: int | None  # the manifest's
    committed_at: float | None
    listed: list[int | None]  # the generation each file the manifest lists names
    unlisted: list[int] = field(default_factory=list)  # generations of files beside them
    adopted_by: int | None = None  # the next generation took it over (its history)


@dataclass
class Audit:
    where: str  # the store, for the check's detail
    steps: list[StepWrite]
    partial: dict[int, list[int]]  # step without a manifest -> its files' generations
    error: str | None = None  # why the store could not be read


def audit(uri: str, job: str, run: str | None) -> Audit:
    """What the store at `uri` holds of job `job`'s run `run` (manifests of other runs of the
    job, which share its directory, are left out; None: a run that never said which it
    is, so none are its)."""
    store = DurableStore(uri, job, retries=2, backoff_s=0.2)
    out = Audit(store.describe(), [], {})
    if run is None:
        return out
    try:
        for step in store.steps():
            names = [posixpath.basename(p) for p in store.fs.ls(store.step_dir(step), False)]
            gens = [g for g in map(file_generation, names) if g is not None]
            if MANIFEST_NAME not in names:
                if gens:
                    out.partial[step] = gens
                continue
            try:
                m = store.manifest(step)
            except CorruptCheckpoint:
                continue  # not this check's concern: `verify` says why it is never used
            if m.extra.get("run") != run:
                continue
            listed = [s.file for s in m.shards]
            out.steps.append(
                StepWrite(
                    step,
                    m.extra.get("generation"),
                    m.extra.get("committed_at"),
                    [file_generation(f) for f in listed],
                    [g for n in names if n not in listed and (g := file_generation(n)) is not None],
                    m.extra.get("adopted_by"),
                )
            )
    except (DurableError, OSError) as e:
        out.error = str(e)
    return out


def check(found: Audit | None, events: list[dict[str, Any]]) -> tuple[bool, str]:
    """(passed, detail) of the check on `found` (None: the job writes no durable
    checkpoints) against the run's `events`."""
    refused = _refused(events)
    if found is None:
        return True, "the job writes no durable checkpoints" + refused
    if found.error is not None:
        return False, f"{found.where} could not be read: {found.error}"
    persisted = sorted({e["step"] for e in events if e.get("type") == "persisted"})
    if persisted and not found.steps:
        return False, (
            f"the run persisted steps {persisted}, but {found.where} shows none of this run's "
            "from here (a store only the cluster's nodes see?): nothing could be checked"
        )
    gen_events = [e for e in events if e.get("type") == "generation"]
    started = sorted((e["generation"], e["ts"]) for e in gen_events)
    restored = {e["generation"]: e.get("restore_step") for e in gen_events}
    bad = []
    for w in found.steps:
        if w.generation is None:
            bad.append(f"step {w.step}: its manifest names no generation")
            continue
        owner = w.generation if w.adopted_by is None else w.adopted_by
        ended = min((ts for g, ts in started if g > owner), default=None)
        if ended is not None and (w.committed_at is None or w.committed_at > ended):
            bad.append(
                f"step {w.step}: committed by generation {owner} after generation "
                f"{_next(started, owner)} started"
            )
        above = restored.get(w.adopted_by)
        if w.adopted_by is not None and (above is None or w.step > above):
            bad.append(
                f"step {w.step}: generation {w.generation}'s write, adopted by generation "
                f"{w.adopted_by}, which restarted from step {above}"
            )
        others = sorted({g for g in w.listed if g != w.generation}, key=str)
        if others:
            bad.append(
                f"step {w.step}: generation {w.generation}'s manifest lists files of "
                f"generation(s) {', '.join(map(str, others))}"
            )
    if bad:
        return False, "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
    stray = sum(len(w.unlisted) for w in found.steps) + sum(map(len, found.partial.values()))
    gens = sorted({w.generation for w in found.steps})
    detail = (
        f"{len(found.steps)} step{'' if len(found.steps) == 1 else 's'} on {found.where}, "
        "each committed by the generation "
        f"running then ({', '.join(map(str, gens)) or 'none'}) and listing its files only"
    )
    if stray:
        detail += f"; {stray} file(s) no manifest lists (writes dropped or cut short)"
    return True, detail + refused


def _next(started: list[tuple[int, float]], generation: int) -> int:
    return min(g for g, _ in started if g > generation)


def _refused(events: list[dict[str, Any]]) -> str:
    """ "; fenced off: ring (1 event), durable (1 event)": what the fences turned away."""
    n = Counter(e.get("path") for e in events if e.get("type") in ("fenced", "persist_fenced"))
    if not n:
        return ""
    parts = [f"{p} ({k} event{'s' * (k > 1)})" for p, k in sorted(n.items(), key=str)]
    return "; fenced off: " + ", ".join(parts)

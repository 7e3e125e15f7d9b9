"""`stalwart verify JOB.yaml`: does this loop recover exactly?

Runs the job twice for N steps: once without faults, once with rank R's worker killed at
step S. Both runs keep their final state in a durable checkpoint of their own (under the
verify's output directory), which is then read back rank by rank and compared object by
object (ckpt/compare.py): each registered object identical or not, and the first tensor
that differs when not. A loop that breaks a condition of docs/exactness.md (an unregistered
scheduler, randomness stalwart does not capture, data that does not follow the step) shows
up here before a month-long run finds it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.ckpt.compare import ObjectDiff, compare_objects
from stalwart.ckpt.durable import CorruptCheckpoint, DurableError, DurableStore
from stalwart.orchestrator.spec import JobSpec


class VerifyError(ValueError):
    """The verify's own input is wrong (a kill step outside the run, a rank out of range)."""


@dataclass
class Verdict:
    steps: int
    kill_at: int
    rank: int
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # clean/faulty -> result
    diffs: dict[int, list[ObjectDiff]] = field(default_factory=dict)  # rank -> objects
    warnings: list[str] = field(default_factory=list)  # the job's exactness warnings
    error: str | None = None

    @property
    def identical(self) -> bool:
        return (
            self.error is None
            and bool(self.diffs)
            and all(d.identical for diffs in self.diffs.values() for d in diffs)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "steps": self.steps,
            "kill_at": self.kill_at,
            "rank": self.rank,
            "error": self.error,
            "warnings": self.warnings,
            "runs": {
                k: {x: r.get(x) for x in ("status", "output", "restarts", "model_digest")}
                for k, r in self.runs.items()
            },
            "objects": {
                str(rank): [vars(d) for d in diffs] for rank, diffs in sorted(self.diffs.items())
            },
        }


def plan(spec: JobSpec, steps: int | None, kill_at: int | None, rank: int) -> tuple[int, int]:
    n = steps or spec.steps
    at = kill_at if kill_at is not None else n // 2
    if not 1 <= at < n:
        raise VerifyError(f"--kill-at: must be between 1 and steps-1 ({n - 1}), got {at}")
    if not 0 <= rank < spec.max_workers:
        raise VerifyError(f"--rank: must be < workers ({spec.max_workers}), got {rank}")
    if spec.max_workers < 2:
        raise VerifyError("verify needs at least 2 workers: a kill is recovered from the others")
    return n, at


def variant(spec: JobSpec, steps: int, faults: list[dict[str, Any]], uri: str) -> JobSpec:
    """`spec` for N steps with these faults, its final state written to `uri`."""
    data = copy.deepcopy(spec.model_dump(mode="json"))
    data["steps"] = steps
    # verify's one fault is its own kill of the job's own worker: the command asks for it.
    data["chaos"] = {"enabled": True, "faults": faults}
    data["checkpoint"]["persist"] = {"uri": str(uri), "every_steps": steps, "keep_last": 1}
    return JobSpec.model_validate(data)


def final_states(uri: str, job: str, world: int) -> dict[int, Any]:
    """rank -> the restored state of the newest durable checkpoint under `uri` (a sharded
    model and its optimizer whole: their full tensors, ckpt/reshard.py)."""
    from stalwart.ckpt.reshard import whole_state

    store = DurableStore(uri, job)
    manifest, _ = store.newest_valid(world_size=world)
    if manifest is None:
        raise FileNotFoundError(f"{uri}: the run left no complete durable checkpoint")
    reader = functools.cache(lambda: store.reader(manifest.step, manifest))
    return {
        r: whole_state(store.read_shard(manifest.step, r, manifest), reader) for r in range(world)
    }


def verify(
    spec: JobSpec,
    run: Any,
    out: Path,
    steps: int | None = None,
    kill_at: int | None = None,
    rank: int = 1,
    storage: str | None = None,
) -> Verdict:
    """`run(spec, output_dir)` runs a job to its end and returns result.json's content.
    `storage`: where both runs' final checkpoints go (every node must reach it); default
    OUT/checkpoints, which only a cluster on this machine can write."""
    n, at = plan(spec, steps, kill_at, rank)
    verdict = Verdict(steps=n, kill_at=at, rank=rank)
    kill = [{"kind": "kill_worker", "rank": rank, "at_step": at}]
    root = storage.rstrip("/") if storage else str((out / "checkpoints").resolve())
    for name, faults in (("clean", []), ("faulty", kill)):
        result = run(variant(spec, n, faults, f"{root}/{name}"), out / name)
        verdict.runs[name] = result
        if name == "clean":
            verdict.warnings = _warnings(out / name / "events.jsonl")
        if result["status"] != "succeeded":
            verdict.error = f"the {name} run ended {result['status']}: " + str(
                (result.get("error") or {}).get("message", "")
            )
            return verdict
    faulty = verdict.runs["faulty"]
    if not faulty.get("failures"):
        verdict.error = f"the kill at step {at} did not happen (no failure was recorded)"
        return verdict
    world = int(faulty.get("workers") or spec.max_workers)
    try:
        clean_states = final_states(f"{root}/clean", spec.name, world)
        faulty_states = final_states(f"{root}/faulty", spec.name, world)
    except (FileNotFoundError, CorruptCheckpoint, DurableError) as e:
        verdict.error = f"the final checkpoints cannot be read back: {e}"
        return verdict
    for r in range(world):
        verdict.diffs[r] = compare_objects(clean_states[r], faulty_states[r])
    return verdict


def _warnings(events: Path) -> list[str]:
    """The exactness warnings (worker/exactness.py) a run's event log holds."""
    if not events.is_file():
        return []
    found = []
    for line in events.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("type") == "exactness_warning":
                found.append(event["reason"])
    return found

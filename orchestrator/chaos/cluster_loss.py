"""A chaos run that loses its whole cluster: the GCS restarted without fault tolerance.

Without `cluster.gcs_ft` a restarted GCS is another cluster: the raylets, the actors and the
drivers of the old one find a cluster id they do not know and Ray aborts them. That is what
a head node's restart does to a job on a cluster without GCS fault tolerance, and what
stalwart must survive through its durable tier: the job is submitted again and resumes
from the newest step on storage (`--resume auto`, the default of `stalwart run`).

So the chaos run trains in a process of its own (this module's `__main__`: the same
`run_job` as `stalwart run`), whose end the restart brings; the command (which Ray would
abort too, were it connected) then starts a new local cluster and runs the job again there,
resuming. The verdict is that second run's, plus the check that it resumed from the newest
step the first one persisted, and what the loss cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.ckpt.durable import DurableError, DurableStore
from stalwart.orchestrator.chaos.verdict import Check

DRIVER_END_S = 120.0  # the lost run's driver ends within this of the fault's end


def run_lost(
    spec_json: str,
    out: Path,
    address: str,
    base_dir: str | None,
    healed: Callable[[], bool],
) -> int:
    """Run the job described by `spec_json` on the cluster at `address` in a process of its
    own, writing its run directory `out`; returns its exit status (nonzero: the cluster
    went away under it). Once `healed()` (the fault is over) it has DRIVER_END_S to end,
    else it is killed: a run the restart did not take down trains no further here."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(spec_json)
    args = [sys.executable, "-m", __name__, str(out / "spec.json"), str(out), address]
    args += [base_dir or ""]
    with open(out / "driver.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = None
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if deadline is None and healed():
                deadline = time.monotonic() + DRIVER_END_S
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                return proc.wait()


def events_of(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the line the abort cut short
    return out


def newest_step(uri: str, job: str) -> int | None:
    """The newest complete step on the store (what `--resume auto` takes), None if none."""
    store = DurableStore(uri, job, retries=2, backoff_s=0.2)
    try:
        complete, _ = store.split_complete(store.steps())
    except (DurableError, OSError):
        return None
    return max(complete, default=None)


def resumed_check(
    newest: int | None, lost: list[dict[str, Any]], resumed: list[dict[str, Any]]
) -> Check:
    """The second run resumed from `newest`, the newest step on storage when the cluster
    was lost (read from the store: the lost run's own log may end before its last
    writes did); `lost`, `resumed`: the two runs' events."""
    name = "resumed from the newest durable step"
    reached = max((e.get("step") or 0 for e in lost if e.get("type") == "throughput"), default=0)
    steps = [e["step"] for e in resumed if e.get("type") == "resume" and e.get("step") is not None]
    step = steps[0] if steps else None
    if newest is None:
        ok = step is None
        return Check(
            name,
            ok,
            "the lost run left no step on storage: the job started over"
            if ok
            else f"resumed from step {step}, but the lost run left none on storage",
        )
    if step is None:
        return Check(name, False, f"storage held step {newest}, but the job started over")
    which = "the newest" if step == newest else f"not {newest}, the newest"
    return Check(
        name,
        step == newest,
        f"step {step} ({which} on storage when the cluster was lost); the lost run had "
        f"reached step {reached}: {max(reached - step, 0)} steps redone",
    )


def _main(argv: list[str]) -> int:
    spec_path, out, address, base_dir = argv
    from stalwart.orchestrator.driver import RunOptions, run_job
    from stalwart.orchestrator.spec import JobSpec

    spec = JobSpec.model_validate(json.loads(Path(spec_path).read_text()))
    opts = RunOptions(
        address=address,
        output=Path(out),
        base_dir=base_dir or None,
        resume="never",
        owns_cluster=True,
    )
    result = run_job(spec, opts)
    return 0 if result.get("status") == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

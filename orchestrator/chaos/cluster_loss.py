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
from pathlib import Path
from typing import Any

from stalwart.orchestrator.chaos.verdict import Check

DRIVER_END_S = 180.0  # the lost cluster's driver process ends within this of the restart


def run_lost(spec_json: str, out: Path, address: str, base_dir: str | None, timeout_s: float):
    """Run the job described by `spec_json` on the cluster at `address` in a process of its
    own, writing its run directory `out`; returns its exit status (nonzero: the cluster
    went away under it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(spec_json)
    args = [sys.executable, "-m", __name__, str(out / "spec.json"), str(out), address]
    args += [base_dir or ""]
    with open(out / "driver.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
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


def resumed_check(lost: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> Check:
    """The second run resumed from the newest step the lost one persisted."""
    persisted = [e["step"] for e in lost if e.get("type") == "persisted"]
    reached = max((e.get("step") or 0 for e in lost if e.get("type") == "throughput"), default=0)
    started = [e for e in resumed if e.get("type") == "resume"]
    newest = max(persisted, default=None)
    if newest is None:
        return Check(
            "resumed from the newest durable step",
            not started,
            "the lost run persisted no step: the job started over"
            if not started
            else f"resumed from step {started[0]['step']}, but the lost run persisted none",
        )
    if not started:
        return Check(
            "resumed from the newest durable step",
            False,
            f"the lost run persisted step {newest}, but the job started over",
        )
    step = started[0]["step"]
    return Check(
        "resumed from the newest durable step",
        step == newest,
        f"step {step} ({'the newest' if step == newest else f'not {newest}, the newest'} the "
        f"lost run persisted); it had reached step {reached}: {max(reached - step, 0)} "
        "steps redone",
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

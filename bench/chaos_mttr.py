#!/usr/bin/env python
"""Mean time to recovery per fault kind: detection, recovery and steps lost, stalwart
against Ray Train's own fault tolerance for the kind it handles in the same run.

    python bench/chaos_mttr.py [--repeats 3] [--kinds kill_worker,kill_node,hang,...]
        [--raytrain-repeats 3] [--set failure.standby=true] [--out bench/results/chaos_mttr.json]

stalwart: for each kind, one chaos run (orchestrator/chaos/runner.py, the job of
examples/chaos/job.yaml) on a local multi-node Ray this script starts (a CPU-less head and
worker nodes of 2 CPUs, one more per kill_node), with `--repeats` faults of that kind 40
steps apart (after_commit, on rotating ranks); the verdict's rows give each fault's figures
(detected after, recovered after: to every rank's next step, steps lost), and the run must
end with the failure-free digest. `kill_during_restore` is a kill_worker followed by a kill
of another rank while the first recovery restores.

Ray Train: its recovery (TorchTrainer with FailureConfig(max_failures) restarting its
worker group and resuming from its last reported checkpoint) from a rank SIGKILLed
(bench/recovery_vs_raytrain.py's `raytrain-kill` phase) and from a node killed, its raylet
and workers, on a local multi-node Ray of 2-CPU nodes with one to spare
(`raytrain-kill-node`), `--raytrain-repeats` times each, each in a process of its own. Ray
Train has no recovery of its own for a hang, a GPU fault or a failure during its restore:
those rows say so.
The raw figures go to --out as JSON; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXAMPLES = REPO / "examples" / "chaos"
DEFAULT_OUT = REPO / "bench" / "results" / "chaos_mttr.json"
KINDS = ("kill_worker", "kill_node", "hang", "gpu_xid", "kill_during_restore")


def _faults(kind: str, repeats: int) -> list[dict[str, Any]]:
    out = []
    for i in range(repeats):
        step, rank = 40 + 40 * i, 1 + i % 3
        if kind == "kill_during_restore":
            out.append({"kind": "kill_worker", "rank": rank, "at_step": step})
            other = (rank + 1) % 4
            out.append({"kind": "kill_worker", "rank": other, "at_step": step, "during": "restore"})
        elif kind == "gpu_xid":
            out.append({"kind": kind, "rank": rank, "at_step": step, "xid": 13})
        else:
            out.append({"kind": kind, "rank": rank, "at_step": step, "after_commit": True})
    return out


def scenario_for(kind: str, repeats: int, overrides: list[str] = ()):
    from stalwart.orchestrator.chaos.scenario import Cluster, Expect, JobRef, Scenario

    steps = 40 * repeats + 60
    nodes = 3 + (repeats if kind == "kill_node" else 0)
    sc = Scenario(
        name=f"mttr-{kind.replace('_', '-')}",
        job=JobRef(spec="job.yaml", set=[f"steps={steps}", "failure.max_restarts=50", *overrides]),
        cluster=Cluster(worker_nodes=nodes, cpus_per_node=2),
        faults=_faults(kind, repeats),
        expect=Expect(finishes=True, digest_equals_baseline=True),
    )
    sc.source = EXAMPLES / f"{sc.name}.yaml"  # relative paths resolve in examples/chaos
    return sc


def _stats(values: list[float]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    if not known:
        return {"n": 0, "median": None, "worst": None}
    return {"n": len(known), "median": statistics.median(known), "worst": max(known)}


def measure_stalwart(
    kind: str, repeats: int, work: Path, overrides: list[str] = ()
) -> dict[str, Any]:
    from stalwart.orchestrator.chaos.runner import ChaosOptions, run_scenario

    sc = scenario_for(kind, repeats, overrides)
    opts = ChaosOptions(output=work / sc.name, base_dir=str(EXAMPLES), cache_dir=work / "cache")
    t0 = time.time()
    v = run_scenario(sc, opts)
    rows = [r for r in v.faults if r.failures]
    return {
        "kind": kind,
        "passed": v.passed,
        "failed_checks": [f"{c.name}: {c.detail}" for c in v.checks if not c.ok],
        "faults": len(v.faults),
        "detected_s": _stats([r.detected_after_s for r in rows]),
        "recovered_s": _stats([r.recovered_after_s for r in rows]),
        "steps_lost": _stats([r.steps_lost for r in rows]),
        "tiers": [r.tiers for r in rows],
        "seconds": round(time.time() - t0, 1),
        "output": str(work / sc.name),
    }


RAYTRAIN_PHASES = {"kill_worker": "raytrain-kill", "kill_node": "raytrain-kill-node"}


def measure_raytrain(repeats: int, work: Path, kind: str = "kill_worker") -> dict[str, Any]:
    """Ray Train's recovery from a worker's loss (bench/recovery_vs_raytrain.py's
    raytrain-kill) or a node's (raytrain-kill-node)."""
    phase = RAYTRAIN_PHASES[kind]
    recs = []
    for i in range(repeats):
        out = work / f"{phase}-{i}.json"
        cmd = [
            sys.executable,
            str(REPO / "bench" / "recovery_vs_raytrain.py"),
            "--phases",
            phase,
            "--steps",
            "160",
            "--kill-step",
            str(40 + 20 * i),
            "--out",
            str(out),
        ]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            recs.append({"error": (done.stdout + done.stderr)[-2000:]})
            continue
        rec = json.loads(out.read_text()).get("results", {}).get(phase, {})
        recs.append(rec)
    return {
        "kind": kind,
        "recovered_s": _stats([r.get("recovery_s") for r in recs]),
        "steps_lost": _stats([r.get("steps_redone") for r in recs]),
        "runs": recs,
    }


def render(res: dict[str, Any]) -> str:
    def f(st: dict[str, Any], unit: str = "s") -> str:
        if not st or st.get("median") is None:
            return "-"
        fmt = (lambda v: f"{v:.2f}") if unit == "s" else (lambda v: f"{v:g}")
        return f"{fmt(st['median'])} / {fmt(st['worst'])}"

    lines = [
        "| fault kind | n | detected (median / worst, s) | recovered (s) | steps lost | "
        "Ray Train recovered (s) | Ray Train steps lost |",
        "|---|---|---|---|---|---|---|",
    ]
    rt = res.get("raytrain") or {}
    if "recovered_s" in rt:  # an older result: worker loss only
        rt = {"kill_worker": rt}
    for kind, m in res["stalwart"].items():
        peer = rt.get(kind) or {}
        rt_rec = f(peer.get("recovered_s")) if peer else "no recovery of its own"
        rt_lost = f(peer.get("steps_lost"), "") if peer else "-"
        lines.append(
            f"| {kind}{'' if m['passed'] else ' (FAILED: ' + '; '.join(m['failed_checks']) + ')'}"
            f" | {m['recovered_s']['n']} | {f(m['detected_s'])} | {f(m['recovered_s'])} | "
            f"{f(m['steps_lost'], '')} | {rt_rec} | {rt_lost} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="faults of each kind (one run)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    p.add_argument("--raytrain-repeats", type=int, default=3, help="0: skip Ray Train")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job spec override for stalwart's runs (repeatable), e.g. failure.standby=true",
    )
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"--kinds: unknown {sorted(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="stalwart-mttr-"))
    res: dict[str, Any] = {"repeats": args.repeats, "stalwart": {}, "started": time.time()}
    for kind in kinds:
        print(f"stalwart: {kind} x{args.repeats} ...", flush=True)
        res["stalwart"][kind] = measure_stalwart(kind, args.repeats, work, args.set)
    if args.raytrain_repeats:
        res["raytrain"] = {}
        for kind in [k for k in RAYTRAIN_PHASES if k in kinds]:
            print(f"Ray Train: {kind} x{args.raytrain_repeats} ...", flush=True)
            res["raytrain"][kind] = measure_raytrain(args.raytrain_repeats, work, kind)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(render(res))
    return 0 if all(m["passed"] for m in res["stalwart"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

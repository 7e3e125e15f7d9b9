#!/usr/bin/env python
"""What snapshotting every step costs an FSDP2 job: stalwart against plain FSDP2, same run.

    python bench/fsdp_overhead.py [--steps 120] [--warmup 20] [--workers 4] [--repeats 2]
        [--shard 4] [--out bench/results/fsdp_overhead.json]

Both train examples/fsdp's loop on the job of examples/fsdp/job.yaml (its model, batch, lr,
seed; ``--shard`` < workers: HSDP with shard groups of that size): a ``fully_shard`` per
block and on the root, AdamW, gradient clipping, the loss read every step.

- plain-fsdp: ``torch.multiprocessing``, gloo over a FileStore, torch's own process groups
  and DeviceMesh, no Ray, no checkpoint;
- stalwart-fsdp: ``stalwart run`` of the job on an embedded Ray, a snapshot of every rank's
  DTensor shards every step (checkpoint.every_steps=1), nothing injected;
- stalwart-fsdp-sparse: the same with a snapshot every 10 steps (what the rest of stalwart
  costs without the snapshots).

Seconds per step on rank 0 (the starts of consecutive steps, the first --warmup skipped) and
CPU seconds per step over the ranks; phases interleaved --repeats times, each in a child
process of its own (bench/recovery_vs_raytrain.py's harness), the best median kept. Prints
the ratios to plain FSDP2; the goal is stalwart-fsdp <= 1.05x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
for path in (REPO, THIS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import recovery_vs_raytrain as harness  # noqa: E402 (the step clock, stats, child phases)

SPEC_PATH = REPO / "examples" / "fsdp" / "job.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "fsdp_overhead.json"
PHASES = ("plain-fsdp", "stalwart-fsdp", "stalwart-fsdp-sparse")


def _workload(shard: int | None) -> dict[str, Any]:
    from stalwart.orchestrator.spec import load_spec

    spec = load_spec(SPEC_PATH)
    return {
        "model": dict(spec.config.get("model", {})),
        "batch": int(spec.config.get("batch_size", 16)),
        "lr": float(spec.config.get("lr", 3e-3)),
        "seed": spec.seed,
        "shard": shard,
    }


class _Ctx:
    """What examples/fsdp/train.py asks of a ctx, for the plain run."""

    def __init__(self, rank: int, world: int, wl: dict[str, Any], steps: int, clock: Any):
        import torch

        self.rank, self.world_size, self.seed = rank, world, wl["seed"]
        self.device = torch.device("cpu")
        self.config = {"model": wl["model"], "batch_size": wl["batch"], "lr": wl["lr"]}
        if wl["shard"]:
            self.config["shard"] = wl["shard"]
        self._steps, self._clock = steps, clock

    def register(self, **objects: Any) -> None:
        pass

    def report(self, **metrics: Any) -> None:
        pass

    def steps(self):
        for step in range(self._steps):
            self._clock.step()
            yield step
        self._clock.end()


def _plain_worker(
    rank: int, world: int, wl: dict[str, Any], steps: int, warmup: int, store: str, out: str
) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.examples.fsdp.train import train_loop
    from stalwart.orchestrator.worker.context import seed_all  # as stalwart's workers seed

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    seed_all(wl["seed"])
    clock = harness._StepClock(warmup)
    train_loop(_Ctx(rank, world, wl, steps, clock))
    harness._write_json(Path(out) / f"steps_r{rank}.json", clock.record())
    dist.destroy_process_group()


def phase_plain(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = work / "plain-steps"
    out.mkdir(exist_ok=True)
    wl = _workload(args.shard)
    mp.start_processes(
        _plain_worker,
        args=(args.workers, wl, args.steps, args.warmup, str(work / "store"), str(out)),
        nprocs=args.workers,
        start_method="spawn",
    )
    ranks = [harness._read_json(out / f"steps_r{r}.json") for r in range(args.workers)]
    return {
        "status": "succeeded",
        "step_time": harness._step_stats(ranks[0]["starts"], args.warmup),
        "cpu": harness._cpu_stats(ranks, args.warmup),
    }


def stalwart_timed_loop(ctx: Any) -> None:
    """examples/fsdp's loop, unchanged, each rank noting when its steps start."""
    from stalwart.examples.fsdp.train import train_loop

    timed = harness._TimedContext(ctx, int(ctx.config.get("bench_warmup", 0)))
    train_loop(timed)
    harness._write_json(
        Path(ctx.config["bench_timing_dir"]) / f"steps_r{ctx.rank}.json",
        timed.clock.record(generation=ctx.generation),
    )


def phase_stalwart(args: argparse.Namespace, work: Path, every: int) -> dict[str, Any]:
    from stalwart.orchestrator.driver import RunOptions, run_job
    from stalwart.orchestrator.spec import load_spec

    timing = work / "stalwart-steps"
    timing.mkdir(exist_ok=True)
    overrides = [
        f"steps={args.steps}",
        f"workers={args.workers}",
        f"checkpoint.every_steps={every}",
        "chaos.faults=[]",
        f"entrypoint={THIS}:stalwart_timed_loop",
        f"config.bench_timing_dir={timing}",
        f"config.bench_warmup={args.warmup}",
    ]
    if args.shard:
        overrides.append(f"config.shard={args.shard}")
    result = run_job(load_spec(SPEC_PATH, overrides), RunOptions(output=work / "out"))
    ranks = [harness._read_json(timing / f"steps_r{r}.json") for r in range(args.workers)]
    return {
        "status": result.get("status"),
        "error": result.get("error"),
        "model_digest": result.get("model_digest"),
        "checkpoint": result.get("checkpoint"),
        "step_time": harness._step_stats(ranks[0]["starts"], args.warmup),
        "cpu": harness._cpu_stats(ranks, args.warmup),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shard", type=int, default=None, help="HSDP shard group size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--phase-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _run(name: str, args: argparse.Namespace, root: Path, index: int) -> dict[str, Any]:
    """One phase in a child process of its own (the harness's environment: its own Ray)."""
    import subprocess

    work = root / f"p{index}"
    work.mkdir()
    out = work / "phase.json"
    cmd = [
        sys.executable,
        str(THIS),
        f"--phase={name}",
        f"--phase-out={out}",
        f"--work={work}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--workers={args.workers}",
        *([f"--shard={args.shard}"] if args.shard else []),
    ]
    with (work / "log.txt").open("w") as log:
        rc = subprocess.run(
            cmd,
            cwd=REPO,
            env=harness._child_env(work),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.phase_timeout,
        ).returncode
    if out.exists():
        return harness._read_json(out)
    tail = (work / "log.txt").read_text(errors="replace")[-3000:]
    return {"status": "failed", "error": f"phase exited with {rc}; log tail:\n{tail}"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        phases = {
            "plain-fsdp": lambda: phase_plain(args, args.work),
            "stalwart-fsdp": lambda: phase_stalwart(args, args.work, every=1),
            "stalwart-fsdp-sparse": lambda: phase_stalwart(args, args.work, every=10),
        }
        try:
            rec = phases[args.phase]()
        except Exception:
            rec = {"status": "failed", "error": traceback.format_exc()}
        harness._write_json(args.phase_out, rec)
        return 0
    names = [n for n in args.phases.split(",") if n]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        index = 0
        for rep in range(args.repeats):
            for name in names:
                t0 = time.time()
                rec = _run(name, args, Path(tmp), index)
                index += 1
                runs[name].append(rec)
                median = harness._get(rec, "step_time", "median_s")
                print(
                    f"[{rep + 1}/{args.repeats}] {name}: {rec['status']}, median "
                    f"{harness._fmt(median, '.4f')} s/step ({time.time() - t0:.0f} s)",
                    flush=True,
                )
    best = {n: harness._best(recs) for n, recs in runs.items()}
    plain = harness._get(best.get("plain-fsdp"), "step_time", "median_s")
    ratios = {
        f"{n}/plain-fsdp": harness._ratio(harness._get(best[n], "step_time", "median_s"), plain)
        for n in names
        if n != "plain-fsdp"
    }
    cpu_plain = harness._get(best.get("plain-fsdp"), "cpu", "cpu_s_per_step_all_ranks")
    cpu = {
        f"{n}/plain-fsdp": harness._ratio(
            harness._get(best[n], "cpu", "cpu_s_per_step_all_ranks"), cpu_plain
        )
        for n in names
        if n != "plain-fsdp"
    }
    summary = {
        "config": {k: v for k, v in vars(args).items() if k not in ("phase", "phase_out", "work")},
        "step_time_ratios": ratios,
        "cpu_per_step_ratios": cpu,
        "best": best,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    for key, value in ratios.items():
        print(f"{key}: {harness._fmt(value)} step time, {harness._fmt(cpu.get(key))} CPU")
    print(f"raw figures: {args.out}")
    return 0 if all(r["status"] == "succeeded" for recs in runs.values() for r in recs) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

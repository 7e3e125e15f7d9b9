#!/usr/bin/env python
"""Recovery time and step time: stalwart against Ray Train v2 and plain torch DDP.

    python bench/recovery_vs_raytrain.py [--steps 200] [--kill-step 60] [--kill-rank 1]
        [--workers 4] [--out bench/results/recovery_vs_raytrain.json] [--repeats 1]
        [--set failure.standby=false]

All runs train the quickstart's model (examples/gpt, settings read from examples/quickstart.yaml)
on the same data (``synthetic_batch`` indexed by step and rank), with the same optimizer (AdamW,
the spec's lr, weight decay 0.01), the same number of workers and one CPU thread per worker.

1. Recovery. Rank ``--kill-rank`` SIGKILLs itself just before computing step ``--kill-step``,
   once, under
   - stalwart: the quickstart job (in-memory checkpoint every step, in-process recovery);
     figures from its result.json (``failures[0]``);
   - Ray Train v2: ``TorchTrainer`` with ``FailureConfig(max_failures=3)``, rank 0 reporting a
     ``torch.save`` checkpoint every ``--ckpt-every`` steps to local storage, resuming from
     ``ray.train.get_checkpoint()``; the workers write timestamp files (kill, first step done
     after the restore) that this script reads back.
   Recovery time = from the kill to the first step completed after the restore (the latest
   rank to complete it).
2. Steady state, no failure: seconds per step on rank 0 (time between the starts of
   consecutive steps, first ``--warmup`` steps skipped; median, mean, p90 and the mean of the
   fastest 20 consecutive steps) and CPU seconds per step summed over the ranks' processes,
   for stalwart (checkpoint every step; the quickstart loop wrapped only to note step times),
   Ray Train (report + checkpoint every ``--ckpt-every`` steps) and plain torch DDP
   (``torch.multiprocessing``, gloo over a FileStore, no Ray). Opt-in, with ``--phases``:
   ``stalwart-sparse-ckpt``, stalwart snapshotting every ``--ckpt-every`` steps only.

Each measurement runs in a child process of its own, with its own Ray instance under a private
RAY_TMPDIR (so it never attaches to another Ray running on the machine) and its output in a
log file; this process only prints progress and the final table. gloo is kept on the loopback
interface (GLOO_SOCKET_IFNAME=lo). The raw figures go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SPEC_PATH = REPO / "examples" / "quickstart.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "recovery_vs_raytrain.json"
WEIGHT_DECAY = 0.01  # as examples/gpt/train.py
WINDOW_STEPS = 20  # s/step is also given as the mean of the fastest run of this many steps
DEFAULT_PHASES = (
    "plain-ddp",
    "stalwart-steady",
    "raytrain-steady",
    "stalwart-kill",
    "stalwart-kill-cold",
    "stalwart-kill-standby",
    "raytrain-kill",
)
# Opt-in diagnostic: stalwart with its snapshot only every --ckpt-every steps (as Ray Train's),
# which separates the per-step snapshot's cost from the rest of stalwart's per-step overhead.
# bench/chaos_mttr.py's: a node of a multi-node local Ray killed (its raylet and workers).
PHASES = (*DEFAULT_PHASES, "stalwart-sparse-ckpt", "raytrain-kill-node")
STEADY_PHASES = ("plain-ddp", "stalwart-steady", "stalwart-sparse-ckpt", "raytrain-steady")


# --- small helpers (also used inside workers: stdlib only) ---------------------------------------


def _write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def _process_start_time() -> float | None:
    """Wall-clock time this process was started (from /proc; None where unavailable)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _train_step(
    model: Any, optimizer: Any, step: int, rank: int, wl: dict[str, Any], cfg: Any
) -> float:
    """One step of the quickstart's loop (examples/gpt/train.py), for the peers' workers."""
    from stalwart.examples.gpt.model import loss_fn, synthetic_batch

    inputs, targets = synthetic_batch(step, rank, wl["batch"], cfg, wl["seed"])
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


class _StepClock:
    """Notes when each step starts, and this process's CPU time (all its threads) from the end
    of the warm-up to the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.starts: list[float] = []
        self._cpu0: float | None = None
        self._cpu1: float | None = None

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system

    def step(self) -> None:
        if len(self.starts) == self.warmup:
            self._cpu0 = self._cpu()
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        if len(self.starts) == self.warmup:
            self._cpu0 = self._cpu()
        self.starts.append(time.perf_counter())
        self._cpu1 = self._cpu()

    def record(self, **extra: Any) -> dict[str, Any]:
        cpu = self._cpu1 - self._cpu0 if None not in (self._cpu0, self._cpu1) else None
        return {"starts": self.starts, "cpu_s": cpu, **extra}


def _cpu_stats(records: list[dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """CPU seconds per step summed over the ranks' processes, over the measured steps."""
    cpus = [r.get("cpu_s") for r in records]
    steps = len(records[0]["starts"]) - 1 - warmup if records else 0
    if not records or None in cpus or steps <= 0:
        return None
    return {
        "cpu_s_per_step_all_ranks": sum(cpus) / steps,
        "cpu_s_per_rank": cpus,
        "steps_measured": steps,
    }


def _step_stats(starts: list[float], warmup: int) -> dict[str, Any] | None:
    """Per-step seconds from the start times of consecutive steps (+ the end of the last one)."""
    durations = [b - a for a, b in itertools.pairwise(starts)][warmup:]
    if not durations:
        return None
    ordered = sorted(durations)
    # The least disturbed stretch: other load on a shared machine comes and goes.
    window = min(WINDOW_STEPS, len(durations))
    best_window = min(
        statistics.fmean(durations[i : i + window]) for i in range(len(durations) - window + 1)
    )
    return {
        "median_s": statistics.median(durations),
        "mean_s": statistics.fmean(durations),
        "best_window_mean_s": best_window,
        "window_steps": window,
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min_s": ordered[0],
        "max_s": ordered[-1],
        "steps_measured": len(durations),
        "warmup_skipped": warmup,
    }


def _workload() -> dict[str, Any]:
    """The quickstart's model, batch, lr and seed, read from its job spec."""
    from stalwart.orchestrator.spec import load_spec

    spec = load_spec(SPEC_PATH)
    return {
        "model": dict(spec.config.get("model", {})),
        "batch": int(spec.config.get("batch_size", 16)),
        "lr": float(spec.config.get("lr", 3e-3)),
        "weight_decay": WEIGHT_DECAY,
        "seed": spec.seed,
    }


# --- stalwart ----------------------------------------------------------------------------------


class _TimedContext:
    """Passes everything to stalwart's TrainContext; notes when each step starts."""

    def __init__(self, ctx: Any, warmup: int):
        self._ctx = ctx
        self.first_step: int | None = None
        self.clock = _StepClock(warmup)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def steps(self):
        for step in self._ctx.steps():
            if self.first_step is None:
                self.first_step = step
            self.clock.step()
            yield step
        self.clock.end()


def stalwart_timed_loop(ctx: Any) -> None:
    """The quickstart's train loop, unchanged, with each rank noting when its steps start.

    Used as the steady-state job's entrypoint (loaded by file path in the workers).
    """
    from stalwart.examples.gpt.train import train_loop

    timed = _TimedContext(ctx, int(ctx.config.get("bench_warmup", 0)))
    train_loop(timed)
    out = ctx.config.get("bench_timing_dir")
    if out:
        _write_json(
            Path(out) / f"steps_r{ctx.rank}.json",
            timed.clock.record(generation=ctx.generation, first_step=timed.first_step),
        )


def phase_stalwart(
    args: argparse.Namespace,
    work: Path,
    kill: bool,
    every: int | None = None,
    spares: int | None = None,
    standby: bool | None = None,
) -> dict[str, Any]:
    from stalwart.orchestrator.driver import RunOptions, run_job
    from stalwart.orchestrator.spec import load_spec

    timing = work / "stalwart-steps"
    timing.mkdir(exist_ok=True)
    overrides = [f"steps={args.steps}", f"workers={args.workers}", *args.set]
    if every is not None:
        overrides.append(f"checkpoint.every_steps={every}")
    if spares is not None:
        overrides.append(f"failure.spares={spares}")
    if standby is not None:  # None: the default (on where memory allows)
        overrides.append(f"failure.standby={str(standby).lower()}")
    if kill:
        overrides.append(
            f"chaos.faults=[{{kind: kill_worker, rank: {args.kill_rank}, "
            f"at_step: {args.kill_step}}}]"
        )
    else:
        overrides += [
            "chaos.faults=[]",
            f"entrypoint={THIS}:stalwart_timed_loop",
            f"config.bench_timing_dir={timing}",
            f"config.bench_warmup={args.warmup}",
        ]
    spec = load_spec(SPEC_PATH, overrides)
    out = work / "stalwart-output"
    t0 = time.time()
    result = run_job(spec, RunOptions(output=out, base_dir=str(REPO)))
    wall = time.time() - t0
    events = [
        json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()
    ]
    rec: dict[str, Any] = {
        "status": result.get("status"),
        "steps_completed": result.get("steps_completed"),
        "final_loss": result.get("final_loss"),
        "model_digest": result.get("model_digest"),
        "restarts": result.get("restarts"),
        "generations": result.get("generations"),
        "lost_steps_total": result.get("lost_steps_total"),
        "job_wall_s": result.get("wall_seconds"),
        "training_seconds": result.get("training_seconds"),
        "steps_per_second": result.get("steps_per_second"),
        "checkpoint": result.get("checkpoint"),
        "error": result.get("error"),
        "wall_incl_ray_start_s": wall,
        "event_counts": _count(e.get("type") for e in events),
        # run_job's start (Ray's start included) -> the first step on every rank, by phase.
        "startup": result.get("startup"),
    }
    rec.update(_stalwart_first_step(result.get("startup")))
    if result.get("training_seconds") and result.get("steps_completed"):
        rec["training_seconds_per_step"] = result["training_seconds"] / result["steps_completed"]
    if kill:
        failures = result.get("failures") or []
        f = dict(failures[0]) if failures else {}
        for key in ("traceback", "message"):
            if f.get(key):
                f[key] = f[key][-500:]
        rec["failures_recorded"] = len(failures)
        rec["failure"] = f
        rec["recovery_s"] = f.get("recovered_after_s")
        rec["detected_after_s"] = f.get("detected_after_s")
        rec["steps_redone"] = f.get("steps_redone")
        rec["resumed_from_step"] = f.get("restored_step")
        rec["killed_at_step"] = f.get("step")
        rec["phases_s"] = f.get("phases_s")
        # How each replaced rank got its process: spare, standby, bundle (a new process).
        rec["replaced_via"] = {
            r: v["via"] for e in events if e["type"] == "replaced" for r, v in e["ranks"].items()
        }
        keep = {"fault_injected", "decision", "generation", "recovered", "state"}
        rec["events"] = [
            {k: v for k, v in e.items() if k != "failures"} for e in events if e["type"] in keep
        ]
    else:
        ranks = [_read_json(timing / f"steps_r{r}.json") for r in range(args.workers)]
        rec["step_time"] = _step_stats(ranks[0]["starts"], args.warmup)
        rec["cpu"] = _cpu_stats(ranks, args.warmup)
        rec["timed_generation"] = ranks[0]["generation"]
    return rec


def _stalwart_first_step(startup: dict[str, Any] | None) -> dict[str, Any]:
    """Time to the first step, with and without starting Ray (result.json's `startup`)."""
    first = (startup or {}).get("first_step_after_s")
    if first is None:
        return {}
    ray_s = startup["phases_s"].get("ray_init", 0.0)
    return {"time_to_first_step_incl_ray_s": first, "time_to_first_step_s": first - ray_s}


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


# --- Ray Train v2 ------------------------------------------------------------------------------


def _raytrain_loop(config: dict[str, Any]) -> None:
    """Ray Train worker loop (pickled by value: only stdlib names from this module's top)."""
    import signal as _signal

    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    from stalwart.examples.gpt.model import GPT, GPTConfig
    from stalwart.orchestrator.worker.context import seed_all  # the seeding stalwart's workers do

    entered = time.time()
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    marks = Path(config["marks"])
    # An attempt started after the kill: time its first step, with or without a checkpoint.
    after_kill = (marks / "killed").exists()
    wl = config["workload"]
    steps, every = config["steps"], config["ckpt_every"]
    kill = config.get("kill")
    pid = os.getpid()

    seed_all(wl["seed"])
    cfg = GPTConfig(**wl["model"])
    model = prepare_model(GPT(cfg))
    prepared_at = time.time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=wl["lr"], weight_decay=wl["weight_decay"])
    start, restored = 0, False
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, restored = int(state["step"]), True
    restored_at = time.time()
    _write_json(
        marks / f"attempt_r{rank}_p{pid}.json",
        {
            "rank": rank,
            "pid": pid,
            "process_started": _process_start_time(),
            "entered": entered,
            "model_prepared": prepared_at,
            "restored": restored_at,
            "after_kill": after_kill,
            "from_step": start,
            "checkpoint_found": restored,
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        },
    )

    clock = _StepClock(config["warmup"])
    loss_value = float("nan")
    try:
        for step in range(start, steps):
            if kill and rank == kill["rank"] and step == kill["step"]:
                try:
                    fd = os.open(marks / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    fd = None  # already killed once: this is the restarted attempt
                if fd is not None:
                    os.close(fd)
                    _write_json(marks / "kill.json", {"t": time.time(), "rank": rank, "step": step})
                    if kill.get("node"):  # this rank's whole node: its raylet and workers
                        from stalwart.orchestrator.chaos.actions import kill_node

                        kill_node()
                    os.kill(os.getpid(), _signal.SIGKILL)
            clock.step()
            loss_value = _train_step(model, optimizer, step, rank, wl, cfg)
            if after_kill and step == start:
                _write_json(
                    marks / f"first_step_r{rank}_p{pid}.json",
                    {"t": time.time(), "from_step": start, "rank": rank},
                )
            elif step == start and not after_kill:  # the job's first step (time to it)
                _write_json(marks / f"start_step_r{rank}_p{pid}.json", {"t": time.time()})
            if (step + 1) % every == 0 or step + 1 == steps:
                metrics = {"loss": loss_value, "step": step + 1}
                if rank == 0:
                    with tempfile.TemporaryDirectory() as tmp:
                        torch.save(
                            {
                                "model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(),
                                "step": step + 1,
                            },
                            Path(tmp) / "state.pt",
                        )
                        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
                else:
                    ray.train.report(metrics)
        clock.end()
    except BaseException as e:
        _write_json(
            marks / f"error_r{rank}_p{pid}.json",
            {"t": time.time(), "rank": rank, "error": f"{type(e).__name__}: {e}"[:500]},
        )
        raise
    final = torch.tensor([loss_value])
    dist.all_reduce(final)
    _write_json(
        marks / f"steps_r{rank}_p{pid}.json",
        clock.record(rank=rank, first_step=start, final_loss=final.item() / dist.get_world_size()),
    )


def phase_raytrain(
    args: argparse.Namespace, work: Path, kill: bool, node: bool = False
) -> dict[str, Any]:
    """Ray Train's run, with a rank SIGKILLed (`kill`) or its node killed (`node`: on a
    local multi-node Ray of 2-CPU worker nodes, one more than the workers need)."""
    import ray

    t_init = time.time()
    cluster = None
    if node:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, "include_dashboard": False},
        )
        for _ in range(-(-args.workers // 2) + 1):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
    ray.init(
        address=cluster.address if cluster else "local",
        **({} if cluster else {"num_cpus": max(4, args.workers), "include_dashboard": False}),
        log_to_driver=False,
        configure_logging=True,
        logging_level="ERROR",
    )
    try:
        import ray.train.torch as rtt
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2._internal.constants import (
            DEFAULT_HEALTH_CHECK_INTERVAL_S,
            HEALTH_CHECK_INTERVAL_S_ENV_VAR,
            is_v2_enabled,
        )

        marks = work / "marks"
        marks.mkdir(parents=True, exist_ok=True)
        config = {
            "workload": _workload(),
            "steps": args.steps,
            "ckpt_every": args.ckpt_every,
            "warmup": args.warmup,
            "kill": {"rank": args.kill_rank, "step": args.kill_step, "node": node}
            if kill
            else None,
            "marks": str(marks),
        }
        trainer = rtt.TorchTrainer(
            _raytrain_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name="bench-kill" if kill else "bench-steady",
                storage_path=str(work / "storage"),
                failure_config=FailureConfig(max_failures=3),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        t0 = time.time()
        error = None
        try:
            result = trainer.fit()
            reported = dict(result.metrics or {})
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:2000]
            reported = {}
        t1 = time.time()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()

    rec: dict[str, Any] = {
        "status": "succeeded" if error is None else "failed",
        "error": error,
        "ray_train_v2": is_v2_enabled(),
        "trainer_class": f"{rtt.TorchTrainer.__module__}.{rtt.TorchTrainer.__name__}",
        "health_check_interval_s": float(
            os.environ.get(HEALTH_CHECK_INTERVAL_S_ENV_VAR, DEFAULT_HEALTH_CHECK_INTERVAL_S)
        ),
        "last_reported": reported,
        "fit_wall_s": t1 - t0,
        "wall_incl_ray_start_s": t1 - t_init,
    }
    attempts = [_read_json(p) for p in sorted(marks.glob("attempt_r*_p*.json"))]
    rec["attempts"] = len({a["pid"] for a in attempts if a["rank"] == 0})
    rec["gloo_socket_ifname"] = sorted({str(a.get("gloo_socket_ifname")) for a in attempts})
    finals = {}  # rank -> the record of its last (completing) attempt
    for path in sorted(marks.glob("steps_r*_p*.json"), key=lambda q: q.stat().st_mtime):
        data = _read_json(path)
        finals[data["rank"]] = data
    if 0 in finals:
        rec["final_loss"] = finals[0]["final_loss"]
    rec["checkpoints_in_storage"] = _stored_checkpoints(work / "storage")
    # TorchTrainer.fit()'s call (and Ray's start) -> the first step on every rank.
    starts = [_read_json(p)["t"] for p in marks.glob("start_step_r*_p*.json")]
    if len(starts) >= args.workers:
        rec["time_to_first_step_s"] = max(starts) - t0
        rec["time_to_first_step_incl_ray_s"] = max(starts) - t_init
    if not kill:
        if 0 in finals:
            rec["step_time"] = _step_stats(finals[0]["starts"], args.warmup)
            rec["cpu"] = _cpu_stats([finals[r] for r in sorted(finals)], args.warmup)
        return rec

    if not (marks / "kill.json").exists():
        rec["error"] = rec["error"] or "the kill did not happen"
        return rec
    k = _read_json(marks / "kill.json")
    t_kill = k["t"]
    for c in rec["checkpoints_in_storage"]:
        c["written_after_kill_s"] = c.pop("mtime") - t_kill
    rec["killed_at_step"] = k["step"]
    firsts = [_read_json(p) for p in marks.glob("first_step_r*_p*.json")]
    resumed = [a for a in attempts if a["after_kill"]]
    errors = [_read_json(p) for p in marks.glob("error_r*_p*.json")]
    if firsts:
        rec["recovery_s"] = max(f["t"] for f in firsts) - t_kill
        rec["resumed_from_step"] = min(f["from_step"] for f in firsts)
        rec["checkpoint_found_on_restart"] = all(a["checkpoint_found"] for a in resumed)
        rec["steps_redone"] = k["step"] - rec["resumed_from_step"]
    phases: dict[str, float | None] = {}
    survivors = [e["t"] for e in errors if e["t"] >= t_kill]
    phases["survivors_see_error"] = min(survivors) - t_kill if survivors else None
    phases.update(_controller_timeline(work, t_kill))
    started = [a["process_started"] for a in resumed if a.get("process_started")]
    phases["new_worker_processes_started"] = max(started) - t_kill if started else None
    if resumed:
        phases["train_fn_entered"] = max(a["entered"] for a in resumed) - t_kill
        phases["model_built_and_ddp_wrapped"] = max(a["model_prepared"] for a in resumed) - t_kill
        phases["checkpoint_loaded"] = max(a["restored"] for a in resumed) - t_kill
    if firsts:
        phases["first_step_done"] = rec["recovery_s"]
    rec["timeline_after_kill_s"] = phases
    rec["worker_errors"] = [e["error"] for e in errors][:4]
    return rec


def _stored_checkpoints(storage: Path) -> list[dict[str, Any]]:
    """The checkpoint directories left in Ray Train's storage, with the step each holds."""
    import torch

    out = []
    for d in sorted(q for q in storage.glob("*/checkpoint_*") if q.is_dir()):
        try:
            step = torch.load(d / "state.pt", map_location="cpu", weights_only=True)["step"]
        except Exception:
            step = None
        out.append(
            {
                "dir": d.name,
                "step": step,
                "mtime": (d / "state.pt").stat().st_mtime
                if (d / "state.pt").exists()
                else d.stat().st_mtime,
            }
        )
    return out


# First occurrence, after the kill, of these Ray Train controller log messages (its own debug
# logs, in the session's logs/train/; absent ones are left out).
_CONTROLLER_MARKS = (
    ("controller_decided_retry", "[FailurePolicy] RETRY"),
    ("old_worker_group_shut_down", "Worker group shutdown successful"),
    ("new_worker_actors_created", "worker actors created in"),
    ("train_context_initialized", "Train context initialized on workers"),
    ("train_fn_launched", "Started training worker group"),
)


def _controller_timeline(work: Path, t_kill: float) -> dict[str, float]:
    import datetime

    found: dict[str, float] = {}
    for path in sorted(work.glob("ray/session_*/logs/train/ray-train-*controller*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                t = datetime.datetime.strptime(rec["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            if t < t_kill:
                continue
            for key, text in _CONTROLLER_MARKS:
                if text in str(rec.get("message", "")) and (key not in found or t < found[key]):
                    found[key] = t
    return {key: found[key] - t_kill for key, _ in _CONTROLLER_MARKS if key in found}


# --- plain torch DDP ---------------------------------------------------------------------------


def _ddp_worker(
    rank: int,
    world: int,
    wl: dict[str, Any],
    steps: int,
    warmup: int,
    store_path: str,
    out_dir: str,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stalwart.examples.gpt.model import GPT, GPTConfig
    from stalwart.orchestrator.worker.context import seed_all  # the seeding stalwart's workers do

    imported = time.time()
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    group_ready = time.time()
    seed_all(wl["seed"])
    cfg = GPTConfig(**wl["model"])
    model = DistributedDataParallel(GPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=wl["lr"], weight_decay=wl["weight_decay"])
    model_ready = time.time()
    clock = _StepClock(warmup)
    loss_value = float("nan")
    first_done = None
    for step in range(steps):
        clock.step()
        loss_value = _train_step(model, optimizer, step, rank, wl, cfg)
        if first_done is None:
            first_done = time.time()
    clock.end()
    final = torch.tensor([loss_value])
    dist.all_reduce(final)
    _write_json(
        Path(out_dir) / f"steps_r{rank}.json",
        clock.record(
            final_loss=final.item() / world,
            gloo_socket_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
            startup={
                "process_started": _process_start_time(),
                "torch_imported": imported,
                "group_ready": group_ready,
                "model_ready": model_ready,
                "first_step_done": first_done,
            },
        ),
    )
    dist.destroy_process_group()


def phase_ddp(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = work / "ddp-steps"
    out.mkdir(exist_ok=True)
    t0 = time.time()
    ctx = mp.start_processes(
        _ddp_worker,
        args=(
            args.workers,
            _workload(),
            args.steps,
            args.warmup,
            str(work / "ddp-store"),
            str(out),
        ),
        nprocs=args.workers,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + args.phase_timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"plain DDP did not finish within {args.phase_timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    wall = time.time() - t0
    ranks = [_read_json(out / f"steps_r{r}.json") for r in range(args.workers)]
    startup = {
        key: max(r["startup"][key] for r in ranks) - t0
        for key in (
            "process_started",
            "torch_imported",
            "group_ready",
            "model_ready",
            "first_step_done",
        )
        if all(r["startup"].get(key) for r in ranks)
    }
    return {
        "status": "succeeded",
        "final_loss": ranks[0]["final_loss"],
        "wall_incl_process_start_s": wall,
        "gloo_socket_ifname": ranks[0]["gloo_socket_ifname"],
        # From the spawn call to the last rank reaching each point: what any restart of a
        # whole DDP job pays at least, before it reads a checkpoint.
        "startup_after_spawn_s": startup,
        "step_time": _step_stats(ranks[0]["starts"], args.warmup),
        "cpu": _cpu_stats(ranks, args.warmup),
    }


# --- the parent: run every phase in a child process, report ------------------------------------


def _child_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never attach to someone else's cluster
    env["RAY_TMPDIR"] = str(work)  # ...nor find one through /tmp/ray/ray_current_cluster
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _common_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--kill-step={args.kill_step}",
        f"--kill-rank={args.kill_rank}",
        f"--workers={args.workers}",
        f"--warmup={args.warmup}",
        f"--ckpt-every={args.ckpt_every}",
        f"--phase-timeout={args.phase_timeout}",
        *(f"--set={kv}" for kv in args.set),
    ]


def _run_phase(name: str, args: argparse.Namespace, root: Path, index: int) -> dict[str, Any]:
    work = root / f"p{index}"
    work.mkdir()
    out = work / "phase.json"
    log_path = work / "log.txt"
    cmd = [sys.executable, str(THIS), f"--phase={name}", f"--phase-out={out}", f"--work={work}"]
    t0 = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd + _common_args(args),
            cwd=REPO,
            env=_child_env(work),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=args.phase_timeout + 30)
        except subprocess.TimeoutExpired:
            # Our own child's process group only (it started its own Ray underneath).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    elapsed = time.time() - t0
    if out.exists():
        rec = _read_json(out)
    else:
        tail = log_path.read_text(errors="replace")[-3000:]
        rec = {"status": "failed", "error": f"phase exited with {rc}; log tail:\n{tail}"}
    rec["phase_seconds"] = elapsed
    rec["log"] = str(log_path)
    return rec


def _best(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the lowest median s/step (the only one when not repeated)."""
    ok = [r for r in recs if _get(r, "step_time", "median_s") is not None]
    best = dict(min(ok, key=lambda r: r["step_time"]["median_s"]) if ok else recs[-1])
    if len(recs) > 1:
        best["repeats"] = [
            {k: _get(r, "step_time", k) for k in ("median_s", "mean_s")} for r in recs
        ]
    return best


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _get(rec: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(rec, dict):
            return None
        rec = rec.get(key)
    return rec


def summarize(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    sk, rk = res.get("stalwart-kill"), res.get("raytrain-kill")
    cold = res.get("stalwart-kill-cold")
    out = {
        "raytrain_over_stalwart_recovery": _ratio(_get(rk, "recovery_s"), _get(sk, "recovery_s")),
        "raytrain_over_stalwart_cold_recovery": _ratio(
            _get(rk, "recovery_s"), _get(cold, "recovery_s")
        ),
        "stalwart_cold_over_spare_recovery": _ratio(
            _get(cold, "recovery_s"), _get(sk, "recovery_s")
        ),
        "stalwart_cold_over_standby_recovery": _ratio(
            _get(cold, "recovery_s"), _get(res.get("stalwart-kill-standby"), "recovery_s")
        ),
    }
    # Time to the first step: the kill runs' (their start is the same as a steady run's).
    for key in ("time_to_first_step_s", "time_to_first_step_incl_ray_s"):
        out[f"raytrain_over_stalwart_{key.removesuffix('_s')}"] = _ratio(
            _get(rk, key) or _get(res.get("raytrain-steady"), key),
            _get(sk, key) or _get(res.get("stalwart-steady"), key),
        )
    plain = res.get("plain-ddp")
    for key, name in (
        ("stalwart", "stalwart-steady"),
        ("stalwart_sparse_ckpt", "stalwart-sparse-ckpt"),
        ("raytrain", "raytrain-steady"),
    ):
        if name not in res:
            continue
        for stat in ("median", "mean", "best_window_mean"):
            out[f"{key}_over_plain_step_{stat}"] = _ratio(
                _get(res[name], "step_time", f"{stat}_s"), _get(plain, "step_time", f"{stat}_s")
            )
        out[f"{key}_over_plain_cpu_per_step"] = _ratio(
            _get(res[name], "cpu", "cpu_s_per_step_all_ranks"),
            _get(plain, "cpu", "cpu_s_per_step_all_ranks"),
        )
    return out


def render(res: dict[str, dict[str, Any]], ratios: dict[str, Any], args: argparse.Namespace) -> str:
    sk, rk = res.get("stalwart-kill", {}), res.get("raytrain-kill", {})
    w = 22
    lines = [
        f"Recovery: rank {args.kill_rank} killed at step {args.kill_step} of {args.steps}, "
        f"{args.workers} workers",
        f"{'':44}{'stalwart':>{w}}{'Ray Train v2':>{w}}",
        f"{'kill -> first step done after restore (s)':44}"
        f"{_fmt(sk.get('recovery_s')):>{w}}{_fmt(rk.get('recovery_s')):>{w}}",
        f"{'resumed from step':44}"
        f"{_fmt(sk.get('resumed_from_step')):>{w}}{_fmt(rk.get('resumed_from_step')):>{w}}",
        f"{'steps redone':44}"
        f"{_fmt(sk.get('steps_redone')):>{w}}{_fmt(rk.get('steps_redone')):>{w}}",
        f"{'job wall time (s)':44}"
        f"{_fmt(sk.get('job_wall_s'), '.1f'):>{w}}{_fmt(rk.get('fit_wall_s'), '.1f'):>{w}}",
        f"{'wall time incl. starting Ray (s)':44}"
        f"{_fmt(sk.get('wall_incl_ray_start_s'), '.1f'):>{w}}"
        f"{_fmt(rk.get('wall_incl_ray_start_s'), '.1f'):>{w}}",
        f"{'time to first step once Ray is up (s)':44}"
        f"{_fmt(_first(res, 'stalwart', 'time_to_first_step_s'), '.1f'):>{w}}"
        f"{_fmt(_first(res, 'raytrain', 'time_to_first_step_s'), '.1f'):>{w}}",
        f"{'time to first step incl. starting Ray (s)':44}"
        f"{_fmt(_first(res, 'stalwart', 'time_to_first_step_incl_ray_s'), '.1f'):>{w}}"
        f"{_fmt(_first(res, 'raytrain', 'time_to_first_step_incl_ray_s'), '.1f'):>{w}}",
        f"{'status':44}{_fmt(sk.get('status')):>{w}}{_fmt(rk.get('status')):>{w}}",
        f"stalwart without a warm spare (cold replacement): recovery "
        f"{_fmt(res.get('stalwart-kill-cold', {}).get('recovery_s'))} s, phases "
        f"{res.get('stalwart-kill-cold', {}).get('phases_s')}",
        f"stalwart without a spare, with a standby (failure.standby): recovery "
        f"{_fmt(res.get('stalwart-kill-standby', {}).get('recovery_s'))} s, phases "
        f"{res.get('stalwart-kill-standby', {}).get('phases_s')}",
        "",
        f"Steady state, no failure: s/step on rank 0, first {args.warmup} steps skipped",
    ]
    n = args.ckpt_every
    cols = [
        ("stalwart", "stalwart-steady", "every step (memory)", "job_wall_s"),
        (f"stalwart ckpt/{n}", "stalwart-sparse-ckpt", f"every {n} (memory)", "job_wall_s"),
        ("Ray Train v2", "raytrain-steady", f"every {n} (disk)", "fit_wall_s"),
        ("plain DDP", "plain-ddp", "none", "wall_incl_process_start_s"),
    ]
    cols = [c for c in cols if c[1] in res or c[1] != "stalwart-sparse-ckpt"]
    recs = [res.get(c[1], {}) for c in cols]
    lines.append(f"{'':34}" + "".join(f"{c[0]:>{w}}" for c in cols))
    lines.append(f"{'checkpoint':34}" + "".join(f"{c[2]:>{w}}" for c in cols))
    for label, key in (
        ("median s/step", "median_s"),
        ("mean s/step", "mean_s"),
        ("p90 s/step", "p90_s"),
        (f"best {WINDOW_STEPS}-step mean s/step", "best_window_mean_s"),
    ):
        vals = [_get(r, "step_time", key) for r in recs]
        lines.append(f"{label:34}" + "".join(f"{_fmt(v, '.4f'):>{w}}" for v in vals))
    vals = [_get(r, "cpu", "cpu_s_per_step_all_ranks") for r in recs]
    lines.append(
        f"{'CPU s/step (sum of rank processes)':34}"
        + "".join(f"{_fmt(v, '.4f'):>{w}}" for v in vals)
    )
    lines.append(
        f"{'wall time (s)':34}"
        + "".join(f"{_fmt(r.get(c[3]), '.1f'):>{w}}" for c, r in zip(cols, recs, strict=True))
    )
    lines.append(
        f"{'final loss (mean of ranks)':34}"
        + "".join(f"{_fmt(r.get('final_loss'), '.4f'):>{w}}" for r in recs)
    )
    lines += [
        "",
        "Ratios",
        f"  Ray Train recovery / stalwart recovery    "
        f"{_fmt(ratios['raytrain_over_stalwart_recovery'], '.1f')}x   (goal >= 10x)",
        f"  Ray Train recovery / stalwart cold replacement (no spare)   "
        f"{_fmt(ratios['raytrain_over_stalwart_cold_recovery'], '.1f')}x",
        f"  stalwart cold replacement / warm spare    "
        f"{_fmt(ratios['stalwart_cold_over_spare_recovery'], '.1f')}x",
        f"  Ray Train time to first step / stalwart's  "
        f"{_fmt(ratios['raytrain_over_stalwart_time_to_first_step'], '.2f')}x once Ray is up, "
        f"{_fmt(ratios['raytrain_over_stalwart_time_to_first_step_incl_ray'], '.2f')}x "
        "with Ray's start",
    ]
    for key, label, goal in (
        ("stalwart", "stalwart s/step / plain DDP s/step", "   (goal <= 1.05)"),
        ("stalwart_sparse_ckpt", f"stalwart ckpt/{n} s/step / plain DDP", ""),
        ("raytrain", "Ray Train s/step / plain DDP s/step", ""),
    ):
        if f"{key}_over_plain_step_median" in ratios:
            lines.append(
                f"  {label:40}"
                f"median {_fmt(ratios[f'{key}_over_plain_step_median'])}  "
                f"mean {_fmt(ratios[f'{key}_over_plain_step_mean'])}  "
                f"best-{WINDOW_STEPS} {_fmt(ratios[f'{key}_over_plain_step_best_window_mean'])}  "
                f"CPU {_fmt(ratios[f'{key}_over_plain_cpu_per_step'])}{goal}"
            )
    startup = sk.get("startup") or res.get("stalwart-steady", {}).get("startup")
    if startup and startup.get("phases_s"):
        lines.append("")
        lines.append(
            "stalwart start-up phases (s): "
            + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in startup["phases_s"].items())
        )
    if sk.get("phases_s"):
        lines.append("")
        lines.append(
            "stalwart recovery phases (s): "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in sk["phases_s"].items())
        )
    if rk.get("timeline_after_kill_s"):
        timeline = sorted(
            ((k, v) for k, v in rk["timeline_after_kill_s"].items() if v is not None),
            key=lambda kv: kv[1],
        )
        lines.append(
            "Ray Train timeline after the kill (s): "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in timeline)
        )
    for name, rec in res.items():
        if rec.get("status") != "succeeded" or rec.get("error"):
            lines.append(f"!! {name}: status {rec.get('status')}, error: {rec.get('error')}")
    return "\n".join(lines)


def _first(res: dict[str, dict[str, Any]], system: str, key: str) -> float | None:
    """`system`'s time to its first step: from its kill run, else its steady run."""
    return _get(res.get(f"{system}-kill"), key) or _get(res.get(f"{system}-steady"), key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--kill-step", type=int, default=60, help="step at which the rank is killed")
    p.add_argument("--kill-rank", type=int, default=1, help="rank that is killed")
    p.add_argument("--workers", type=int, default=4, help="data-parallel workers")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of s/step")
    p.add_argument(
        "--ckpt-every", type=int, default=10, help="Ray Train: report a checkpoint every N steps"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file for the raw figures")
    p.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (default: all but the last)",
    )
    p.add_argument(
        "--phase-timeout",
        type=float,
        default=300.0,
        help="seconds one measurement may take before it is stopped",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="steady-state runs per system, interleaved; the lowest median counts",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job spec override for stalwart's runs (repeatable), e.g. failure.standby=false",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch directory and logs")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.kill_rank < args.workers:
        p.error(f"--kill-rank must be in [0, {args.workers})")
    if not 0 < args.kill_step < args.steps:
        p.error(f"--kill-step must be in (0, {args.steps})")
    if not 0 <= args.warmup < args.steps - 1:
        p.error("--warmup must leave at least two steps to measure")
    if args.ckpt_every < 1:
        p.error("--ckpt-every must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {sorted(unknown)}")
    return args


def run_phase_here(args: argparse.Namespace) -> int:
    """Child process: run one measurement, write its record to --phase-out."""
    runners = {
        "plain-ddp": lambda: phase_ddp(args, args.work),
        "stalwart-steady": lambda: phase_stalwart(args, args.work, kill=False),
        "stalwart-sparse-ckpt": lambda: phase_stalwart(
            args, args.work, kill=False, every=args.ckpt_every
        ),
        "stalwart-kill": lambda: phase_stalwart(args, args.work, kill=True),
        # The same kill with no warm spare: the replacement is a new process (cold start).
        "stalwart-kill-cold": lambda: phase_stalwart(
            args, args.work, kill=True, spares=0, standby=False
        ),
        # No spare, but a standby (failure.standby): a pre-started process takes the rank.
        "stalwart-kill-standby": lambda: phase_stalwart(
            args, args.work, kill=True, spares=0, standby=True
        ),
        "raytrain-steady": lambda: phase_raytrain(args, args.work, kill=False),
        "raytrain-kill": lambda: phase_raytrain(args, args.work, kill=True),
        "raytrain-kill-node": lambda: phase_raytrain(args, args.work, kill=True, node=True),
    }
    try:
        rec = runners[args.phase]()
    except Exception as e:
        traceback.print_exc()
        rec = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
    _write_json(args.phase_out, rec)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        return run_phase_here(args)

    wanted = [p for p in PHASES if p in args.phases.split(",")]
    steady = [p for p in wanted if p in STEADY_PHASES]
    # Steady-state runs are interleaved when repeated, so slow spells of other load on the
    # machine hit all three alike; the repeat with the lowest median counts.
    schedule = [(p, r) for r in range(args.repeats) for p in steady]
    schedule += [(p, 0) for p in wanted if p not in STEADY_PHASES]
    root = Path(tempfile.mkdtemp(prefix="srb-", dir="/tmp"))  # short: Ray's socket paths
    started = time.time()
    load_before = os.getloadavg()
    print(f"scratch: {root}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, (name, r) in enumerate(schedule):
        label = name if args.repeats == 1 or name not in STEADY_PHASES else f"{name} #{r + 1}"
        print(f"[{time.time() - started:6.1f}s] {label} ...", flush=True)
        rec = _run_phase(name, args, root, i)
        runs.setdefault(name, []).append(rec)
        extra = ""
        if rec.get("recovery_s") is not None:
            extra = f", recovery {rec['recovery_s']:.2f}s"
        elif _get(rec, "step_time", "median_s") is not None:
            extra = f", median {rec['step_time']['median_s']:.4f} s/step"
        print(
            f"[{time.time() - started:6.1f}s] {label}: {rec.get('status')} "
            f"({rec['phase_seconds']:.1f}s{extra})",
            flush=True,
        )
    res = {name: _best(recs) for name, recs in runs.items()}
    ratios = summarize(res)
    report = {
        "benchmark": "recovery_vs_raytrain",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("phase", "phase_out", "work")
        },
        "workload": _workload(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "started_at": started,
        "total_seconds": time.time() - started,
        "results": res,
        "ratios": ratios,
    }
    print()
    print(render(res, ratios, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(args.out, report)
    print(f"\nraw figures: {args.out}")
    failed = [n for n, r in res.items() if r.get("status") != "succeeded" or r.get("error")]
    if args.keep or failed:
        print(f"scratch kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

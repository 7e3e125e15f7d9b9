#!/usr/bin/env python
"""What checkpointing costs a training step, and what a restore costs, per tier.

    python bench/ckpt_overhead.py [--sizes 25,250,1000] [--steps 14] [--workers 3]
        [--out bench/results/ckpt_overhead.json]

One multi-node Ray on this machine (ray.cluster_utils: a CPU-less head, one 1-CPU node per
rank), one data-parallel job per measurement, all with the same model: an MLP whose
parameters plus AdamW's two moments make about SIZE MB of state per rank, a batch sized so a
step computes for about a second, one torch thread per rank.

Step time (median of rank 0's step cycles, loop body start to the next one's, after the
first three) for:
  none        no checkpoint after the start (checkpoint.every_steps > steps)
  every=10    stalwart's in-memory snapshot every 10 steps, own node only
  replicas=1  stalwart's in-memory snapshot every step, own node only
  replicas=2  ... and a copy on a peer node        (the goal: <= 5 % over none at 250 MB)
  replicas=3  ... and copies on two peers (needs 3 nodes: --workers 3)
  lean        replicas=2 within checkpoint.memory_budget 4 (2 versions of each, every step
              copied before the next)
  torch.save  every rank torch.save()s model + optimizer to local disk every step
Restore time (the `restore` phase of the recovery, from the job's event log):
  memory      kill_worker: the replacement on the same node reads its own node's memory
  peer        kill_node: the replacement reads a peer's copy (replicas=2)
  durable     kill_node + drop_replicas of every peer: the shards come from
              checkpoint.persist.uri (a local directory; the page cache is dropped first
              when this process may, and the result says whether it could)
Each step-time run also gives its node agents' CPU (the ray::NodeAgent processes' user +
system time over the run, in cores: what checkpointing takes from the machine besides the
training threads). --modes and --restores pick a subset. Ratios are of figures measured in
the same run. Sizes whose state would not fit this
machine's memory with the replicas asked for are skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "ckpt_overhead.json"
TARGET_STEP_S = 1.0
WARMUP = 3


# --- the workload (runs in the workers) -------------------------------------------------------


def _mlp(state_mb: float, width: int):
    import torch

    # params + 2 Adam moments, float32: 12 bytes per parameter.
    params = state_mb * 1e6 / 12
    layers = max(1, round(params / (width * width)))
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def train_loop(ctx: Any) -> None:
    import torch

    cfg = ctx.config
    width, batch = int(cfg["width"]), int(cfg["batch"])
    model = ctx.prepare_model(_mlp(float(cfg["state_mb"]), width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.register(model=model, optimizer=optimizer)
    save_dir = cfg.get("torch_save_dir")
    # A step's time is from one loop body's start to the next one's: it includes what
    # ctx.steps() does between them (capturing the snapshot), not only the body.
    starts: list[float] = []
    for step in ctx.steps():
        starts.append(time.perf_counter())
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randn(batch, width, generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        if save_dir:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                os.path.join(save_dir, f"rank{ctx.rank}.pt"),
            )
        ctx.report(loss=loss.item())
    times = [b - a for a, b in itertools.pairwise(starts)]
    if ctx.rank == 0 and cfg.get("times_file"):
        Path(cfg["times_file"]).write_text(json.dumps(times))


# --- measurements ----------------------------------------------------------------------------


def _spec(name: str, size: float, width: int, batch: int, steps: int, workers: int, **kw) -> dict:
    spec = {
        "name": name,
        "entrypoint": "bench.ckpt_overhead:train_loop",
        "workers": workers,
        "resources": {"cpu": 1},
        "placement": "SPREAD",
        "steps": steps,
        "seed": 1,
        "checkpoint": {"every_steps": 1, "replicas": 1},
        "failure": {"max_restarts": 3, "replacement_timeout_s": 120},
        "health": {"hang_timeout_s": 600, "straggler": {"policy": "none"}},
        "config": {"state_mb": size, "width": width, "batch": batch},
        "chaos": {"faults": []},
    }
    from stalwart.orchestrator.spec import set_path

    for key, value in kw.items():
        set_path(spec, key.split("__"), value)
    return spec


class _MemoryPeak:
    """The machine's peak memory in use (MemTotal - MemAvailable) while a run lasts."""

    def __init__(self) -> None:
        self.peak_gb = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            info = _meminfo()
            used = (info["MemTotal"] - info["MemAvailable"]) / 1e6
            self.peak_gb = max(self.peak_gb, used)
            if self._done.wait(0.25):
                return

    def __enter__(self) -> _MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class _AgentCpu:
    """The CPU the job's node agents use while a run lasts: each ray::NodeAgent process's
    utime + stime, from its first sample to its last (they exit with the job)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.started = time.monotonic()
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while True:
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    if not (proc / "cmdline").read_bytes().startswith(b"ray::NodeAgent"):
                        continue
                    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                self.first.setdefault(int(proc.name), cpu)
                self.last[int(proc.name)] = cpu
            if self._done.wait(0.5):
                return

    def __enter__(self) -> _AgentCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.seconds = time.monotonic() - self.started

    def cores(self) -> float:
        """The agents' CPU seconds per second of the run (all agents together)."""
        used = sum(self.last[p] - self.first[p] for p in self.last)
        return used / self.seconds if self.seconds else 0.0


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in kB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    return out


def _run(address: str, spec: dict, out: Path) -> dict:
    from stalwart.orchestrator.driver import RunOptions, run_job
    from stalwart.orchestrator.spec import validate

    with _MemoryPeak() as mem, _AgentCpu() as agents:
        result = run_job(
            validate(spec),
            RunOptions(address=address, output=out, base_dir=str(REPO), owns_cluster=True),
        )
    result["peak_mem_gb"] = round(mem.peak_gb, 2)
    result["agent_cores"] = round(agents.cores(), 3)
    result["events"] = [
        json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()
    ]
    if result["status"] != "succeeded":
        raise RuntimeError(f"{spec['name']}: {result['status']}: {result.get('error')}")
    return result


def _median_step(times_file: Path) -> float:
    times = json.loads(times_file.read_text())
    return statistics.median(times[WARMUP:] if len(times) > WARMUP + 2 else times)


def _calibrate(width: int, size: float) -> int:
    """A batch for which one step computes for about TARGET_STEP_S on one thread here."""
    import torch

    torch.set_num_threads(1)
    model = _mlp(size, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = 8
    while True:
        x = torch.randn(batch, width)
        t0 = time.perf_counter()
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        took = (time.perf_counter() - t0) / 2
        if took >= TARGET_STEP_S / 3 or batch >= 8192:
            return max(1, int(batch * TARGET_STEP_S / took))
        batch *= 2


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _restore_s(result: dict) -> dict:
    [rec] = [e for e in result["events"] if e["type"] == "recovered"]
    return {
        "restore_s": rec["phases_s"].get("restore"),
        "tiers": rec.get("restore_tiers"),
        "recovered_after_s": rec["recovered_after_s"],
    }


def measure_size(address: str, cluster: Any, size: float, args: argparse.Namespace, work: Path):
    width = 1024
    batch = _calibrate(width, size)
    steps, workers = args.steps, args.workers
    out: dict[str, Any] = {
        "state_mb": size,
        "batch": batch,
        "width": width,
        "step_s": {},
        "peak_mem_gb": {},
        "agent_cores": {},
    }
    mem_gb = _available_gb()
    replicas = [r for r in (1, 2, 3) if r <= workers]
    fits = {r: _need_gb(size, workers, r) < 0.75 * mem_gb for r in replicas}
    for label, kw in [
        ("none", {"checkpoint__every_steps": steps + 100}),
        ("every=10", {"checkpoint__every_steps": 10}),
        *[(f"replicas={r}", {"checkpoint__replicas": r}) for r in replicas if fits[r]],
        # replicas=2 within a budget of 4 versions (the lean rule, ckpt/footprint.py).
        *[("lean", {"checkpoint__replicas": 2, "checkpoint__memory_budget": 4})] * fits.get(2, 0),
        ("torch.save", {"checkpoint__every_steps": steps + 100}),
    ]:
        if label not in args.modes:
            continue
        times = work / f"{size}-{label}.json"
        cfg = {"state_mb": size, "width": width, "batch": batch, "times_file": str(times)}
        if label == "torch.save":
            save_dir = work / f"save-{size}"
            save_dir.mkdir(exist_ok=True)
            cfg["torch_save_dir"] = str(save_dir)
        spec = _spec(
            f"ck-{label.replace('=', '').replace('.', '')}",
            size,
            width,
            batch,
            steps,
            workers,
            config=cfg,
            **kw,
        )
        _ensure_nodes(cluster, workers + 1, args.object_store_gb)
        res = _run(address, spec, work / f"run-{size}-{label}")
        out["step_s"][label] = _median_step(times)
        out["peak_mem_gb"][label] = res["peak_mem_gb"]
        out["agent_cores"][label] = res["agent_cores"]
        print(
            f"  {size:g} MB {label:12s} {out['step_s'][label]:.3f} s/step, "
            f"peak memory in use {res['peak_mem_gb']:.1f} GB, "
            f"node agents {res['agent_cores']:.3f} cores",
            flush=True,
        )
    skipped = [f"replicas={r}" for r in replicas if not fits[r]]
    if skipped:
        out["skipped"] = f"{', '.join(skipped)}: would not fit {mem_gb:.0f} GB of memory"
    if not fits.get(1):
        out["restore"] = {}
        out["skipped"] = (
            f"{out.get('skipped', '')}; restores: {size:g} MB x {workers} ranks held in "
            f"memory would not fit {mem_gb:.0f} GB"
        ).lstrip("; ")
        return out
    # Restores.
    base = {
        "checkpoint__every_steps": 1,
        "config": {"state_mb": size, "width": width, "batch": batch},
    }
    out["restore"] = {}
    kill = 6
    if "memory" in args.restores:
        _restore_memory(address, cluster, size, args, work, out, base, width, batch, kill)
    if fits.get(2) and "peer" in args.restores:
        _ensure_nodes(cluster, workers + 1, args.object_store_gb)
        res = _run(
            address,
            _spec(
                "ck-rpeer",
                size,
                width,
                batch,
                kill + 3,
                workers,
                **base,
                checkpoint__replicas=2,
                chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": kill}],
            ),
            work / f"restore-{size}-peer",
        )
        out["restore"]["peer"] = _restore_s(res)
    if "durable" in args.restores:
        _restore_durable(address, cluster, size, args, work, out, base, width, batch, kill)
    for tier, r in out["restore"].items():
        print(f"  {size:g} MB restore from {tier:8s} {r['restore_s']}", flush=True)
    return out


def _restore_memory(address, cluster, size, args, work, out, base, width, batch, kill) -> None:
    workers = args.workers
    _ensure_nodes(cluster, workers + 1, args.object_store_gb)
    res = _run(
        address,
        _spec(
            "ck-rmem",
            size,
            width,
            batch,
            kill + 3,
            workers,
            **base,
            chaos__faults=[{"kind": "kill_worker", "rank": 1, "at_step": kill}],
        ),
        work / f"restore-{size}-memory",
    )
    out["restore"]["memory"] = _restore_s(res)


def _restore_durable(address, cluster, size, args, work, out, base, width, batch, kill) -> None:
    workers = args.workers
    uri = work / f"durable-{size}"
    faults = [{"kind": "kill_node", "rank": 1, "at_step": kill}]
    faults += [
        {"kind": "drop_replicas", "rank": r, "at_step": kill} for r in range(workers) if r != 1
    ]
    _ensure_nodes(cluster, workers + 1, args.object_store_gb)
    dropped = _drop_page_cache()
    res = _run(
        address,
        _spec(
            "ck-rdur",
            size,
            width,
            batch,
            kill + 3,
            workers,
            **base,
            checkpoint__replicas=min(2, workers),
            checkpoint__persist={"uri": str(uri), "every_steps": 2, "keep_last": 2},
            chaos__faults=faults,
        ),
        work / f"restore-{size}-durable",
    )
    out["restore"]["durable"] = _restore_s(res) | {"page_cache_dropped": dropped}


def _need_gb(size_mb: float, workers: int, replicas: int) -> float:
    """Memory a run takes: per rank the model, gradients and optimizer (~1.5x the state)
    and its snapshot ring (6 slots), and ~3 steps of every copy its node keeps (one per
    peer of its replica group: `replicas - 1`, or every other node's when the nodes are
    fewer than 2 x replicas and form one group); then 1.1x for what is in flight."""
    if replicas <= 1:
        copies_per_node = 0
    else:
        copies_per_node = replicas - 1 if workers >= 2 * replicas else workers - 1
    per_rank = size_mb / 1000 * (1.5 + 6 + 3 * copies_per_node)
    return 1.1 * workers * per_rank


def _available_gb() -> float:
    return _meminfo()["MemAvailable"] / 1e6


def _ensure_nodes(cluster: Any, n: int, object_store_gb: float) -> None:
    for node in list(cluster.worker_nodes):
        if not all(p.process.poll() is None for p in node.all_processes["raylet"]):
            cluster.remove_node(node, allow_graceful=False)
    while len(cluster.worker_nodes) < n:
        # Every simulated node would size its object store from the whole machine's memory
        # (30 %); they share one machine, so each gets a fixed share.
        cluster.add_node(num_cpus=1, object_store_memory=int(object_store_gb * 1e9))
    cluster.wait_for_nodes()


def ratios(sizes: list[dict]) -> list[dict]:
    rows = []
    for s in sizes:
        base = s["step_s"].get("none")
        row: dict[str, Any] = {"state_mb": s["state_mb"]}
        for label, t in s["step_s"].items():
            if label != "none" and base:
                row[f"{label} overhead"] = round(t / base - 1, 4)
        peer = (s["restore"].get("peer") or {}).get("restore_s")
        dur = (s["restore"].get("durable") or {}).get("restore_s")
        if peer and dur:
            row["durable/peer restore"] = round(dur / peer, 2)
        rows.append(row)
    return rows


def _cell(value: float | None) -> str:
    return f"{value:7.3f}" if value is not None else "      -"


def render(res: dict) -> str:
    head = "state MB   step s: none  every10   repl=1   repl=2   repl=3  torch.save"
    lines = ["", head + "   restore s: memory    peer  durable"]
    labels = ["none", "every=10", "replicas=1", "replicas=2", "replicas=3", "torch.save"]
    for s in res["sizes"]:
        steps = " ".join(_cell(s["step_s"].get(k)) for k in labels)
        restores = " ".join(
            _cell((s["restore"].get(t) or {}).get("restore_s"))
            for t in ("memory", "peer", "durable")
        )
        lines.append(f"{s['state_mb']:>8g}  {steps}             {restores}")
    lines.append("")
    for row in res["ratios"]:
        parts = [
            f"{k} {v:+.1%}" if "overhead" in k else f"{k} {v:.1f}x"
            for k, v in row.items()
            if k != "state_mb"
        ]
        lines.append(f"{row['state_mb']:g} MB: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="25,250,1000", help="state per rank, MB")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument(
        "--modes",
        default="none,every=10,replicas=1,replicas=2,replicas=3,torch.save",
        help="step-time runs (comma-separated)",
    )
    ap.add_argument(
        "--restores", default="memory,peer,durable", help="restore tiers (comma-separated)"
    )
    ap.add_argument(
        "--object-store-gb", type=float, default=2.0, help="each simulated node's object store"
    )
    args = ap.parse_args(argv)
    args.modes = set(args.modes.split(","))
    args.restores = set(filter(None, args.restores.split(",")))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    res: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
        "sizes": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
            for size in [float(x) for x in args.sizes.split(",")]:
                print(f"state {size:g} MB per rank", flush=True)
                try:
                    res["sizes"].append(
                        measure_size(cluster.address, cluster, size, args, Path(tmp))
                    )
                except (RuntimeError, MemoryError) as e:
                    res["sizes"].append(
                        {"state_mb": size, "error": str(e)[:500], "step_s": {}, "restore": {}}
                    )
                    print(f"  {size:g} MB failed: {e}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
    res["ratios"] = ratios([s for s in res["sizes"] if "error" not in s])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

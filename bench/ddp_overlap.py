#!/usr/bin/env python
"""Step time of a DDP on stalwart's group against torch's own DDP: overlap and comm hooks.

    python bench/ddp_overlap.py [--ranks 4] [--layers 16] [--width 512] [--batch 64]
        [--bucket-cap-mb 4] [--steps 10] [--repeats 5] [--variants plain,stalwart,flat,...]
        [--out bench/results/ddp_overlap.json]

RANKS processes (torch.multiprocessing, gloo on loopback, no Ray), one torch thread each,
every variant built in every process on the same model (LAYERS Linear(WIDTH, WIDTH) layers
with tanh: WIDTH^2 * LAYERS * 4 bytes of fp32 gradients, spread over the layers so that the
backward of the early ones can overlap the reduction of the late ones), SGD, a fixed batch:

  plain        torch's DDP on a plain gloo group (what init_process_group makes under
               torchrun), its own buckets, overlapped
  stalwart     ctx.prepare_model's DDP: stalwart's abortable group, stalwart's fixed buckets
               (orchestrator/worker/buckets.py), overlapped
  flat         the reducer before issue 22: every bucket waited for, one flat all-reduce
               after the backward (kept here, for this comparison only)
  plain-bf16, stalwart-bf16
               the same two with torch's bf16 compression hook (torch's DDP refuses
               bf16_compress_hook by name without NCCL: plain-bf16 runs its body under
               another name)
  stalwart-powersgd
               stalwart's with PowerSGD (rank 4, compressing from the second step). torch's
               own DDP with PowerSGD does not run on gloo with several buckets (torch 2.13):
               the hook issues all-reduces from gloo's completion threads, in an order that
               differs between ranks, and the job stops with gloo's "Received data size
               doesn't match expected size" or hangs (`--variants plain-powersgd` shows it)

Every variant uses the same --bucket-cap-mb. Repeats are interleaved (the variants' order
rotates each repeat), each timing STEPS steps after a barrier; the figure per variant is the
median over repeats of rank 0's mean step (wall clock), and of its process CPU time per
step (every thread: compute and gloo's), and the best repeat's wall time (the one least
disturbed by anything else on the machine). Ratios are of figures measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "ddp_overlap.json"
VARIANTS = ("plain", "stalwart", "flat")
HOOKED = ("plain-bf16", "stalwart-bf16", "stalwart-powersgd")
WARMUP = 3  # steps before timing: DDP's bucket rebuild after its first, PowerSGD's start


class FlatGradReducer:
    """The comm hook stalwart used before issue 22 (orchestrator/worker/collective.py at
    ee38137): collect all of DDP's buckets, one all-reduce of every gradient in parameter
    order after the backward, average, copy back."""

    def __init__(self, group: Any, module: Any):
        import torch

        self.group = group
        params = [p for p in module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._offsets = [0]
        for p in params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._flat = torch.zeros(self._offsets[-1], dtype=params[0].dtype)
        self._buckets: list = []

    def __call__(self, bucket: Any) -> Any:
        fut = self.group.new_future()
        self._buckets.append((bucket, fut))
        if bucket.is_last():
            self._flush()
        return fut

    def _span(self, p: Any) -> slice:
        i = self._index[id(p)]
        return slice(self._offsets[i], self._offsets[i + 1])

    def _flush(self) -> None:
        buckets, self._buckets = self._buckets, []
        for bucket, _ in buckets:
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                self._flat[self._span(p)].copy_(g.reshape(-1))
        world = self.group.world_size

        def scatter(f: Any) -> None:
            f.value()
            self._flat.div_(world)
            for bucket, fut in buckets:
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                    g.copy_(self._flat[self._span(p)].view_as(g))
                fut.set_result(bucket.buffer())

        self.group.all_reduce_async(self._flat).add_done_callback(scatter)


def _flat_hook(state, bucket):
    return state(bucket)


def _bf16_hook(state, bucket):
    # torch's bf16_compress_hook by another name: DDP refuses that name without NCCL.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, cfg: dict, out: Any) -> None:
    try:
        out.put((rank, "ok", _measure(rank, port, cfg)))
    except Exception:
        out.put((rank, "error", traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)  # no teardown of the groups: nothing is pending, nothing to wait for


def _measure(rank: int, port: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState,
        powerSGD_hook,
    )

    from stalwart.orchestrator.worker.collective import ElasticGroup, _wrap_backend, make_ddp

    torch.set_num_threads(1)
    world, cpu = cfg["ranks"], torch.device("cpu")
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    group = ElasticGroup()
    group.configure(
        dist.PrefixStore("stalwart", store), rank, world, 1, "gloo", cpu, "127.0.0.1", timeout
    )
    plain = _wrap_backend(
        dist.PrefixStore("plain", store), rank, world, "gloo", timeout, cpu, "127.0.0.1"
    )[0]
    cap = cfg["bucket_cap_mb"]

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = []
        for _ in range(cfg["layers"]):
            layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers)

    def powersgd(pg: Any) -> PowerSGDState:
        return PowerSGDState(process_group=pg, matrix_approximation_rank=4, start_powerSGD_iter=2)

    ddp_cls = torch.nn.parallel.DistributedDataParallel
    built: dict[str, Any] = {}
    for name in cfg["variants"]:
        if name.startswith("plain"):
            ddp = ddp_cls(model(), process_group=plain, bucket_cap_mb=cap)
        elif name == "flat":
            ddp = ddp_cls(model(), process_group=group.process_group, bucket_cap_mb=cap)
            ddp.register_comm_hook(FlatGradReducer(group, ddp.module), _flat_hook)
        else:
            ddp = make_ddp(model(), group, cpu, bucket_cap_mb=cap)
        # A hook's group: the plain one for torch's DDP, stalwart's default group (None).
        pg = plain if name.startswith("plain") else None
        if name.endswith("-bf16"):
            hook = (pg, _bf16_hook if pg is plain else default_hooks.bf16_compress_hook)
        elif name.endswith("-powersgd"):
            hook = (powersgd(pg), powerSGD_hook)
        else:
            hook = None
        if hook is not None and name.startswith("plain"):
            ddp.register_comm_hook(*hook)
        elif hook is not None:
            ddp._stalwart_reducer.use(*hook)  # what the patched register_comm_hook does
        built[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)

    def step(ddp: Any, opt: Any) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    for ddp, opt in built.values():
        for _ in range(WARMUP):
            step(ddp, opt)
    names = list(built)
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(cfg["repeats"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ddp, opt = built[name]
            plain.barrier().wait()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(cfg["steps"]):
                step(ddp, opt)
            n = cfg["steps"]
            runs[name].append(((time.perf_counter() - wall0) / n, (time.process_time() - cpu0) / n))
    return runs


def summarize(runs: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Per variant (seconds per step): the median and the best repeat's wall time, the
    median CPU time; and the ratios of the same run. The best repeat is the one least
    disturbed by whatever else ran on the machine."""
    step = {n: statistics.median(r[0] for r in v) for n, v in runs.items()}
    best = {n: min(r[0] for r in v) for n, v in runs.items()}
    cpu = {n: statistics.median(r[1] for r in v) for n, v in runs.items()}
    pairs = [
        ("stalwart/plain", "stalwart", "plain"),
        ("flat/plain", "flat", "plain"),
        ("stalwart/flat", "stalwart", "flat"),
        ("stalwart-bf16/plain-bf16", "stalwart-bf16", "plain-bf16"),
        ("stalwart-powersgd/stalwart", "stalwart-powersgd", "stalwart"),
        ("stalwart-powersgd/plain-powersgd", "stalwart-powersgd", "plain-powersgd"),
    ]
    pairs = [(k, a, b) for k, a, b in pairs if a in runs and b in runs]
    return {
        "step_s": step,
        "best_step_s": best,
        "cpu_s": cpu,
        "ratios": {k: step[a] / step[b] for k, a, b in pairs},
        "best_ratios": {k: best[a] / best[b] for k, a, b in pairs},
        "cpu_ratios": {k: cpu[a] / cpu[b] for k, a, b in pairs},
    }


def render(res: dict[str, Any]) -> str:
    lines = []
    for name, s in res["step_s"].items():
        spread = [round(r[0] * 1e3, 1) for r in res["runs"][name]]
        lines.append(
            f"{name:18s} median {s * 1e3:7.1f} ms/step, best {res['best_step_s'][name] * 1e3:7.1f},"
            f" CPU {res['cpu_s'][name] * 1e3:7.1f}  (repeats: {spread})"
        )
    for k, v in res["ratios"].items():
        lines.append(
            f"{k:34s} {v:.3f}x median, {res['best_ratios'][k]:.3f}x best, "
            f"{res['cpu_ratios'][k]:.3f}x CPU"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat and variant")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS + HOOKED))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    cfg = {**vars(args), "variants": args.variants.split(",")}
    del cfg["out"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, cfg, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=3600) for _ in procs), key=lambda g: g[0])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, status, detail in got:
        if status != "ok":
            print(f"rank {rank} failed:\n{detail}", file=sys.stderr)
            return 1
    runs = got[0][2]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    grads_mb = args.layers * (args.width**2 + args.width) * 4 / 2**20
    res = {
        "machine": f"{os.cpu_count()} cores",
        "commit": commit,
        "args": cfg,
        "gradients_mb": round(grads_mb, 1),
        "runs": runs,
        **summarize(runs),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"{args.ranks} ranks, {grads_mb:.1f} MB of gradients, {res['machine']}")
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

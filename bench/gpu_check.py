#!/usr/bin/env python
"""What a snapshot costs a GPU training step, synchronous against asynchronous.

    python bench/gpu_check.py [--state-gb 1] [--steps 20] [--every 2] [--out FILE]

For a machine with GPUs (exit code 2 and one line on stderr without CUDA or NCCL). One
process per GPU, two if there are two or more, else one; torch.distributed with the nccl
backend and DistributedDataParallel on an MLP whose parameters plus Adam's two moments make
about STATE_GB GB per rank. Step time (mean over --steps after a warm-up, each step timed
until its training stream is done) for:

  none   no snapshot
  sync   SnapshotBuffer(pin_memory=True).capture() every --every steps: the copy to the host
         and torch.cuda.synchronize() on the training thread (what ckpt/snapshot.py does)
  async  AsyncCapture (ckpt/device_copy.py) with the optimizer guarded; a consumer thread
         waits for each copy and copies it on into host memory (as to shared memory)

Then a race check: async captures, each followed by another training step before the copy
is waited for; each snapshot's digest must equal a synchronous capture of a device clone
of the state taken at capture time. NVML readings (health/gpu_probe.py) before and after.

Then FSDP2 on stalwart's own process group (issue 22): ElasticGroup on NCCL, a 2-D
init_device_mesh (replicate x shard: the subgroups are stalwart's, NCCL communicators of
their own), fully_shard per block; step time without and with an async snapshot of the
DTensors' local shards into pinned memory, the same race check, an abort of the subgroups,
and a second generation that restores the shards into the rebuilt model (bit-exact).
Prints a JSON summary (and writes it to --out); exit code 0 when every digest matched
and the FSDP part held, 1 when not (a failed FSDP part is in the summary as fsdp_error, the
DDP part's figures kept).

--device cpu runs the same code on CPU with gloo (2 ranks; AsyncCapture then copies
synchronously): a dry run of the script's logic on a machine without a GPU, its timings
meaningless (e.g. --device cpu --state-gb 0.002 --width 256 --batch 64 --steps 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _mlp(state_gb: float, width: int):
    import torch

    # float32 parameters + Adam's exp_avg and exp_avg_sq: 12 bytes per parameter.
    layers = max(1, round(state_gb * 1e9 / 12 / (width * width + width)))
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _nvml() -> dict[str, Any]:
    try:
        from stalwart.health.gpu_probe import NvmlGpuProbe

        probe = NvmlGpuProbe("local")
    except Exception as e:  # no pynvml, no driver
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        readings = [dataclasses.asdict(r) for r in probe.read()]
        return {"count": probe.count, "xid_watched": probe.xid_events, "readings": readings}
    finally:
        probe.close()


def _device(rank: int, cfg: dict[str, Any]):
    """This rank's device, its backend, and what waits for the device's queued work."""
    import torch

    if cfg["device"] == "cpu":
        return torch.device("cpu"), "gloo", lambda: None
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device, "nccl", torch.cuda.current_stream(device).synchronize


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any], tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.ckpt import dtensor
    from stalwart.ckpt.device_copy import AsyncCapture
    from stalwart.ckpt.snapshot import SnapshotBuffer, _join, _split

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device, backend, sync_stream = _device(rank, cfg)
    cuda = device.type == "cuda"
    dist.init_process_group(
        backend, rank=rank, world_size=world, device_id=device if cuda else None
    )
    torch.manual_seed(rank)
    model = _mlp(cfg["state_gb"], cfg["width"]).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(cfg["batch"], cfg["width"], device=device)
    y = torch.randn(cfg["batch"], cfg["width"], device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    step()  # Adam's state exists from here on: the layout is final
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state(), _split))
    sync_buf = SnapshotBuffer(pin_memory=cuda)
    cap = AsyncCapture()
    cap.guard(opt)
    handed = torch.empty(state_bytes + (1 << 20), dtype=torch.uint8)  # stands for /dev/shm
    work: queue.Queue = queue.Queue()
    consumer_s = [0.0]

    def consumer() -> None:
        while (pending := work.get()) is not None:
            t0 = time.perf_counter()
            with pending as snap:
                handed[: snap.nbytes].copy_(snap.payload)
            consumer_s[0] += time.perf_counter() - t0

    thread = threading.Thread(target=consumer, name="consumer", daemon=True)
    thread.start()
    every, warmup = cfg["every"], 2 * cfg["every"] + 2  # both pinned buffers made in warm-up
    out: dict[str, Any] = {"rank": rank, "state_bytes": state_bytes, "modes": {}}
    for mode in ("none", "sync", "async"):
        dist.barrier()
        times, calls = [], []
        for i in range(warmup + cfg["steps"]):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            if mode != "none" and i % every == 0:
                if mode == "sync":
                    sync_buf.capture(i, state())
                else:
                    work.put(cap.capture(i, state()))
                if i >= warmup:
                    calls.append(time.perf_counter() - t1)  # the training thread's share
            sync_stream()  # this step's work, not the side stream's copy
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out["modes"][mode] = {
            "step_s_mean": statistics.fmean(times),
            "step_s_median": statistics.median(times),
            "capture_call_s_mean": statistics.fmean(calls) if calls else 0.0,
        }
    work.put(None)
    thread.join()
    out["async_stats"] = dataclasses.asdict(cap.stats) | {"consumer_s": consumer_s[0]}

    # The race check: the next step is issued before the copy is waited for.
    checks = []
    for k in range(cfg["verify"]):
        step()
        live = state()
        pending = cap.capture(1000 + k, live)
        tensors = _tensors(live, _split)
        skeleton = _split(live, [], set())
        clones = [t.detach().clone() for t in tensors]  # stream-ordered
        frozen = _join(skeleton, clones, dtensor.no_meshes)  # plain tensors: no DTensor
        step()
        with pending as snap:
            got = snap.digest()
        want = sync_buf.capture(1000 + k, frozen).digest()
        checks.append({"step": 1000 + k, "async": got, "sync": want, "match": got == want})
    out["digests"] = checks
    dist.barrier()
    dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))


def _fsdp_rank(rank: int, world: int, port: int, cfg: dict[str, Any], tmp: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stalwart.ckpt import dtensor
    from stalwart.ckpt.device_copy import AsyncCapture
    from stalwart.ckpt.fsdp import sharded_views
    from stalwart.ckpt.snapshot import SnapshotBuffer, restore
    from stalwart.orchestrator.worker.collective import ElasticGroup

    device, backend, sync_stream = _device(rank, cfg)
    cuda = device.type == "cuda"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    group = ElasticGroup()

    def generation(gen: int):
        group.configure(
            dist.PrefixStore(f"gen{gen}", store),
            rank,
            world,
            gen,
            backend,
            device,
            None if cuda else "127.0.0.1",
            datetime.timedelta(seconds=120),
        )
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = _mlp(cfg["state_gb"] / max(world, 1), cfg["width"]).to(device)
        for block in model:
            if isinstance(block, torch.nn.Linear):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        return mesh, model, opt, sharded_views({"model": model, "optimizer": opt})

    mesh, model, opt, views = generation(1)
    x = torch.randn(cfg["batch"], cfg["width"], device=device)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> dict[str, Any]:
        return {"step": 0, "objects": {n: v.state_dict() for n, v in views.items()}}

    step()
    cap = AsyncCapture()
    cap.guard(opt)
    out: dict[str, Any] = {
        "rank": rank,
        "subgroups": [type(mesh.get_group(d)).__name__ for d in range(2)],
        "modes": {},
    }
    for mode in ("none", "async"):
        times, prev = [], None
        for i in range(cfg["steps"] + 2):
            t0 = time.perf_counter()
            step()
            if prev is not None:  # the last copy, waited for once this step is issued
                with prev:
                    pass
                prev = None
            if mode == "async":
                prev = cap.capture(i, state())
            sync_stream()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        if prev is not None:
            with prev:
                pass
        out["modes"][mode] = {"step_s_mean": statistics.fmean(times)}
    live = state()
    pending = cap.capture(7, live)
    frozen = {"step": 0, "objects": {n: v.state_dict() for n, v in views.items()}}
    frozen_snap = SnapshotBuffer(pin_memory=cuda).capture(7, frozen)
    step()  # issued before the copy is waited for
    with pending as snap:
        out["race_match"] = snap.digest() == frozen_snap.digest()
        kept = restore(snap, device, lambda ref, local: local)  # shards only, for the restore
    group.abort("gpu_check: the subgroups are released")
    mesh, model, opt, views = generation(2)
    rebuild = dtensor.rebuilder(dtensor.meshes_of([model, opt]))
    again = restore(frozen_snap, device, rebuild)
    for name, view in views.items():
        view.load_state_dict(again["objects"][name])
    out["restored_exact"] = all(
        torch.equal(dtensor.local_shard(p), kept["objects"]["model"][k])
        for k, p in views["model"].state_dict().items()
    )
    dist.barrier()
    Path(tmp, f"fsdp{rank}.json").write_text(json.dumps(out))


def _tensors(state: Any, split) -> list:
    found: list = []
    split(state, found, set())
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gb", type=float, default=1.0, help="params + Adam per rank")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=2, help="snapshot every N steps")
    p.add_argument("--verify", type=int, default=2, help="race-checked async captures")
    p.add_argument("--out", type=Path, help="also write the JSON summary here")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo"
    )
    p.add_argument("--ranks", type=int, default=0, help="processes (default: as above)")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.distributed.is_nccl_available():
        print("gpu_check: this torch has no NCCL backend", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    # One rank per GPU, at most two: NCCL refuses two ranks on one GPU, so one GPU is a
    # world of 1 (DDP's all-reduce and FSDP's collectives then move nothing between GPUs).
    world = args.ranks or (2 if gpus >= 2 or args.device == "cpu" else 1)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    before = _nvml()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank, args=(world, _free_port(), cfg, tmp), nprocs=world)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        if args.out:  # kept if the FSDP part hangs and the caller's timeout ends this
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"partial": "DDP part only", "ranks": ranks}) + "\n")
        # The FSDP part fails on its own (an older torch, an NCCL error) without losing the
        # DDP part's figures: its error goes in the summary and the exit code is 1.
        fsdp, fsdp_error = [], None
        try:
            torch.multiprocessing.spawn(
                _fsdp_rank, args=(world, _free_port(), cfg, tmp), nprocs=world
            )
            fsdp = [json.loads(Path(tmp, f"fsdp{r}.json").read_text()) for r in range(world)]
        except Exception as e:
            fsdp_error = f"{type(e).__name__}: {str(e)[-3000:]}"
            print(f"gpu_check: the FSDP part failed: {fsdp_error}", file=sys.stderr)
    modes = ranks[0]["modes"]
    none = modes["none"]["step_s_mean"]
    matched = all(c["match"] for r in ranks for c in r["digests"])
    fsdp_ok = bool(fsdp) and all(f["race_match"] and f["restored_exact"] for f in fsdp)
    summary = {
        "gpus": gpus,
        "world_size": world,
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "torch": torch.__version__,
        "config": cfg,
        "state_bytes_per_rank": ranks[0]["state_bytes"],
        "modes": modes,
        "ratios": {
            "sync/none": modes["sync"]["step_s_mean"] / none,
            "async/none": modes["async"]["step_s_mean"] / none,
            "async/sync": modes["async"]["step_s_mean"] / modes["sync"]["step_s_mean"],
        },
        "async_stats": [r["async_stats"] for r in ranks],
        "digests_match": matched,
        "fsdp_ok": fsdp_ok,
        "fsdp": fsdp,
        "fsdp_error": fsdp_error,
        "fsdp_async/none": fsdp[0]["modes"]["async"]["step_s_mean"]
        / fsdp[0]["modes"]["none"]["step_s_mean"]
        if fsdp
        else None,
        "digests": [r["digests"] for r in ranks],
        "nvml_before": before,
        "nvml_after": _nvml(),
        "wall_s": time.perf_counter() - t0,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if not matched:
        print("gpu_check: an async snapshot differs from the synchronous one", file=sys.stderr)
    if not fsdp_ok:
        print("gpu_check: the FSDP part failed or its check did not hold", file=sys.stderr)
    return 0 if matched and fsdp_ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Where a restore's time goes, phase by phase, on one rank's state (a model and AdamW).

    python bench/restore_profile.py [--mb 250] [--repeats 3]

The state is captured as a worker captures it (ckpt/snapshot.py SnapshotBuffer), written to
a file in /dev/shm as a node agent keeps it, and restored from that file mapped read-only
(ckpt/store.py read_in_place) the way a rank restores its own shard: the checksum pass,
``restore()`` (the tensors rebuilt from the payload), then the model's and the optimizer's
load, both ways: copied out of the payload first (as before), or borrowed (views of the
payload copied into the tensors the objects have). Two cases: a survivor (the process
that trained: the loop builds its model and optimizer again, and the last generation's
optimizer and its state still exist) and a fresh process (a spare or standby taking the
rank: the model built, an optimizer without state, nothing before it).
Every figure is the median of --repeats. Nothing else runs: this is the phase alone,
without a second rank restoring beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, payload_checksum, restore

torch.set_num_threads(1)


def build(mb: int, trained: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose state with AdamW's (params, exp_avg, exp_avg_sq) is about `mb` MB."""
    params = mb * 2**20 // (3 * 4)
    width = 2048
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        model(torch.randn(4, width)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def state_of(model, opt) -> dict:
    return {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}}


def write(mb: int, path: Path) -> dict:
    model, opt = build(mb, trained=True)
    snap = SnapshotBuffer().capture(7, state_of(model, opt))
    raw = snap.payload.numpy()
    path.write_bytes(raw.tobytes())
    return {
        "skeleton": snap.skeleton.hex(),
        "metas": [vars(m) if hasattr(m, "__dict__") else m._asdict() for m in snap.metas],
        "checksum": payload_checksum(raw),
        "nbytes": int(raw.nbytes),
    }


def measure(
    where: dict, path: Path, trained: bool, mb: int, repeats: int, ways=(False, True)
) -> dict:
    """Both ways of loading: the tensors copied out of the payload and then loaded (before
    issue 23's in-place restore), and borrowed: the views loaded into what the objects
    already have (orchestrator/worker/restore.py load_into)."""
    from stalwart.ckpt.snapshot import TensorMeta
    from stalwart.orchestrator.worker.restore import load_into

    model, opt = build(mb, trained=False)  # the loop builds its objects again
    retired = [build(mb, trained=True)[1]] if trained else []  # the last generation's
    metas = tuple(TensorMeta(**m) for m in where["metas"])
    phases: dict[str, list[float]] = {}
    for _ in range(repeats):
        for borrow in ways:
            way = "borrowed" if borrow else "copied"
            t0 = time.perf_counter()
            payload = np.memmap(path, dtype=np.uint8, mode="r", shape=(where["nbytes"],))
            snap = Snapshot(7, bytes.fromhex(where["skeleton"]), metas, payload, where["checksum"])
            assert snap.intact()
            t1 = time.perf_counter()
            state = restore(snap, borrow=borrow)
            t2 = time.perf_counter()
            objects = state["objects"]
            if borrow:
                load_into(model, objects["model"])
            else:
                model.load_state_dict(objects["model"])
            t3 = time.perf_counter()
            if borrow:
                load_into(opt, objects["optimizer"], retired)
            else:
                opt.load_state_dict(objects["optimizer"])
            t4 = time.perf_counter()
            for name, seconds in (
                ("map + checksum", t1 - t0),
                (f"restore(), {way}", t2 - t1),
                (f"model load, {way}", t3 - t2),
                (f"optimizer load, {way}", t4 - t3),
                (f"total, {way}", t4 - t0),
            ):
                phases.setdefault(name, []).append(seconds)
            del state, objects, snap, payload
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built again, no state
    return {k: round(statistics.median(v), 4) for k, v in phases.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=250, help="state per rank, MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--borrow", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        where = json.loads(Path(args.child).read_text())
        out = measure(where, Path(where["path"]), False, args.mb, 1, (bool(args.borrow),))
        print(json.dumps(out))
        return 0
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        path = Path(tmp) / "shard"
        where = write(args.mb, path)
        where["path"] = str(path)
        survivor = measure(where, path, True, args.mb, args.repeats)
        info = Path(tmp) / "where.json"
        info.write_text(json.dumps(where))
        # A fresh process per way and repeat: the first touch of its memory is the point.
        runs: list[dict[str, float]] = []
        for _ in range(args.repeats):
            for borrow in ("0", "1"):
                cmd = [sys.executable, __file__, "--mb", str(args.mb), "--child", str(info)]
                done = subprocess.run(
                    [*cmd, "--borrow", borrow],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        fresh = {k: round(statistics.median(r[k] for r in runs if k in r), 4) for k in survivor}
    print(f"{args.mb} MB of state (model + AdamW), median of {args.repeats}, seconds")
    print(f"{'phase':28s} {'survivor':>10s} {'fresh process':>14s}")
    for k in survivor:
        print(f"{k:28s} {survivor[k]:10.4f} {fresh[k]:14.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

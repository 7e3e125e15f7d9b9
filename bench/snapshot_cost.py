#!/usr/bin/env python
"""What one snapshot of the quickstart's state (5 MB, 119 tensors) costs, old path and new.

    python bench/snapshot_cost.py [--rounds 6] [--per-round 30]

old: SnapshotBuffer.capture into a buffer, then what the hand-over thread did (adler32 and
     a memcpy into a shared-memory slot file); the two agent calls it also made are not
     counted.
ring: RingPipeline.submit into a ring in /dev/shm, found by a RingHub that takes the
     checksum and keeps the shard (ckpt/ring.py, orchestrator/agent/rings.py).
Both interleaved, in one process, one torch thread; the figures are the median over rounds
of the wall and the calling thread's CPU time per snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=30)
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from stalwart.ckpt.ring_pipeline import RingPipeline
    from stalwart.ckpt.snapshot import SnapshotBuffer, payload_checksum
    from stalwart.ckpt.store import ShmShardStore
    from stalwart.examples.gpt.model import GPT, GPTConfig
    from stalwart.orchestrator.agent.rings import RingHub
    from stalwart.orchestrator.worker.context import capture_rng

    torch.set_num_threads(1)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model(torch.randint(0, 64, (16, 64))).sum().backward()
    opt.step()

    def state(step: int) -> dict:
        return {
            "step": step,
            "objects": {"model": model.state_dict(), "optimizer": opt.state_dict()},
            "rng": capture_rng(),
            "counters": {"samples": 0.0, "tokens": 0.0},
        }

    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        slot = np.memmap(Path(root) / "slot", dtype=np.uint8, mode="w+", shape=(8 << 20,))
        buf = SnapshotBuffer()

        def old(step: int) -> None:
            snap = buf.capture(step, state(step))
            payload = snap.payload.numpy()
            zlib.adler32(payload)
            np.copyto(slot[: len(payload)], payload)

        store = ShmShardStore(Path(root) / "store")

        def keep(reader, index, step, generation, skeleton) -> bool:
            checksum = payload_checksum(reader.ring.payload(index))
            store.commit_ring(0, step, skeleton, reader.ring.metas, reader, index, checksum)
            store.trim(set(), 3)
            return True

        hub = RingHub(store.root, keep, lambda r: store.move_out(0, r.held_steps()[0]))
        pipe = RingPipeline(lambda m, n, k: hub.open(0, m, n, k), None, generation=lambda: 1)
        runs: dict[str, list[tuple[float, float]]] = {"old": [], "ring": []}
        try:
            for r in range(args.rounds):
                for name, f in (("old", old), ("ring", lambda s: pipe.submit(s, state(s)))):
                    cpu0, wall0 = time.thread_time(), time.perf_counter()
                    for i in range(args.per_round):
                        f(r * 1000 + i)
                    pipe.drain(10)
                    n = args.per_round
                    runs[name].append(
                        ((time.perf_counter() - wall0) / n, (time.thread_time() - cpu0) / n)
                    )
        finally:
            hub.close()
            store.close()
    for name, v in runs.items():
        wall = statistics.median(x[0] for x in v) * 1e3
        cpu = statistics.median(x[1] for x in v) * 1e3
        print(
            f"{name:5s} {wall:6.2f} ms wall, {cpu:6.2f} ms CPU of the calling thread per snapshot"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

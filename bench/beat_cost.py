#!/usr/bin/env python
"""What a rank's heartbeat costs in CPU, both ways it can go to its node agent.

    python bench/beat_cost.py [--beats 2000] [--out bench/results/beat_cost.json]

On a local Ray of 2 CPUs, an actor standing in for a rank sends `--beats` heartbeats (a
real one, worker/heartbeat.py's, with 32 recent steps) to an actor standing in for its node
agent, one every 2 ms, either as a Ray call (the agent's `heartbeat`, as before) or written
into a snapshot ring's heartbeat area (ckpt/ring.py), which the agent reads as it does for
a report (every 50th beat here, ~10 times a second). The figure per side is
the process's CPU time over the run divided by the beats, less the same loop's CPU with
no beat at all (its sleeps and clock reads).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ray

from stalwart.ckpt.ring import RingFile
from stalwart.orchestrator.worker import heartbeat
from stalwart.orchestrator.worker.context import RECENT_STEPS, Progress


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


@ray.remote(num_cpus=0, max_concurrency=8)
class Agent:
    def __init__(self, ring: str):
        self.ring = RingFile(ring)
        self.beats: dict = {}

    def heartbeat(self, rank: int, beat: dict) -> None:  # the call path, as NodeAgent's
        beat["received_at"] = time.time()
        self.beats[rank] = beat

    def read(self) -> None:  # the ring path: what RingHub.beats() does per rank
        raw = self.ring.read_beat()
        if raw is not None:
            self.beats[0] = json.loads(raw)

    def cpu(self) -> float:
        return _cpu()


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, ring: str):
        self.ring = RingFile(ring)

    def run(self, agent, beats: int, mode: str) -> tuple[float, float]:
        progress = Progress()
        for s in range(RECENT_STEPS):
            progress.recent.append((s, 0.0123, 0.0234))
        agent_before, before = ray.get(agent.cpu.remote()), _cpu()
        for i in range(beats):
            progress.step = i
            if mode != "none":
                beat = heartbeat.beat(0, 1, progress, None, None, None, {}, {"captures": i})
                if mode == "call":
                    agent.heartbeat.remote(0, beat)
                else:
                    self.ring.write_beat(heartbeat.encode(beat))
                    if i % 50 == 0:  # a report now and then reads it
                        agent.read.remote()
            time.sleep(0.002)
        rank_cpu = _cpu() - before
        time.sleep(1.0)  # the agent's last calls
        return rank_cpu, ray.get(agent.cpu.remote()) - agent_before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beats", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = RingFile.create(Path(d) / "ring", 1, (), 8, 64).path
        agent, rank = Agent.remote(ring), Rank.remote(ring)
        ray.get(agent.cpu.remote())
        raw: dict[str, list[tuple[float, float]]] = {"none": [], "call": [], "ring": []}
        for _ in range(2):
            for mode in raw:
                raw[mode].append(ray.get(rank.run.remote(agent, args.beats, mode)))
    base_rank = min(r for r, _ in raw["none"])
    base_agent = min(a for _, a in raw["none"])
    out = {}
    for mode in ("call", "ring"):
        r = min(r for r, _ in raw[mode])
        a = min(a for _, a in raw[mode])
        out[mode] = {
            "rank_us_per_beat": round((r - base_rank) / args.beats * 1e6, 1),
            "agent_us_per_beat": round(max(0.0, a - base_agent) / args.beats * 1e6, 1),
        }
        print(
            f"{mode}: rank {out[mode]['rank_us_per_beat']:.0f} us, "
            f"agent {out[mode]['agent_us_per_beat']:.0f} us of CPU per beat"
        )
    if args.out:
        record = {"beats": args.beats, "per_beat": out, "raw": raw}
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

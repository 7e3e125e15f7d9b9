#!/usr/bin/env python
"""What the exporter costs the supervisor at scale: one `JobMetrics.refresh` (every
METRICS_REFRESH_S = 0.5 s on the supervisor) and one scrape (Prometheus's GET /metrics,
rendered by prometheus-client), for jobs of N ranks on N/8 nodes with 8 GPUs each.

    python bench/metrics_cost.py [--sizes 64 1024 4096 16384] [--repeats 5]

Real code: orchestrator/observe/metrics.JobMetrics with its own registry, fed heartbeats in the
shape of TrainWorker._beat (as the supervisor's `_refresh_metrics` passes them: the newest beat of
each rank with its node, 16 new steps per rank since the last refresh, snapshot stats),
replicator status per node and GPU readings per node (8 GPUs, as NodeAgent.report sends
them). Nothing else runs: this is the exporter's own cost, single-threaded, on this machine.
Prints one row per size: refresh and GPU-readings time (median of the repeats), scrape
render time and size, series count.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import generate_latest

from stalwart.orchestrator.observe.metrics import JobMetrics

GPUS_PER_NODE = 8


def _beats(n: int, step: int, t: float) -> dict[int, dict]:
    return {
        r: {
            "received_at": t - 0.1,
            "node_id": f"node-{r // GPUS_PER_NODE:05d}",
            "pid": 1000 + r,
            "compute_seconds": 0.2 + (r % 7) * 0.001,
            "collective_seconds": 0.01,
            "rss_bytes": 8_000_000_000,
            "samples": step * 16.0,
            "tokens": step * 16.0 * 2048,
            "metrics": {"loss": 2.0},
            "recent": [(s, 0.2, 0.25) for s in range(step - 16, step)],
            "snapshot": {
                "captures": step,
                "capture_seconds": step * 0.004,
                "handover_seconds": step * 0.02,
                "last_bytes": 500_000_000,
            },
        }
        for r in range(n)
    }


def _progress(n: int, step: int) -> dict:
    return {
        "step": step,
        "total_steps": 100_000,
        "committed_step": step - 1,
        "workers": n,
        "generation": 1,
        "spares": 8,
        "cordoned": 0,
    }


def _gpus(node: str) -> list[dict]:
    return [
        {
            "node": node,
            "index": i,
            "xids": [],
            "temperature_c": 60.0,
            "power_w": 500.0,
            "ecc_uncorrected": 0,
            "retired_pages": 0,
            "lost": False,
            "error": None,
        }
        for i in range(GPUS_PER_NODE)
    ]


def measure(n: int, repeats: int) -> dict:
    m = JobMetrics("bench")
    nodes = [f"node-{i:05d}" for i in range(n // GPUS_PER_NODE)]
    scores = {r: 1.0 for r in range(n)}
    refresh, gpu, render, size = [], [], [], 0
    for i in range(repeats + 1):  # the first round creates the series: not counted
        step = 100 + 16 * i
        t = 1000.0 + i
        beats = _beats(n, step, t)
        rep = {
            node: {"sent_bytes": step * 10**9, "rounds": step, "seconds": step * 0.1}
            for node in nodes
        }
        t0 = time.perf_counter()
        m.refresh(_progress(n, step), beats, scores, t, 3, 0, rep, 0.25)
        t1 = time.perf_counter()
        for node in nodes:
            m.gpu_readings(node, _gpus(node))
        t2 = time.perf_counter()
        text = generate_latest(m.registry)
        t3 = time.perf_counter()
        if i:
            refresh.append(t1 - t0)
            gpu.append(t2 - t1)
            render.append(t3 - t2)
        size = len(text)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return {
        "ranks": n,
        "nodes": len(nodes),
        "refresh_s": statistics.median(refresh),
        "gpu_readings_s": statistics.median(gpu),
        "scrape_render_s": statistics.median(render),
        "scrape_bytes": size,
        "series": series,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    head = ("ranks", "nodes", "refresh", "gpus", "render", "MB", "series")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 6, 9, 8, 8, 7, 8), strict=True)))
    for n in args.sizes:
        r = measure(n, args.repeats)
        print(
            f"{r['ranks']:>6} {r['nodes']:>6} {r['refresh_s'] * 1000:>7.1f}ms "
            f"{r['gpu_readings_s'] * 1000:>6.1f}ms {r['scrape_render_s'] * 1000:>6.0f}ms "
            f"{r['scrape_bytes'] / 1e6:>7.2f} {r['series']:>8}"
        )


if __name__ == "__main__":
    main()

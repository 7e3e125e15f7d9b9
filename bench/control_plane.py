#!/usr/bin/env python
"""Control-plane scale: simulated ranks heartbeating through agents into a real supervisor.

    python bench/control_plane.py [--sizes 1024 4096 16384] [--seconds 60] [--hosts 2]
        [--injections 5] [--diagnose-without-stragglers 16384]
        [--profile-sizes 1024 2048 4096] [--ray-cost-nodes 2048]
        [--out bench/control_plane_results.json] [--quick]

What runs for real: ``HealthMonitor`` and ``ReportPoller`` (orchestrator/supervisor/monitor.py,
poller.py) inside a Ray actor, ``BenchSupervisor``, driven the way ``JobSupervisor._tick`` drives
them: every ``report_interval_s`` (1 s here) ``poller.poll(nodes)`` (one ``report`` call in flight
per node, answers taken as they come), each report's beats fed to ``monitor.beat`` (after the same
pid and generation checks as ``_poll_agents``), then ``monitor.lost_nodes(now)``; a lost node is
forgotten (``monitor.forget_node``, ``poller.forget``) and recovered; otherwise
``monitor.hang(now)`` and ``monitor.stragglers()`` run, as in ``_detect``.

What is simulated: the node agents and their ranks. ``--hosts`` ``SimHost`` actors (async Ray
actors) each answer ``report(node)`` for many simulated nodes of 8 ranks, in the shape of
``NodeAgent.report`` (node, at, beats, stored, gpus, ...), every beat in the shape of
``TrainWorker._beat`` plus the agent's ``received_at``, with ``recent`` holding the last 32
(step, compute seconds, cycle seconds). Ranks step once per second (1 s steps, compute
0.5 s x lognormal noise, sigma 0.1) and heartbeat once per step (at its end); beats are made
lazily at report time from the simulated clock, so a host costs per report, not per rank.

Injections, ``--injections`` of each per size, spaced in time on nodes and ranks spread over
the job (and over the hosts):
- stragglers first: one rank's compute time becomes 3x from the next step on (it stays slow);
  detection latency = the supervisor's first ``stragglers()`` verdict naming the rank minus the
  start of its first slow step (also given in steps);
- then node losses: the node's host stops answering ``report(node)`` (the call never returns,
  which is what a lost node's agent looks like to the poller); detection latency = the first
  ``lost_nodes()`` naming it minus the moment the host went silent (a request already in
  flight then is never answered either, so the poller's silence clock may start a little
  before the injection, as it would for a real node dying). The supervisor then
  recovers as ``JobSupervisor`` would, without the spare/restore work: a replacement node
  (new processes) takes the node's ranks, every rank starts a new generation (``recent``
  cleared, as on a restore) and ``monitor.start_generation`` is called.
Stragglers come first because a recovery restarts straggler history (10 steps before any
verdict), as it does in a real job.

Measured per size: the supervisor process's CPU time (all its threads, Ray's included) per
wall second; report lag = the time the supervisor starts ingesting a report minus its "at"
(the agent's clock; one machine), p50/p99 in the first and last third of the run; the time
between polls; where each loop iteration's time goes (asks, the rest of ``poll``, ingest,
``lost_nodes``, ``hang``, ``stragglers``); detection latencies (p50/p99/max; an injection not
detected before the run ends counts as missed). To attribute the cost: with
``--profile-sizes`` the monitor alone is timed on synthetic input (no Ray) and
``stragglers()`` is profiled with cProfile; with ``--ray-cost-nodes`` Ray's cost per report
call (ask, ray.wait, ray.get) is measured without the monitor.

The goal (the issue's): at every size, no growing lag and p99 detection under 2x the
configured timeout. Node loss: ``heartbeat_timeout_s`` (3 s), so p99 < 6 s. Stragglers have
no timeout; the detector's configured horizon is ``window_steps * consecutive_windows`` steps
(5 x 2 = 10 s at 1 s/step), so p99 < 20 s (this script's reading of the goal). Lag "grows"
when the last third's p99 exceeds the first third's by more than one report interval, when
the last third has no report at all, or when at the end the supervisor has not polled for more
than two intervals (it is stuck).

A run whose supervisor is still busy ``--grace`` seconds after its end is stopped; the actor
is asked for its figures (another thread answers) and then killed.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from stalwart.health.slow_link import LinkConfig  # noqa: E402
from stalwart.orchestrator.spec import HealthSpec  # noqa: E402
from stalwart.orchestrator.supervisor.links import LinkWatch  # noqa: E402
from stalwart.orchestrator.supervisor.monitor import HealthMonitor  # noqa: E402
from stalwart.orchestrator.supervisor.poller import ReportPoller  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "control_plane_results.json"
DEFAULT_SIZES = (1024, 4096, 16384)
RANKS_PER_NODE = 8
STEP_S = 1.0  # one step per second; one heartbeat per step
COMPUTE_S = 0.5  # median compute time of a step
COMPUTE_SIGMA = 0.1  # lognormal noise on compute times
CYCLE_SIGMA = 0.02  # lognormal noise on step cycle times
SLOW_FACTOR = 3.0  # an injected straggler's compute times
STEP_PHASE_S = 0.5  # the simulated steps' phase against the supervisor's polls
RECENT_STEPS = 32  # as orchestrator/worker/context.py (importing it would import torch)
AGENT_HOP_S = 0.001  # worker -> agent: received_at = sent_at + this
PID_BASE = 100_000
PID_STRIDE = 1_000_000  # a replacement process's pid: old + this
HEALTH = {"report_interval_s": 1.0, "heartbeat_timeout_s": 3.0}
# Worker._beat's "snapshot" (vars(PipelineStats)) and a typical RSS, for the beat's size.
SNAPSHOT_STATS = {
    "captures": 0,
    "capture_seconds": 0.0,
    "handover_seconds": 0.0,
    "wait_seconds": 0.0,
    "last_bytes": 48_000_000,
    "last_stored_step": None,
    "errors": 0,
    "last_error": None,
}
RSS_BYTES = 3_200_000_000


# --- pure helpers (tests/unit/test_control_plane_bench.py) --------------------------------------


def _start_ray(tmp: str) -> None:
    """A private local Ray (its own temp dir) whose workers import this repository."""
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        _temp_dir=tmp,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def split_thirds(
    samples: list[tuple[float, float]], start: float, end: float
) -> tuple[list[float], list[float], list[float]]:
    """(time, value) samples -> the values of the first, middle and last third of [start, end)."""
    third = (end - start) / 3.0
    first, middle, last = [], [], []
    for t, v in samples:
        if t < start + third:
            first.append(v)
        elif t >= end - third:
            last.append(v)
        else:
            middle.append(v)
    return first, middle, last


def slope(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of value over time (s of lag per s of run for lag samples)."""
    if len(samples) < 2:
        return None
    mt = statistics.fmean(t for t, _ in samples)
    mv = statistics.fmean(v for _, v in samples)
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in samples) / var


def lag_summary(
    samples: list[tuple[float, float]],
    start: float,
    end: float,
    interval_s: float,
    since_last_poll_s: float | None = None,
) -> dict[str, Any]:
    """Report lag over the run and in its first and last third. It grows when the last third's
    p99 is more than one report interval above the first third's (or the last third has no
    reports at all), or when the supervisor has not polled for two intervals at the end."""
    first, _, last = split_thirds(samples, start, end)
    all_v = [v for _, v in samples]
    out: dict[str, Any] = {
        "n": len(all_v),
        "p50_s": percentile(all_v, 50),
        "p99_s": percentile(all_v, 99),
        "max_s": max(all_v) if all_v else None,
        "first_third": {
            "n": len(first),
            "p50_s": percentile(first, 50),
            "p99_s": percentile(first, 99),
        },
        "last_third": {
            "n": len(last),
            "p50_s": percentile(last, 50),
            "p99_s": percentile(last, 99),
        },
        "slope_s_per_s": slope(samples),
        "since_last_poll_at_end_s": since_last_poll_s,
    }
    f99, l99 = out["first_third"]["p99_s"], out["last_third"]["p99_s"]
    stuck = since_last_poll_s is not None and since_last_poll_s > 2 * interval_s
    out["stuck_at_end"] = stuck
    out["grows"] = bool(stuck or l99 is None or (f99 is not None and l99 - f99 > interval_s))
    return out


def detection_summary(latencies: list[float | None], limit_s: float) -> dict[str, Any]:
    """Latencies of the injections (None: not detected before the run ended)."""
    found = [x for x in latencies if x is not None]
    p99 = percentile(found, 99)
    return {
        "injected": len(latencies),
        "detected": len(found),
        "missed": len(latencies) - len(found),
        "p50_s": percentile(found, 50),
        "p99_s": p99,
        "max_s": max(found) if found else None,
        "latencies_s": latencies,
        "limit_s": limit_s,
        "within_limit": bool(latencies) and len(found) == len(latencies) and p99 < limit_s,
    }


def plan_injections(
    seconds: float,
    count: int,
    step_s: float,
    timeout_s: float,
    span_steps: int,
    interval_s: float = 0.0,
) -> list[dict[str, Any]]:
    """When to inject, as offsets from the run's start: `count` stragglers 2 steps apart from
    step 2, then `count` node losses `timeout_s + 2` s apart, the first one late enough that
    every straggler has had its full limit (2 x `span_steps` steps) before a recovery restarts
    straggler history; the last loss must be detectable (twice the timeout) before `seconds`.
    The losses fall at phases spread evenly over one poll interval `interval_s` (the poller
    polls at whole intervals from the start): detection depends on where in it a node dies."""
    plan = [{"kind": "straggler", "at": (2 + 2 * i) * step_s, "index": i} for i in range(count)]
    losses_from = (2 + 2 * (count - 1) + 1 + 2 * span_steps) * step_s if count else 0.0
    gap = timeout_s + 2.0
    plan += [
        {
            "kind": "node_loss",
            "at": losses_from + i * gap + interval_s * (i + 0.5) / count,
            "index": i,
        }
        for i in range(count)
    ]
    if count and plan[-1]["at"] + 2 * timeout_s > seconds:
        need = math.ceil(plan[-1]["at"] + 2 * timeout_s)
        raise ValueError(f"{count} injections of each kind need a run of at least {need} s")
    return plan


def pick_targets(n_nodes: int, count: int, per_node: int) -> tuple[list[int], list[int]]:
    """`count` nodes to lose and `count` ranks to slow, spread over the job, on other nodes
    than the losses (so the two never share a node)."""
    if count == 0:
        return [], []
    if n_nodes < 2 * count:
        raise ValueError(f"{n_nodes} nodes cannot hold {count} node losses and {count} stragglers")
    stride = n_nodes / count
    losses = [int(i * stride) + 1 for i in range(count)]
    losses = [min(n, n_nodes - 1) for n in losses]
    taken = set(losses)
    slow_nodes = []
    for i in range(count):
        n = int(i * stride + stride / 2) % n_nodes
        while n in taken:
            n = (n + 1) % n_nodes
        taken.add(n)
        slow_nodes.append(n)
    ranks = [n * per_node + (i * 3 + 2) % per_node for i, n in enumerate(slow_nodes)]
    return losses, ranks


def node_name(i: int) -> str:
    return f"simnode-{i:05d}"


def goal_verdict(
    lag: dict[str, Any], node_loss: dict[str, Any], straggler: dict[str, Any] | None
) -> dict[str, Any]:
    """The goal at one size: no growing lag, node-loss p99 < 2x heartbeat_timeout_s and (when
    stragglers are looked for) straggler p99 < 2x the detector's window span."""
    parts = {
        "lag_steady": not lag["grows"],
        "node_loss_p99_within_limit": node_loss["within_limit"],
    }
    if straggler is not None:
        parts["straggler_p99_within_limit"] = straggler["within_limit"]
    return {**parts, "held": all(parts.values())}


# --- the simulated agents -----------------------------------------------------------------------


@ray.remote(num_cpus=0, max_concurrency=4096)
class SimHost:
    """Many simulated node agents in one process; `report(node)` is NodeAgent.report's twin."""

    def __init__(self, index: int, nodes: dict[str, list[int]], seed: int):
        self.index = index
        self.nodes = {node: list(ranks) for node, ranks in nodes.items()}
        self.pid = {r: PID_BASE + r for ranks in nodes.values() for r in ranks}
        self.recent: dict[int, deque] = {r: deque(maxlen=RECENT_STEPS) for r in self.pid}
        self.next_step = dict.fromkeys(self.pid, 0)  # first step whose times are not made yet
        self.rng = random.Random(seed)
        self.t0 = float("inf")  # the simulated clock's step 0 starts here
        self.generation = 0
        self.slow: dict[int, int] = {}  # rank -> first slow step
        self.silenced: dict[str, asyncio.Event] = {}
        self.reports = 0

    async def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "cpu_s": time.process_time(), "ranks": len(self.pid)}

    async def set_clock(self, t0: float) -> None:
        self.t0 = t0

    def _done(self, now: float) -> int:
        """Steps every rank has completed at `now`."""
        return max(0, int((now - self.t0) / STEP_S)) if now >= self.t0 else 0

    def _beat(self, rank: int, done: int) -> dict[str, Any]:
        rec = self.recent[rank]
        nxt = self.next_step[rank]
        if nxt < done:
            slow_from = self.slow.get(rank)
            gauss = self.rng.gauss
            for s in range(max(nxt, done - RECENT_STEPS), done):
                compute = COMPUTE_S * math.exp(COMPUTE_SIGMA * gauss(0.0, 1.0))
                if slow_from is not None and s >= slow_from:
                    compute *= SLOW_FACTOR
                rec.append((s, compute, STEP_S * math.exp(CYCLE_SIGMA * gauss(0.0, 1.0))))
            self.next_step[rank] = done
        sent = self.t0 + done * STEP_S if done else time.time()
        return {
            "rank": rank,
            "generation": self.generation,
            "pid": self.pid[rank],
            "step": done,
            "metrics": {"loss": 2.0 + 1.0 / (1 + done)},
            "samples": 64.0 * done,
            "compute_seconds": rec[-1][1] if rec else 0.0,
            "collective_seconds": max(0.0, rec[-1][2] - rec[-1][1]) if rec else 0.0,
            "recent": list(rec),
            "collective_since": None,  # beats go out at a step's end
            "rss_bytes": RSS_BYTES,
            "gpu_index": rank % RANKS_PER_NODE,
            "sent_at": sent,
            "timings": {},
            "snapshot": {**SNAPSHOT_STATS, "captures": done, "last_stored_step": done or None},
            "received_at": sent + AGENT_HOP_S,  # NodeAgent.heartbeat stamps it
        }

    async def report(self, node: str) -> dict[str, Any]:
        silent = self.silenced.get(node)
        if silent is not None:
            await silent.wait()  # a lost node: the call does not return (until recovered)
        done = self._done(time.time())
        beats = {r: self._beat(r, done) for r in self.nodes.get(node, ())}
        self.reports += 1
        return {
            "node": node,
            "at": time.time(),
            "beats": beats,
            "stored": {},
            "gpus": [],
            "gpu_probe": None,
            "gpu_probe_error": None,
        }

    async def silence(self, node: str) -> float:
        """Node loss: report(node) stops returning from now on."""
        self.silenced[node] = asyncio.Event()
        return time.time()

    async def slow_down(self, rank: int) -> tuple[int, float]:
        """Straggler: `rank` computes SLOW_FACTOR x longer from the next step on. Returns that
        step and the time it starts."""
        first = self._done(time.time()) + 1
        self.slow[rank] = first
        return first, self.t0 + first * STEP_S

    async def recover(self, generation: int, replace: dict[str, str]) -> dict[int, int]:
        """A recovery: every rank starts `generation` (restored: `recent` cleared); the ranks of
        the nodes in `replace` (old -> new name) run in new processes on the new node.
        Returns the new pids."""
        done = self._done(time.time())
        self.generation = generation
        moved: dict[int, int] = {}
        for old, new in replace.items():
            if old not in self.nodes:
                continue
            ranks = self.nodes.pop(old)
            self.nodes[new] = ranks
            for r in ranks:
                self.pid[r] += PID_STRIDE
                self.slow.pop(r, None)
                moved[r] = self.pid[r]
            silent = self.silenced.pop(old, None)
            if silent is not None:
                silent.set()  # the forgotten calls may end now
        for r, rec in self.recent.items():
            rec.clear()
            self.next_step[r] = done
        return moved

    async def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "cpu_s": time.process_time(), "reports": self.reports}


# --- the supervisor side: the real monitor and poller -------------------------------------------


@ray.remote(num_cpus=0, max_concurrency=4)
class BenchSupervisor:
    """HealthMonitor + ReportPoller driven like JobSupervisor._poll_agents/_detect.

    A threaded actor: run() loops in one thread; snapshot() and stop() are answered by
    another, even while run() is busy."""

    def __init__(self, hosts: list[Any], layout: dict[str, int], health: dict[str, Any]):
        self.hosts = hosts
        self.host_of = {node: hosts[i] for node, i in layout.items()}
        self.nodes = list(layout)  # the nodes polled (JobSupervisor.agents)
        self.node_of: dict[int, str] = {}
        self.pid: dict[int, int] = {}
        for node in layout:
            i = int(node.rsplit("-", 1)[1])
            for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE):
                self.node_of[r], self.pid[r] = node, PID_BASE + r
        self.spec = HealthSpec.model_validate(health)
        self.monitor = HealthMonitor(self.spec)
        self.ask_s = 0.0
        self.asks = 0
        self.asked_at: dict[str, float] = {}  # node -> when its report was last asked for

        def ask(node: str) -> Any:
            self.asked_at[node] = time.time()
            t = time.perf_counter()
            ref = self.host_of[node].report.remote(node)
            self.ask_s += time.perf_counter() - t
            self.asks += 1
            return ref

        # Every answer's round trip timed at its arrival, as the supervisor's is (a
        # callback per report: health.slow_link's cost is in these figures).
        link = self.spec.slow_link
        self.links = LinkWatch(
            LinkConfig(link.threshold, link.window, link.consecutive_windows, link.min_excess_s)
        )
        self.poller = ReportPoller(ask, self.monitor, self.links.round_trip)
        self.generation = 0
        self._stop = threading.Event()
        self.phase: tuple[str, float] = ("idle", time.time())
        self.lags: list[tuple[float, float]] = []  # (ingest time, ingest - report "at")
        self.answers: list[float] = []  # report "at" - when it was asked for (agent side)
        self.iterations: list[dict[str, Any]] = []
        self.node_lost: dict[str, float] = {}  # node -> when lost_nodes() first named it
        self.flagged: dict[int, dict[str, Any]] = {}  # rank -> first straggler verdict naming it
        self.recoveries: list[dict[str, Any]] = []
        self.started_at: float | None = None
        self.cpu0 = 0.0
        self.ended_at: float | None = None
        self.cpu1: float | None = None

    def start_generation(self) -> None:
        self.monitor.start_generation(
            {r: (self.node_of[r], self.pid[r]) for r in self.node_of}, time.time()
        )

    def run(self, until: float) -> None:
        self.started_at, self.cpu0 = time.time(), time.process_time()
        interval = self.spec.report_interval_s
        try:
            while not self._stop.is_set() and time.time() < until:
                self._iteration()
                wait = self.poller.last_poll + interval - time.time()
                if wait > 0:
                    self._stop.wait(wait)
        finally:
            self.phase = ("done", time.time())
            self.ended_at, self.cpu1 = time.time(), time.process_time()

    def _iteration(self) -> None:
        t0, c0, a0 = time.time(), time.process_time(), self.ask_s
        self.phase = ("poll", t0)
        n_nodes, asks0 = len(self.nodes), self.asks
        reports = self.poller.poll(self.nodes)
        t1 = time.time()
        self.phase = ("ingest", t1)
        beats = 0
        for rep in reports:
            now = time.time()
            self.lags.append((now, now - rep["at"]))
            self.answers.append(rep["at"] - self.asked_at.get(rep["node"], math.nan))
            for rank, beat in rep["beats"].items():
                rank = int(rank)
                # _poll_agents' checks: this rank's current process, this generation
                if (
                    rank in self.pid
                    and beat["pid"] == self.pid[rank]
                    and beat.get("generation") == self.generation
                ):
                    self.monitor.beat(rank, beat)
                    beats += 1
        t2 = time.time()
        self.phase = ("lost_nodes", t2)
        lost, _reason = self.monitor.lost_nodes(t2)
        t3 = time.time()
        t_hang = t_strag = t_rec = t3
        flagged = 0
        if lost:
            for node in lost:
                self.node_lost.setdefault(node, t3)
                self.monitor.forget_node(node)
                self.poller.forget(node)
                self.nodes.remove(node)
            self.phase = ("recover", t3)
            self._recover(lost)
            t_rec = t_hang = t_strag = time.time()
        else:
            self.phase = ("hang", t3)
            self.monitor.hang(t3)
            t_hang = time.time()
            self.phase = ("stragglers", t_hang)
            report, _reason = self.monitor.stragglers()
            t_strag = time.time()
            flagged = len(report.flagged)
            for rank in report.flagged:
                if rank not in self.flagged:
                    self.flagged[rank] = {
                        "at": t_strag,
                        "through_step": report.through_step,
                        "score": report.scores.get(rank),
                    }
        self.iterations.append(
            {
                "t": t0,
                "nodes": n_nodes,
                "asks": self.asks - asks0,
                "reports": len(reports),
                "beats": beats,
                "poll_s": t1 - t0,
                "ask_s": self.ask_s - a0,
                "ingest_s": t2 - t1,
                "lost_nodes_s": t3 - t2,
                "recover_s": t_rec - t3,
                "hang_s": t_hang - t3 if not lost else 0.0,
                "stragglers_s": t_strag - t_hang if not lost else 0.0,
                "flagged": flagged,
                "total_s": time.time() - t0,
                "cpu_s": time.process_time() - c0,
            }
        )

    def _recover(self, lost: list[str]) -> None:
        """What a recovery leaves behind (not its work): replacements for the lost nodes'
        ranks, a new generation everywhere, monitor.start_generation."""
        t = time.time()
        self.generation += 1
        replace = {node: f"{node}.g{self.generation}" for node in lost}
        moved: dict[int, int] = {}
        for part in ray.get([h.recover.remote(self.generation, replace) for h in self.hosts]):
            moved.update(part)
        for old, new in replace.items():
            self.host_of[new] = self.host_of.pop(old)
            self.nodes.append(new)
        for r, pid in moved.items():
            self.node_of[r], self.pid[r] = replace[self.node_of[r]], pid
        self.start_generation()
        self.recoveries.append({"at": t, "lost": lost, "seconds": time.time() - t})

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        phase, since = self.phase
        return {
            "now": now,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "cpu_s": (self.cpu1 if self.cpu1 is not None else time.process_time()) - self.cpu0,
            "phase": phase,
            "phase_for_s": now - since,
            "last_poll": self.poller.last_poll,
            "asks": self.asks,
            "lags": list(self.lags),
            "answers": list(self.answers),
            "iterations": list(self.iterations),
            "node_lost": dict(self.node_lost),
            "flagged": dict(self.flagged),
            "recoveries": list(self.recoveries),
        }


# --- one size -----------------------------------------------------------------------------------


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def run_size(ranks: int, policy: str, args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    n_nodes = ranks // RANKS_PER_NODE
    health = {**HEALTH, "straggler": {"policy": policy}}
    spec = HealthSpec.model_validate(health)
    span = spec.straggler.window_steps * spec.straggler.consecutive_windows
    count = args.injections
    plan = plan_injections(
        args.seconds, count, STEP_S, spec.heartbeat_timeout_s, span, spec.report_interval_s
    )
    if policy == "none":
        plan = [p for p in plan if p["kind"] != "straggler"]
    loss_nodes, slow_ranks = pick_targets(n_nodes, count, RANKS_PER_NODE)
    hosts_n = min(args.hosts, n_nodes)
    layout = {node_name(i): i % hosts_n for i in range(n_nodes)}
    per_host: list[dict[str, list[int]]] = [{} for _ in range(hosts_n)]
    for node, h in layout.items():
        i = int(node.rsplit("-", 1)[1])
        per_host[h][node] = list(range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE))

    tmp = tempfile.mkdtemp(prefix="cpb-", dir="/tmp")  # short: Ray's socket paths
    _start_ray(tmp)
    rec: dict[str, Any] = {"ranks": ranks, "nodes": n_nodes, "hosts": hosts_n, "policy": policy}
    rec["loadavg_before"] = os.getloadavg()
    try:
        hosts = [SimHost.remote(i, per_host[i], seed=1000 + i) for i in range(hosts_n)]
        ray.get([h.ready.remote() for h in hosts])
        sup = BenchSupervisor.remote(hosts, layout, health)
        t0 = time.time() + 1.0
        # Steps end half a poll interval after the polls (the run's start + whole seconds):
        # the mean phase, not the luckiest (a step seen by the poll right after its end).
        ray.get(
            [h.set_clock.remote(t0 + STEP_PHASE_S) for h in hosts] + [sup.start_generation.remote()]
        )
        host_cpu0 = ray.get([h.stats.remote() for h in hosts])
        machine0 = _machine_cpu()
        while time.time() < t0:
            time.sleep(0.01)
        until = t0 + args.seconds
        done_ref = sup.run.remote(until)
        injections = []
        for item in plan:
            at = t0 + item["at"]
            while time.time() < at:
                time.sleep(min(0.05, at - time.time()))
            i = item["index"]
            if item["kind"] == "straggler":
                rank = slow_ranks[i]
                host = hosts[layout[node_name(rank // RANKS_PER_NODE)]]
                step, start = ray.get(host.slow_down.remote(rank))
                injections.append(
                    {"kind": "straggler", "rank": rank, "from_step": step, "at": start}
                )
            else:
                node = node_name(loss_nodes[i])
                at = ray.get(hosts[layout[node]].silence.remote(node))
                injections.append({"kind": "node_loss", "node": node, "at": at})
            log(f"    t+{time.time() - t0:5.1f}s  injected {injections[-1]['kind']}")
        ready, _ = ray.wait([done_ref], timeout=max(0.0, until - time.time()) + args.grace)
        stopped = "finished"
        if not ready:
            sup.stop.remote()
            ready, _ = ray.wait([done_ref], timeout=5.0)
            stopped = "stopped" if ready else "killed (still busy)"
        snap = ray.get(sup.snapshot.remote(), timeout=60)
        host_cpu1 = ray.get([h.stats.remote() for h in hosts])
        machine1 = _machine_cpu()
        end = snap["ended_at"] or snap["now"]
        if not ready:
            ray.kill(sup)
        rec.update(
            summarize_run(
                snap, injections, t0, end, spec, span, host_cpu0, host_cpu1, machine0, machine1
            )
        )
        rec["run_end"] = stopped
        rec["loadavg_after"] = os.getloadavg()
        rec["injection_plan"] = plan
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


def summarize_run(
    snap: dict[str, Any],
    injections: list[dict[str, Any]],
    t0: float,
    end: float,
    spec: HealthSpec,
    span: int,
    host_cpu0: list[dict[str, Any]],
    host_cpu1: list[dict[str, Any]],
    machine0: tuple[float, float],
    machine1: tuple[float, float],
) -> dict[str, Any]:
    interval = spec.report_interval_s
    wall = end - snap["started_at"]
    # How long the loop had not polled when it ended (or when it was given up on).
    since_poll = (snap["ended_at"] or snap["now"]) - snap["last_poll"]
    lag = lag_summary(snap["lags"], t0, end, interval, since_poll)
    losses, slows = [], []
    for inj in injections:
        if inj["kind"] == "node_loss":
            found = snap["node_lost"].get(inj["node"])
            losses.append(None if found is None else found - inj["at"])
            inj["detected_at"] = found
        else:
            flag = snap["flagged"].get(inj["rank"], snap["flagged"].get(str(inj["rank"])))
            slows.append(None if flag is None else flag["at"] - inj["at"])
            inj["detected_at"] = flag and flag["at"]
            inj["verdict_through_step"] = flag and flag["through_step"]
            inj["score"] = flag and flag["score"]
    node_loss = detection_summary(losses, 2 * spec.heartbeat_timeout_s)
    straggler = None
    if spec.straggler.policy != "none":
        straggler = detection_summary(slows, 2 * span * STEP_S)
        straggler["steps"] = [None if x is None else x / STEP_S for x in slows]
        straggler["slow_steps_in_verdict"] = [
            None
            if inj.get("verdict_through_step") is None
            else inj["verdict_through_step"] - inj["from_step"] + 1
            for inj in injections
            if inj["kind"] == "straggler"
        ]
    its = snap["iterations"]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(its)]
    phases = ("poll_s", "ask_s", "ingest_s", "lost_nodes_s", "hang_s", "stragglers_s", "recover_s")
    breakdown = {k: statistics.fmean(it[k] for it in its) if its else None for k in phases}
    breakdown["poll_minus_ask_s"] = breakdown["poll_s"] - breakdown["ask_s"] if its else None
    beats = [it["beats"] for it in its]
    polled = sum(it.get("nodes", 0) for it in its)
    host_cpu = sum(b["cpu_s"] - a["cpu_s"] for a, b in zip(host_cpu0, host_cpu1, strict=True))
    busy = machine1[0] - machine0[0]
    total = machine1[1] - machine0[1]
    return {
        "wall_s": wall,
        "supervisor_cpu_pct_of_core": 100.0 * snap["cpu_s"] / wall if wall > 0 else None,
        "sim_hosts_cpu_pct_of_core": 100.0 * host_cpu / wall if wall > 0 else None,
        "machine_cpu_pct_of_all_cores": 100.0 * busy / total if total else None,
        "lag": lag,
        # ask -> the agent's answer: simulator queueing + Ray transit (not the supervisor's)
        "answer_s": {
            "p50": percentile([a for a in snap["answers"] if a == a], 50),
            "p99": percentile([a for a in snap["answers"] if a == a], 99),
            "max": max((a for a in snap["answers"] if a == a), default=None),
        },
        "poll_period": {
            "iterations": len(its),
            "p50_s": percentile(gaps, 50),
            "p99_s": percentile(gaps, 99),
            "max_s": max(gaps) if gaps else None,
        },
        "iteration_mean_s": breakdown,
        "iteration_max_s": {
            k: max((it[k] for it in its), default=None)
            for k in ("total_s", "poll_s", "ingest_s", "stragglers_s")
        },
        "reports_per_iteration_mean": statistics.fmean(it["reports"] for it in its)
        if its
        else None,
        "beats_ingested_per_iteration_mean": statistics.fmean(beats) if beats else None,
        # 1.0: every node is asked at every poll; 0.5: every second poll.
        "asks_per_node_per_poll": sum(it["asks"] for it in its) / polled if polled else None,
        "supervisor_at_end": {
            "phase": snap["phase"],
            "in_phase_for_s": snap["phase_for_s"],
        },
        "node_loss": node_loss,
        "straggler": straggler,
        "recoveries": snap["recoveries"],
        "injections": injections,
        # every loop iteration: start (s after the run's start) and where its time went
        "timeline": [
            {
                "t": round(it["t"] - t0, 2),
                **{
                    k: round(it[k], 4)
                    for k in ("total_s", "poll_s", "ingest_s", "stragglers_s", "cpu_s")
                },
                "reports": it["reports"],
                "asks": it["asks"],
                "flagged": it["flagged"],
            }
            for it in its
        ],
        "goal": goal_verdict(lag, node_loss, straggler),
    }


# --- the monitor alone, on synthetic input ------------------------------------------------------


def profile_monitor(ranks: int, with_cprofile: bool) -> dict[str, Any]:
    """Time HealthMonitor's per-interval work at `ranks` ranks in steady state (history full,
    32-step `recent` in every beat), without Ray: beat() per rank, lost_nodes(), hang(), and
    stragglers() with one fresh step; optionally cProfile one stragglers() call."""
    rng = random.Random(7)
    spec = HealthSpec.model_validate(HEALTH)
    m = HealthMonitor(spec)
    span = m.straggler_cfg.span
    nodes = ranks // RANKS_PER_NODE
    m.start_generation({r: (node_name(r // RANKS_PER_NODE), PID_BASE + r) for r in range(ranks)}, 0)
    for n in range(nodes):
        m.node_answered(node_name(n))
    steps = 4 * span + 1  # past the history trim
    # Build the history up to steady state: one beat per rank per step, the way reports do.
    rec = {r: deque(maxlen=RECENT_STEPS) for r in range(ranks)}

    def beats_for(step: int) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(ranks):
            rec[r].append((step - 1, COMPUTE_S * rng.lognormvariate(0, COMPUTE_SIGMA), STEP_S))
            out[r] = {
                "pid": PID_BASE + r,
                "step": step,
                "received_at": float(step),
                "collective_since": None,
                "gpu_index": r % RANKS_PER_NODE,
                "recent": list(rec[r]),
                "generation": 0,
            }
        return out

    for step in range(1, steps):
        for r, b in beats_for(step).items():
            m.beat(r, b)
    # A supervisor that keeps up has evaluated every step but the newest: one fresh step.
    # (Calling stragglers() here instead would evaluate up to `span` backlogged steps.)
    m._evaluated_through = steps - 2
    batch = beats_for(steps)
    t = time.perf_counter()
    for r, b in batch.items():
        m.beat(r, b)
    beat_s = time.perf_counter() - t
    t = time.perf_counter()
    m.lost_nodes(float(steps))
    lost_s = time.perf_counter() - t
    t = time.perf_counter()
    m.hang(float(steps))
    hang_s = time.perf_counter() - t
    t = time.perf_counter()
    report, _ = m.stragglers()
    strag_s = time.perf_counter() - t
    out: dict[str, Any] = {
        "ranks": ranks,
        "beat_us_per_rank": 1e6 * beat_s / ranks,
        "beat_all_ranks_s": beat_s,
        "lost_nodes_s": lost_s,
        "hang_s": hang_s,
        "stragglers_one_fresh_step_s": strag_s,
        "straggler_windows_evaluated": m.straggler_cfg.consecutive_windows,
        "stragglers_through_step": report.through_step,
    }
    if with_cprofile:
        # A backlog: five new common steps in one call (a loop that fell five steps behind).
        for k in range(1, 6):
            for r, b in beats_for(steps + k).items():
                m.beat(r, b)
        t = time.perf_counter()
        m.stragglers()
        out["stragglers_five_fresh_steps_s"] = time.perf_counter() - t
        # One step more, under the profiler.
        for r, b in beats_for(steps + 6).items():
            m.beat(r, b)
        prof = cProfile.Profile()
        prof.enable()
        m.stragglers()
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
        stats.print_stats(14)
        out["stragglers_cprofile_top"] = [
            line.rstrip() for line in buf.getvalue().splitlines() if line.strip()
        ][-16:]
    return out


# --- Ray's share: one report call per node --------------------------------------------------------


def ray_call_costs(n_nodes: int, n_hosts: int) -> dict[str, Any]:
    """What one report call per node costs the caller in Ray, without the monitor: `n_nodes`
    report(node) calls to SimHosts (every beat with a full 32-step `recent`), all answered,
    then ray.wait over them and ray.get of each (as ReportPoller.poll does) or of all at once.
    Also the hosts' answer rate (reports/s), to show what the simulators can serve."""
    tmp = tempfile.mkdtemp(prefix="cpr-", dir="/tmp")
    _start_ray(tmp)
    try:
        n_hosts = min(n_hosts, n_nodes)
        per_host: list[dict[str, list[int]]] = [{} for _ in range(n_hosts)]
        for i in range(n_nodes):
            per_host[i % n_hosts][node_name(i)] = list(
                range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE)
            )
        hosts = [SimHost.remote(i, per_host[i], seed=i) for i in range(n_hosts)]
        ray.get([h.set_clock.remote(time.time() - 2 * RECENT_STEPS * STEP_S) for h in hosts])
        names = [(hosts[i % n_hosts], node_name(i)) for i in range(n_nodes)]
        rounds = []
        for mode in ("warm-up", "per-ref get", "one get", "per-ref get", "one get"):
            t = time.perf_counter()
            refs = [h.report.remote(n) for h, n in names]
            ask_s = time.perf_counter() - t
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=120)
            answered_s = time.perf_counter() - t
            t = time.perf_counter()
            ray.wait(refs, num_returns=len(refs), timeout=0)
            wait_s = time.perf_counter() - t
            t = time.perf_counter()
            out = [ray.get(r) for r in refs] if mode != "one get" else ray.get(refs)
            get_s = time.perf_counter() - t
            rounds.append(
                {
                    "mode": mode,
                    "answered": len(ready),
                    "ask_us_per_call": 1e6 * ask_s / n_nodes,
                    "hosts_reports_per_s": len(ready) / answered_s,
                    "wait_all_ready_ms": 1e3 * wait_s,
                    "get_us_per_report": 1e6 * get_s / n_nodes,
                }
            )
        measured = rounds[1:]

        def mean(key: str, mode: str | None = None) -> float:
            return statistics.fmean(r[key] for r in measured if mode in (None, r["mode"]))

        return {
            "nodes": n_nodes,
            "hosts": n_hosts,
            "report_bytes": len(pickle.dumps(out[0])),
            "ask_us_per_call": mean("ask_us_per_call"),
            "get_us_per_report_per_ref": mean("get_us_per_report", "per-ref get"),
            "get_us_per_report_one_call": mean("get_us_per_report", "one get"),
            "wait_all_ready_ms": mean("wait_all_ready_ms"),
            "hosts_reports_per_s": mean("hosts_reports_per_s"),
            "rounds": rounds,
        }
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# --- output -------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _pair(a: float | None, b: float | None, conv: Any = _ms) -> str:
    return f"{conv(a)}/{conv(b)}"


def _det(d: dict[str, Any] | None) -> str:
    if d is None:
        return "off"
    s = f"{_fmt(d['p50_s'], '.1f')}/{_fmt(d['p99_s'], '.1f')} [{d['detected']}/{d['injected']}]"
    return s


def render(
    runs: list[dict[str, Any]],
    profiles: list[dict[str, Any]],
    costs: list[dict[str, Any]],
    findings: list[str],
) -> str:
    spec = HealthSpec.model_validate(HEALTH)
    st_cfg = spec.straggler
    span = st_cfg.window_steps * st_cfg.consecutive_windows
    lines = [
        "Control plane: simulated ranks (8 per node, 1 step/s, 1 beat/step) -> agents -> "
        "HealthMonitor + ReportPoller",
        f"report_interval_s={spec.report_interval_s}, heartbeat_timeout_s="
        f"{spec.heartbeat_timeout_s} (node-loss limit {2 * spec.heartbeat_timeout_s} s), "
        f"straggler threshold {st_cfg.threshold}, window {st_cfg.window_steps} x "
        f"{st_cfg.consecutive_windows} steps (limit {2 * span * STEP_S} s), injected "
        f"straggler {SLOW_FACTOR}x; CPU in % of one core",
        "",
        f"{'ranks':>6} {'nodes':>5} {'stragg':>6} {'sup':>4} {'lag p50/p99 ms':>14} "
        f"{'lag p50/p99 ms':>14} {'lag':>5} {'lag':>5} {'poll gap':>9} {'node loss s':>15} "
        f"{'straggler s':>15} {'steps':>9} {'goal':>5}",
        f"{'':>6} {'':>5} {'policy':>6} {'CPU':>4} {'first third':>14} {'last third':>14} "
        f"{'max s':>5} {'grows':>5} {'p50/max s':>9} {'p50/p99 [n/N]':>15} {'p50/p99 [n/N]':>15} "
        f"{'p50/p99':>9} {'held':>5}",
    ]
    for r in runs:
        if "error" in r:
            lines.append(
                f"{r['ranks']:>6} {r.get('nodes', '-'):>5} {r['policy']:>6}  error: {r['error']}"
            )
            continue
        lag, pp, st = r["lag"], r["poll_period"], r["straggler"]
        found_steps = [x for x in st["steps"] if x is not None] if st else []
        steps = (
            "-"
            if st is None
            else _pair(
                percentile(found_steps, 50),
                percentile(found_steps, 99),
                lambda v: _fmt(v, ".1f"),
            )
        )
        lines.append(
            f"{r['ranks']:>6} {r['nodes']:>5} {r['policy']:>6} "
            f"{_fmt(r['supervisor_cpu_pct_of_core'], '.0f'):>4} "
            f"{_pair(lag['first_third']['p50_s'], lag['first_third']['p99_s']):>14} "
            f"{_pair(lag['last_third']['p50_s'], lag['last_third']['p99_s']):>14} "
            f"{_fmt(lag['max_s'], '.1f'):>5} {_fmt(lag['grows']):>5} "
            f"{_pair(pp['p50_s'], pp['max_s'], lambda v: _fmt(v, '.1f')):>9} "
            f"{_det(r['node_loss']):>15} {_det(st):>15} {steps:>9} "
            f"{_fmt(r['goal']['held']):>5}"
        )
    lines += ["", "Where the supervisor's loop time goes (mean per iteration, ms):"]
    lines.append(
        f"{'ranks':>6} {'stragg':>6} {'iters':>5} {'asks/':>6} {'asks':>5} {'poll':>5} "
        f"{'ingest':>6} {'lost_':>6} {'hang':>5} {'strag-':>7} {'max':>6} {'hosts':>5} "
        f"{'mach-':>5} {'answer ms':>9}  end"
    )
    lines.append(
        f"{'':>6} {'policy':>6} {'':>5} {'node':>6} {'':>5} {'rest':>5} {'':>6} {'nodes':>6} "
        f"{'':>5} {'glers':>7} {'iter s':>6} {'CPU':>5} {'ine %':>5} {'p50/p99':>9}"
    )
    for r in runs:
        if "error" in r:
            continue
        b = r["iteration_mean_s"]
        lines.append(
            f"{r['ranks']:>6} {r['policy']:>6} {r['poll_period']['iterations']:>5} "
            f"{_fmt(r['asks_per_node_per_poll'], '.2f'):>6} "
            f"{_ms(b['ask_s']):>5} {_ms(b['poll_minus_ask_s']):>5} {_ms(b['ingest_s']):>6} "
            f"{_ms(b['lost_nodes_s']):>6} {_ms(b['hang_s']):>5} {_ms(b['stragglers_s']):>7} "
            f"{_fmt(r['iteration_max_s']['total_s'], '.1f'):>6} "
            f"{_fmt(r['sim_hosts_cpu_pct_of_core'], '.0f'):>5} "
            f"{_fmt(r['machine_cpu_pct_of_all_cores'], '.0f'):>5} "
            f"{_pair(r['answer_s']['p50'], r['answer_s']['p99']):>9}  {r['run_end']}"
            + (
                f", inside {r['supervisor_at_end']['phase']} for the last "
                f"{r['supervisor_at_end']['in_phase_for_s']:.0f} s"
                if r["run_end"] != "finished"
                else ""
            )
        )
    if profiles:
        lines += ["", "HealthMonitor alone, synthetic steady state (no Ray), one report interval:"]
        lines.append(
            f"{'ranks':>6} {'beat us/rank':>12} {'beat all s':>10} {'lost_nodes s':>12} "
            f"{'hang s':>7} {'stragglers() s, 1 fresh step':>29}"
        )
        for p in profiles:
            lines.append(
                f"{p['ranks']:>6} {p['beat_us_per_rank']:>12.1f} {p['beat_all_ranks_s']:>10.3f} "
                f"{p['lost_nodes_s']:>12.4f} {p['hang_s']:>7.3f} "
                f"{p['stragglers_one_fresh_step_s']:>29.3f}"
            )
        backlog = [p for p in profiles if "stragglers_five_fresh_steps_s" in p]
        for p in backlog:
            lines.append(
                f"stragglers() with a backlog of 5 fresh steps at {p['ranks']} ranks: "
                f"{p['stragglers_five_fresh_steps_s']:.3f} s "
                f"({p['stragglers_five_fresh_steps_s'] / p['stragglers_one_fresh_step_s']:.1f}x "
                "one step)"
            )
        fit = straggler_fit(profiles)
        if fit:
            lines.append(
                f"stragglers() grows as ranks^{fit['exponent']:.2f} ({fit['from']}..{fit['to']} "
                f"ranks); extrapolated: {fit['extrapolated_s']['16384']:.0f} s at 16384 ranks"
            )
    for c in costs:
        lines += [
            "",
            f"Ray, one report call per node ({c['nodes']} nodes, {c['hosts']} SimHosts, "
            f"{c['report_bytes']} B per pickled report): ask {c['ask_us_per_call']:.0f} us/call, "
            f"ray.get {c['get_us_per_report_per_ref']:.0f} us/report one by one (as "
            f"ReportPoller) vs {c['get_us_per_report_one_call']:.0f} in one call, ray.wait over "
            f"all {c['wait_all_ready_ms']:.0f} ms; hosts answer {c['hosts_reports_per_s']:.0f} "
            "reports/s",
        ]
    if findings:
        lines += ["", "Findings:"] + [f"- {f}" for f in findings]
    return "\n".join(lines)


def straggler_fit(profiles: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Power-law fit of stragglers()'s cost over the profiled sizes (first and last)."""
    if len(profiles) < 2:
        return None
    a, b = profiles[0], profiles[-1]
    ka, kb = a["stragglers_one_fresh_step_s"], b["stragglers_one_fresh_step_s"]
    if ka <= 0 or kb <= 0 or a["ranks"] == b["ranks"]:
        return None
    k = math.log(kb / ka) / math.log(b["ranks"] / a["ranks"])
    return {
        "exponent": k,
        "from": a["ranks"],
        "to": b["ranks"],
        "extrapolated_s": {str(n): kb * (n / b["ranks"]) ** k for n in DEFAULT_SIZES},
    }


def findings(
    runs: list[dict[str, Any]],
    profiles: list[dict[str, Any]],
    costs: list[dict[str, Any]],
    policy: str,
) -> list[str]:
    """What the figures say, in sentences built from them."""
    out = []
    ok = [r for r in runs if "error" not in r]
    for r in ok:
        if r["policy"] != policy:
            continue
        g, n = r["goal"], r["ranks"]
        if g["held"]:
            out.append(f"{n} ranks: goal held.")
            continue
        why = []
        if not g["lag_steady"]:
            lag = r["lag"]
            if lag["stuck_at_end"] or lag["last_third"]["n"] == 0:
                why.append(
                    f"the supervisor fell behind: {r['poll_period']['iterations']} polls in "
                    f"{r['wall_s']:.0f} s, none for the last "
                    f"{lag['since_last_poll_at_end_s']:.0f} s, no report taken in the last "
                    f"third (lag p99 {_fmt(lag['first_third']['p99_s'])} s in the first)"
                )
            else:
                why.append(
                    f"lag p99 rose from {_fmt(lag['first_third']['p99_s'])} s to "
                    f"{_fmt(lag['last_third']['p99_s'])} s"
                )
        for kind in ("node_loss", "straggler"):
            d = r[kind]
            if d is None or d["within_limit"]:
                continue
            why.append(
                f"{kind.replace('_', ' ')} detected {d['detected']}/{d['injected']}, p99 "
                f"{_fmt(d['p99_s'], '.1f')} s (limit {d['limit_s']:.0f} s)"
            )
        b = r["iteration_mean_s"]
        phases = {
            k: b[k] for k in ("ask_s", "poll_minus_ask_s", "ingest_s", "hang_s", "stragglers_s")
        }
        top = max(phases, key=lambda k: phases[k] or 0.0)
        why.append(
            f"largest mean share of a loop iteration: {top.removesuffix('_s')} "
            f"{_ms(phases[top])} ms; longest iteration "
            f"{_fmt(r['iteration_max_s']['total_s'], '.1f')} s "
            f"(stragglers() up to {_fmt(r['iteration_max_s']['stragglers_s'], '.1f')} s)"
        )
        out.append(f"{n} ranks: goal NOT held: " + "; ".join(why) + ".")
    fit = straggler_fit(profiles)
    if fit:
        pts = ", ".join(
            f"{p['stragglers_one_fresh_step_s']:.2f} s at {p['ranks']}" for p in profiles
        )
        backlog = [p for p in profiles if "stragglers_five_fresh_steps_s" in p]
        b0 = backlog[0] if backlog else {}
        more = (
            f" Five fresh steps in one call cost "
            f"{b0['stragglers_five_fresh_steps_s'] / b0['stragglers_one_fresh_step_s']:.1f}x "
            f"one (at {b0['ranks']} ranks): every fresh step is evaluated, so a loop "
            "that falls behind pays for each step it fell behind."
            if backlog
            else ""
        )
        out.append(
            f"HealthMonitor.stragglers() with one fresh step costs {pts} ranks: ranks^"
            f"{fit['exponent']:.2f}, about {fit['extrapolated_s']['16384']:.0f} s at 16384 "
            "(extrapolated)." + more
        )
    for r in ok:
        if r["policy"] == "none":
            b = r["iteration_mean_s"]
            out.append(
                f"{r['ranks']} ranks with straggler detection off: node loss p50/p99 "
                f"{_fmt(r['node_loss']['p50_s'], '.1f')}/{_fmt(r['node_loss']['p99_s'], '.1f')} s "
                f"[{r['node_loss']['detected']}/{r['node_loss']['injected']}], lag grows: "
                f"{_fmt(r['lag']['grows'])}, supervisor CPU "
                f"{_fmt(r['supervisor_cpu_pct_of_core'], '.0f')}% of a core, asks "
                f"{_ms(b['ask_s'])} ms + rest of poll {_ms(b['poll_minus_ask_s'])} ms + ingest "
                f"{_ms(b['ingest_s'])} ms per iteration; goal held: {_fmt(r['goal']['held'])}."
            )
    cadence = [r["asks_per_node_per_poll"] for r in ok if r.get("asks_per_node_per_poll")]
    if cadence:
        out.append(
            f"ReportPoller asked each node {min(cadence):.2f}-{max(cadence):.2f} times per poll "
            "(1.0 would be every poll): it takes the answers in hand, then asks every node "
            "without a request in flight; a node whose answer is not in yet is asked again "
            "only after it answers."
        )
    for c in costs:
        per_node = c["ask_us_per_call"] + c["get_us_per_report_per_ref"]
        out.append(
            f"Ray's cost per node and poll on this machine: {per_node:.0f} us (ask + ray.get), "
            f"i.e. {per_node * 2048 / 1e6:.2f} s of supervisor time per poll at 2048 nodes if "
            "every node were asked every poll."
        )
    return out


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="ranks")
    p.add_argument("--seconds", type=float, default=60.0, help="run length per size")
    p.add_argument("--hosts", type=int, default=2, help="SimHost processes (simulated agents)")
    p.add_argument("--injections", type=int, default=5, help="node losses and stragglers each")
    p.add_argument(
        "--grace",
        type=float,
        default=20.0,
        help="seconds a supervisor still busy after the run's end is given before it is stopped",
    )
    p.add_argument(
        "--straggler-policy",
        default="alert",
        choices=("alert", "replace", "none"),
        help="health.straggler.policy for the runs (alert: the default; detection runs)",
    )
    p.add_argument(
        "--diagnose-without-stragglers",
        type=int,
        nargs="*",
        default=[],
        metavar="RANKS",
        help="also run these sizes with straggler detection off (policy none): the rest of the "
        "path alone",
    )
    p.add_argument(
        "--profile-sizes",
        type=int,
        nargs="*",
        default=[1024, 2048, 4096],
        help="time HealthMonitor alone at these sizes (synthetic input, no Ray); the first is "
        "also profiled with cProfile",
    )
    p.add_argument(
        "--ray-cost-nodes",
        type=int,
        nargs="*",
        default=[2048],
        help="measure Ray's per-call cost of one report call per node at these node counts",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file for the figures")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 256 ranks, 40 s, 2 injections each, small profiles",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.seconds, args.injections = [256], 40.0, 2
        args.diagnose_without_stragglers, args.profile_sizes = [], [256]
        args.ray_cost_nodes = [32]
    for n in [*args.sizes, *args.diagnose_without_stragglers]:
        if n <= 0 or n % RANKS_PER_NODE:
            p.error(f"sizes must be positive multiples of {RANKS_PER_NODE}: {n}")
    if args.hosts < 1:
        p.error("--hosts must be >= 1")
    try:
        plan_injections(
            args.seconds,
            args.injections,
            STEP_S,
            HEALTH["heartbeat_timeout_s"],
            10,
            HEALTH["report_interval_s"],
        )
        for n in [*args.sizes, *args.diagnose_without_stragglers]:
            pick_targets(n // RANKS_PER_NODE, args.injections, RANKS_PER_NODE)
    except ValueError as e:
        p.error(str(e))
    return args


# The code this benchmark runs (the supervisor's side); a change to any of these mid-run
# means the sizes may have measured different code.
MEASURED_CODE = (
    "orchestrator/supervisor/monitor.py",
    "orchestrator/supervisor/poller.py",
    "orchestrator/spec.py",
    "health/liveness.py",
    "health/straggler.py",
    "health/observations.py",
)


def code_version() -> dict[str, Any]:
    """The commit checked out and a digest of each file of MEASURED_CODE as it is on disk."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    files = {}
    for rel in MEASURED_CODE:
        try:
            files[rel] = hashlib.sha256((REPO / rel).read_bytes()).hexdigest()[:16]
        except OSError:
            files[rel] = None
    return {"commit": commit, "files": files}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    load_before = os.getloadavg()
    code_before = code_version()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {msg}", flush=True)

    configs = [(n, args.straggler_policy) for n in args.sizes]
    configs += [(n, "none") for n in args.diagnose_without_stragglers]
    runs = []
    for ranks, policy in configs:
        log(f"{ranks} ranks, straggler policy {policy}, {args.seconds:.0f} s ...")
        try:
            rec = run_size(ranks, policy, args)
        except Exception as e:  # one size failing must not lose the others
            rec = {"ranks": ranks, "policy": policy, "error": f"{type(e).__name__}: {e}"}
        runs.append(rec)
        if "error" in rec:
            print(f"    error: {rec['error']}", flush=True)
        else:
            print(
                f"    {rec['run_end']}; supervisor CPU {rec['supervisor_cpu_pct_of_core']:.0f}% "
                f"of a core; node losses found {rec['node_loss']['detected']}/"
                f"{rec['node_loss']['injected']}; goal held: {rec['goal']['held']}",
                flush=True,
            )
    profiles = []
    for i, ranks in enumerate(args.profile_sizes):
        log(f"HealthMonitor alone at {ranks} ranks ...")
        profiles.append(profile_monitor(ranks, with_cprofile=i == 0))
    costs = []
    for n in args.ray_cost_nodes:
        log(f"Ray call costs at {n} nodes ...")
        costs.append(ray_call_costs(n, args.hosts))
    notes = findings(runs, profiles, costs, args.straggler_policy)
    code_after = code_version()
    changed = [f for f in MEASURED_CODE if code_before["files"][f] != code_after["files"][f]]
    if changed:
        notes.insert(
            0,
            f"WARNING: {', '.join(changed)} changed during the run (commit "
            f"{code_before['commit'][:10]} -> {code_after['commit'][:10]}); the sizes may have "
            "measured different code.",
        )
    text = render(runs, profiles, costs, notes)
    print()
    print(text)
    main_runs = [r for r in runs if r.get("policy") == args.straggler_policy]
    verdict = {str(r["ranks"]): (r["goal"]["held"] if "goal" in r else None) for r in main_runs}
    report = {
        "benchmark": "control_plane",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {
            "ranks_per_node": RANKS_PER_NODE,
            "step_s": STEP_S,
            "compute_s": COMPUTE_S,
            "compute_sigma": COMPUTE_SIGMA,
            "slow_factor": SLOW_FACTOR,
            "step_phase_s": STEP_PHASE_S,
            "recent_steps": RECENT_STEPS,
            "health": HEALTH,
        },
        "machine": {
            "nproc": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "ray": ray.__version__,
            "python": sys.version.split()[0],
        },
        "code": {"before": code_before, "after": code_after},
        "total_seconds": time.time() - started,
        "goal_held_by_size": verdict,
        "findings": notes,
        "runs": runs,
        "monitor_profile": profiles,
        "straggler_cost_fit": straggler_fit(profiles),
        "ray_call_costs": costs,
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(args.out, report)
    print(f"\nfigures: {args.out}  ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""stalwart's answer to every failure of a run, and what it costs.

Its decisions are the live supervisor's: each failure becomes the WorkerFailures its
detectors would report (health/observations.py), found after the time its detector takes
(the heartbeat timeout, the NVML probe, Ray's death notice, the hang timeout that
health/hang_timeout.py derives from the step time), and health/policy.py `decide` answers
them with the job's restart budget and its nodes' history (the flapping rule). A
replacement takes a warm spare node while one is ready (refilled after use) or waits for a
cold node; its ranks restore from a peer's copy, unless the node that held it was lost in
the same window (ckpt/replicas.py's groups), when the job falls back to durable storage.
A slow GPU is found by the supervisor's own HealthMonitor, fed the steps its rank and its
peers would report, and health/straggler.py `straggler_decision` moves it to a spare or
leaves it an alert (health.straggler.policy).
(The baselines, in the same model: baselines.py.)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from stalwart.ckpt.replicas import peers
from stalwart.health.cordon import first_usable
from stalwart.health.hang_timeout import HangPolicy, HangTimeouts, derive
from stalwart.health.observations import Budget, FailureKind, WorkerFailure
from stalwart.health.policy import Action, PolicyConfig, decide
from stalwart.health.straggler import straggler_decision
from stalwart.orchestrator.simulate.failures import Failure, Straggler
from stalwart.orchestrator.simulate.outcome import Outcome
from stalwart.orchestrator.simulate.scenario import Scenario
from stalwart.orchestrator.spec import HealthSpec
from stalwart.orchestrator.supervisor.monitor import HealthMonitor

KINDS = {
    "gpu": FailureKind.GPU_FATAL,
    "node": FailureKind.NODE_LOST,
    "network": FailureKind.NODE_LOST,
    "process": FailureKind.WORKER_DIED,
    "hang": FailureKind.HUNG,
    "numeric": FailureKind.LOSS_NOT_FINITE,
}
NODE_WIDE = {"node", "network"}  # every rank of the node goes with it


def hang_timeouts(sc: Scenario) -> HangTimeouts:
    c = sc.costs.stalwart
    if c.hang_timeout_s is not None:
        return HangTimeouts.fixed(c.hang_timeout_s)
    policy = HangPolicy(floor_s=c.hang_floor_s, factor=c.hang_factor)
    return derive(policy, sc.job.step_time_s, steps_seen=policy.min_steps)


# The ranks whose reports the straggler detector is fed: the slow one and its node's peers
# (its score is against the median of the others, which a larger job leaves the same).
MONITORED = 8


def straggler_found_s(sc: Scenario, rng: random.Random) -> float | None:
    """A slow GPU's onset to the supervisor's flag: its HealthMonitor (warm-up, windows,
    min_duration_s: health.straggler) fed the compute and step times its rank and its
    peers report, with 2 % noise; None when it never flags it (a slowdown under the
    threshold) within the episode."""
    spec = sc.costs.stalwart.straggler
    s = sc.failures.stragglers
    if spec.policy == "none":
        return None
    n = min(sc.cluster.gpus, MONITORED)
    if n < 2:
        return None
    monitor = HealthMonitor(HealthSpec(straggler=spec))
    monitor.start_generation({r: (f"node-{r}", r) for r in range(n)}, 0.0)
    step_s, slow_step_s = sc.job.step_time_s, sc.job.step_time_s * s.slowdown
    span = spec.window_steps * spec.consecutive_windows
    onset = spec.warmup_steps + span  # judged, healthy steps before it
    # A stationary score flags within a few spans and min_duration_s, or never does.
    slow_steps = min(
        4 * span + math.ceil(spec.min_duration_s / slow_step_s) + 1,
        math.ceil(s.duration_s / slow_step_s),
    )
    t = onset_t = 0.0
    for step in range(onset + slow_steps):
        slow = step >= onset
        if step == onset:
            onset_t = t
        wall = slow_step_s if slow else step_s
        t += wall
        for r in range(n):
            compute = (slow_step_s if slow and r == 0 else step_s) * (1 + rng.uniform(0, 0.02))
            monitor.beat(
                r, {"pid": r, "step": step, "received_at": t, "recent": [(step, compute, wall)]}
            )
        monitor.stragglers()
        if 0 in monitor.flagged_since:
            return t - onset_t
    return None


class Stalwart:
    """One run of stalwart's answers (state: the budget, the nodes' history, the spares)."""

    def __init__(self, sc: Scenario, seed: int, policy: PolicyConfig | None = None):
        self.sc, self.c = sc, sc.costs.stalwart
        self.policy = policy or PolicyConfig(
            flap_failures=self.c.flap_failures, flap_window_s=self.c.flap_window_s
        )
        self.hang_s = hang_timeouts(sc).step_s
        names = [f"node-{i}" for i in range(sc.cluster.nodes)]
        self.peers = peers(names, self.c.replicas)
        self.rng = random.Random(seed * 7919 + 1)
        self.out = Outcome(
            "stalwart",
            seed,
            sc.job.horizon_s,
            gpus=sc.cluster.gpus,
            idle_gpus=self.c.spares * sc.cluster.gpus_per_node,  # the spare nodes' GPUs
        )
        self._restarts = 0
        self._loss_steps: tuple[int, ...] = ()
        self._history: list[tuple[str, float]] = []
        # Each spare node and when it is (again) ready; a used one is replaced by a new one.
        self._spares = [(f"spare-{i}", 0.0) for i in range(self.c.spares)]
        self._made = self.c.spares
        self._cordoned: set[str] = set()
        self._lost_until: dict[str, float] = {}  # node -> until when its copies are gone
        # A slow GPU's onset to its flag (its own random numbers: the rest of a run is
        # the same with or without stragglers).
        self._found = (
            straggler_found_s(sc, random.Random(seed * 31 + 5))
            if sc.failures.stragglers.per_gpu_day > 0
            else None
        )

    def detection(self, kind: str) -> float:
        c = self.c
        return {
            "gpu": c.gpu_probe_s,
            "node": c.heartbeat_timeout_s,
            "network": c.heartbeat_timeout_s,
            "process": c.death_notice_s,
            "hang": self.hang_s,
            "numeric": self.sc.job.step_time_s,
        }[kind]

    def run(self, failures: Sequence[Failure], stragglers: Sequence[Straggler] = ()) -> Outcome:
        resume = 0.0  # when training last resumed
        persisted = 0.0  # the newest durable step's time
        events = sorted([*failures, *stragglers], key=lambda e: e.at)
        for e in events:
            at = max(e.at, resume)
            persisted = max(persisted, at - (at - persisted) % self.c.persist_every_s)
            if isinstance(e, Straggler):
                resume = max(resume, self._straggler(e, at, persisted))
                continue
            self.out.interruptions += 1
            resume = at + self._answer(e, at, persisted)
        self._steady(self.out)
        return self.out

    def _straggler(self, e: Straggler, at: float, persisted: float) -> float:
        """A slow GPU: flagged by the monitor, then moved to a spare or left to pace the
        job (the decision's); returns when training runs at its normal pace again."""
        s, c = self.sc.failures.stragglers, self.c
        self.out.stragglers += 1
        lasts = min(s.duration_s, self.out.horizon_s - at)
        found = self._found
        if found is None or found >= lasts:
            self.out.slow(lasts, s.slowdown)
            return at
        now = at + found
        node, rank = f"node-{e.node}", e.node * self.sc.cluster.gpus_per_node + e.gpu
        ready = (
            frozenset(name for name, ready_at in self._spares if ready_at <= now) - self._cordoned
        )
        budget = Budget(self._restarts, c.max_restarts, 0, 0, self._loss_steps, c.loss_rollbacks)
        decision, _why = straggler_decision(
            (rank,), c.straggler.policy, {rank: node}, ready, budget
        )
        if decision.action is not Action.REPLACE:
            self.out.slow(lasts, s.slowdown)
            return at
        self.out.slow(found, s.slowdown)
        self.out.stragglers_moved += 1
        self._restarts += 1
        self._cordoned.update(decision.cordon)
        took = self._new_node(now)
        self.out.lose("restart", took)
        restore, redone = self._restore(now, persisted, node, lost=False)
        return now + took + restore + redone

    def _answer(self, f: Failure, at: float, persisted: float) -> float:
        """The failure's cost, each part recorded; returns failure -> training again."""
        c, step_s = self.c, self.sc.job.step_time_s
        detect = self.detection(f.kind)
        now = at + detect
        node = f"node-{f.node}"
        first = f.node * self.sc.cluster.gpus_per_node
        ranks = (
            range(first, first + self.sc.cluster.gpus_per_node)
            if f.kind in NODE_WIDE
            else [first + f.gpu]
        )
        step = int(at / step_s)
        seen = [
            WorkerFailure(
                KINDS[f.kind],
                r,
                node,
                now,
                step=step,
                process_lost=f.kind in NODE_WIDE | {"process"},
            )
            for r in ranks
        ]
        budget = Budget(self._restarts, c.max_restarts, 0, 0, self._loss_steps, c.loss_rollbacks)
        decision, _why = decide(seen, budget, now, self.policy, self._history)
        self.out.lose("detection", detect)
        if decision.action is Action.FAIL:
            self.out.recoveries_s.append(detect + c.manual_restart_s + c.load_s)
            return detect + self._by_hand(at, persisted)
        self._restarts += 1
        self._history.append((node, now))
        self._cordoned.update(decision.cordon)
        if decision.action is Action.RESTART_GROUP:
            self._loss_steps += (step,)
            took = 0.0
        elif decision.cordon or f.kind in NODE_WIDE:
            took = self._new_node(now)  # the ranks move to another node
        else:
            took = c.replace_s
        self.out.lose("restart", min(took, c.replace_s))
        self.out.lose("cold_start", max(0.0, took - c.replace_s))
        restore, redone = self._restore(at, persisted, node, lost=f.kind in NODE_WIDE)
        self.out.recoveries_s.append(detect + took + restore)
        if f.kind in NODE_WIDE:  # its copies of its peers' shards are made again
            self._lost_until[node] = now + took + restore + (c.max_lag_steps + 1) * step_s
        return detect + took + restore + redone

    def _new_node(self, now: float) -> float:
        """The ranks' new node: the warm spare the supervisor would take (health/cordon.py
        `first_usable` among the ready ones), then started again, else a cold node."""
        ready = [i for i, (_, at) in enumerate(self._spares) if at <= now]
        pick = first_usable([self._spares[i][0] for i in ready], self._cordoned)
        if pick is not None:
            self._spares[ready[pick]] = (f"spare-{self._made}", now + self.c.spare_refill_s)
            self._made += 1
            return self.c.replace_s
        self.out.spare_exhausted += 1
        return self.c.cold_start_s

    def _restore(self, at: float, persisted: float, node: str, lost: bool) -> tuple[float, float]:
        """(restore, redone): from memory, the newest commit, up to max_lag_steps behind
        (the node's own memory when it is alive, else a peer's copy); from storage when
        every node holding copies of the lost node's shards lost them in this window."""
        c, step_s = self.c, self.sc.job.step_time_s
        holders = self.peers.get(node, [])
        if not lost or any(self._lost_until.get(p, -1.0) <= at for p in holders):
            restore, redone = c.restore_s, self.rng.uniform(0, c.max_lag_steps + 1) * step_s
        else:
            self.out.storage_fallbacks += 1
            restore, redone = c.load_s, at - persisted
        self.out.lose("restore", restore)
        self.out.redo(redone, step_s)
        return restore, redone

    def _by_hand(self, at: float, persisted: float) -> float:
        """The policy failed the job: restarted by hand from storage, budget anew."""
        c = self.c
        self.out.jobs_failed += 1
        self._restarts, self._loss_steps, self._history = 0, (), []
        redone = at - persisted
        self.out.lose("manual", c.manual_restart_s)
        self.out.lose("restore", c.load_s)
        self.out.redo(redone, self.sc.job.step_time_s)
        return c.manual_restart_s + c.load_s + redone

    def _steady(self, out: Outcome) -> None:
        """A snapshot every step: each step longer by step_overhead."""
        training = out.horizon_s - sum(out.lost.values())
        out.lose(
            "checkpoint", max(0.0, training) * self.c.step_overhead / (1 + self.c.step_overhead)
        )

"""Detection: the agents' reports -> observations (heartbeats, GPU readings) -> failures.

It polls the node agents (supervisor/poller.py), feeds the monitor (supervisor/monitor.py)
and runs the detectors of health/ on it: lost nodes, hangs (with every rank's stacks),
stragglers, slow links, GPU faults. It returns failures and never acts on them: deciding is
health.policy's, executing recovery's. A lost node is the one fact it spreads: every
collaborator that keeps state of the node forgets it at once (its slots go back too).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from stalwart.health.hang_timeout import HangTimeouts
from stalwart.health.lossy_link import LossConfig
from stalwart.health.observations import Budget, FailureKind, WorkerFailure
from stalwart.health.policy import Action
from stalwart.health.slow_link import LinkConfig
from stalwart.health.straggler import straggler_decision
from stalwart.orchestrator.agent.tcp_stats import TcpStats
from stalwart.orchestrator.observe.metrics import JobMetrics
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.links import LinkWatch
from stalwart.orchestrator.supervisor.losses import LossWatch
from stalwart.orchestrator.supervisor.monitor import HealthMonitor
from stalwart.orchestrator.supervisor.poller import ReportPoller
from stalwart.orchestrator.supervisor.pool import NODE_PING_TIMEOUT_S, ActorGone, WorkerPool
from stalwart.orchestrator.supervisor.ray_nodes import RayNodeTable
from stalwart.orchestrator.supervisor.raylet_probe import RayletProbe

if TYPE_CHECKING:
    from stalwart.orchestrator.supervisor.checkpoints import Checkpoints

RAY_NODES_CHECK_S = 1.0  # how often Ray's node table is read
STACKS_TIMEOUT_S = 3.0  # a worker answers for its own stacks within this...
DUMP_TIMEOUT_S = 15.0  # ...else its agent dumps them from outside (py-spy) within this


class Detection:
    def __init__(
        self,
        spec: JobSpec,
        pool: WorkerPool,
        checkpoints: Checkpoints,
        metrics: JobMetrics,
        emit: Callable[..., None],
        lock: threading.Lock,
    ):
        self.spec = spec
        self.pool = pool
        self.checkpoints = checkpoints
        self.metrics = metrics
        self._emit = emit
        self._lock = lock  # the actor's: progress() reads the beats from another thread
        self.monitor = HealthMonitor(spec.health)
        link = spec.health.slow_link
        self.links = LinkWatch(
            LinkConfig(link.threshold, link.window, link.consecutive_windows, link.min_excess_s),
            enabled=link.policy != "none",
        )
        # The supervisor's node counts its own connections' segments (its agent, if any,
        # reports the same ones).
        own = TcpStats()
        self.losses = LossWatch(
            LossConfig(
                link.loss_threshold,
                link.loss_min_segments,
                link.loss_window_s,
                link.consecutive_windows,
            ),
            enabled=link.policy != "none",
            own=(ray.get_runtime_context().get_node_id(), own.ip() or "", own.sample),
        )
        self.poller = ReportPoller(
            lambda node: pool.agents[node].report.remote(), self.monitor, self.links.round_trip
        )
        self.beats: dict[int, dict[str, Any]] = {}  # rank -> its newest heartbeat
        # The newest step any rank beat, in any generation: kept when ranks are replaced or
        # renumbered (a recovery that replaced every rank still knows how far they came).
        self.reached = 0
        self.flags: list[dict[str, Any]] = []  # every straggler flag, for the result
        self.link_flags: list[dict[str, Any]] = []  # every slow link flag, for the result
        self._straggling: set[int] = set()
        self.ray_nodes = RayNodeTable(RAY_NODES_CHECK_S)  # read off the control loop
        # A silent agent's node still up? (off the loop too, its addresses from the table)
        self.raylets = RayletProbe(self.ray_nodes.raylets)
        self._starved: set[str] = set()  # nodes told starved, once per spell
        self._isolated = False  # every node silent at once, told once per spell
        self._spell_s = 0.0  # how long every node has been silent, while they are
        self._hang_told: HangTimeouts | None = None  # the timeouts the last event gave

    # --- observations -----------------------------------------------------------------------

    def poll(self, generation: int, wait_s: float = 0.0) -> tuple[list[dict], list[WorkerFailure]]:
        """Ask every agent for its report; take the answers that are in (waiting up to
        `wait_s` for all). An agent that does not answer is not waited for: its silence
        is what node-loss detection measures. Returns the reports and the GPU failures
        their readings show."""
        pool = self.pool
        reports = self.poller.poll(list(pool.agents), wait_s)
        if (alive := self.ray_nodes.take()) is not None:
            self.monitor.ray_states(alive)
        failures: list[WorkerFailure] = []
        self.losses.absorb(reports)
        with self._lock:
            for rep in reports:
                for rank, beat in rep["beats"].items():
                    rank = int(rank)
                    if rank in pool.workers and beat["pid"] == pool.worker_info[rank]["pid"]:
                        self.beats[rank] = beat
                        self.reached = max(self.reached, beat.get("step") or 0)
                        if beat.get("generation") == generation:
                            self.monitor.beat(rank, beat)
                if rep["gpus"]:
                    # GPU gauges from NVML, or from the fake probe when the spec asks for it:
                    # `auto`'s stand-in on a CPU node has no GPU to read.
                    real = rep.get("gpu_probe") == "nvml" or self.spec.health.gpu.probe == "fake"
                    self.metrics.gpu_readings(rep["node"], rep["gpus"], gauges=real)
                    failures += self._judge_gpus(rep["node"], rep["gpus"])
        return reports, failures

    def start_generation(self, now: float) -> None:
        pool = self.pool
        self.monitor.start_generation(
            {r: (pool.worker_info[r]["node_id"], pool.worker_info[r]["pid"]) for r in pool.workers},
            now,
        )

    def current_beats(self, generation: int) -> list[dict[str, Any]]:
        """The newest heartbeat of every rank that has beaten in `generation`."""
        with self._lock:
            return [b for b in self.beats.values() if b.get("generation") == generation]

    def step_of(self, rank: int) -> int | None:
        return self.beats.get(rank, {}).get("step")

    def forget_rank(self, rank: int) -> None:
        self.beats.pop(rank, None)

    def renumbered(self) -> None:
        """Ranks were renumbered: old beats and answers in flight describe the old world."""
        self.beats.clear()
        self.poller.discard_in_flight()

    # --- lost nodes -------------------------------------------------------------------------

    def lost_nodes(self, now: float) -> tuple[list[str], str]:
        alone = self.monitor.isolated_for(now)
        if self._isolated and alone is None:
            # The link is back: a node still silent gets its own heartbeat timeout, from
            # as long after now as the spell lasted. Its connection resends what the cut
            # held back on TCP's retransmission backoff (each wait twice the last, from
            # 0.2 s), whose next try comes up to about the cut's length after the heal: an
            # 8 s cut had two nodes answer 3.2 s after the first, and with no grace they
            # were declared lost (a full run of the suite, 2026-12-07).
            self._isolated = False
            self.monitor.restart_silence(now, grace_s=self._spell_s)
            self._emit(
                "supervisor_reconnected",
                spell_s=round(self._spell_s, 1),
                reason="a node answered again; the others are waited for "
                f"{self._spell_s:.1f} s more than health.heartbeat_timeout_s",
            )
        if alone is not None:
            self._spell_s = alone
        self._probe_silent(now)
        lost, reason = self.monitor.lost_nodes(now)
        if alone is not None and not self._isolated and not lost:
            self._isolated = True
            self._emit("supervisor_isolated", seconds=round(alone, 1), reason=reason)
        return lost, reason

    def _probe_silent(self, now: float) -> None:
        """Agents silent for half their timeout get their node's raylet probed; a starved
        one (its node up: health/liveness.py starved) is told once per silence."""
        health = self.spec.health
        silent = self.monitor.silent_nodes(now, health.heartbeat_timeout_s / 2)
        self.raylets.watch(silent if health.starved_agent_timeout_s > 0 else ())
        if answered := self.raylets.take():
            self.monitor.raylet_answered(answered)
        self._starved &= set(silent)
        for node, seconds in self.monitor.starved_nodes(now):
            if node not in self._starved:
                self._starved.add(node)
                self._emit(
                    "agent_starved",
                    node=node,
                    seconds=round(seconds, 1),
                    reason=f"node {node[:12]}: agent silent for {seconds:.1f} s, past "
                    f"health.heartbeat_timeout_s={health.heartbeat_timeout_s:g}, but its "
                    "raylet accepts connections: the node is up and its agent slow to "
                    "answer (starved of CPU, or its connection resending after a cut); lost "
                    "only if it stays silent for "
                    f"health.starved_agent_timeout_s={health.starved_agent_timeout_s:g}",
                )

    def lose_node(self, node: str, reason: str, now: float) -> list[WorkerFailure]:
        """`node` is gone: everyone forgets it; its ranks' failures."""
        ranks = self.monitor.ranks_on(node)
        spares_lost = self.pool.lose_node(node)
        self.monitor.forget_node(node)
        self.metrics.forget_node(node)
        self.poller.forget(node)
        self.links.forget(node)
        self.losses.forget(node)
        self._emit("node_lost", node=node, ranks=ranks, spares_lost=spares_lost, reason=reason)
        self.checkpoints.forget_node(node)  # after: a write it drops names the loss
        return [
            WorkerFailure(
                FailureKind.NODE_LOST, rank, node, now, step=self.step_of(rank), message=reason
            )
            for rank in ranks
        ]

    def unresponsive(self, nodes: set[str]) -> list[str]:
        """Those of `nodes` whose agent died, or does not answer a ping within
        NODE_PING_TIMEOUT_S while its node's raylet does not accept a connection either (an
        agent starved of CPU on a live node is slow, not gone: raylet_probe.py)."""
        agents = self.pool.agents
        refs = {agents[n].ping.remote(): n for n in nodes if n in agents}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=NODE_PING_TIMEOUT_S)
        late = {n for ref, n in refs.items() if ref not in ready}
        if self.spec.health.starved_agent_timeout_s > 0:
            late -= self.raylets.up(late)
        dead = list(late)
        for ref in ready:
            try:
                ray.get(ref)
            except ActorGone:
                dead.append(refs[ref])
        return sorted(dead)

    # --- hangs ------------------------------------------------------------------------------

    def hang(self, now: float, generation: int) -> list[WorkerFailure] | None:
        """A hang (beating, not stepping) or a stuck collective: its ranks' failures, after
        every rank's stacks went to the event log. None when there is none."""
        self._tell_hang_timeout()
        hang, reason = self.monitor.hang(now)
        if hang is None:
            return None
        stacks = self._capture_stacks()
        self._emit(
            "hang",
            culprits=list(hang.culprits),
            waiting=list(hang.waiting),
            stalled_s=round(hang.stalled_for_s, 3),
            reason=reason,
        )
        self._emit("stacks", generation=generation, reason=reason, stacks=stacks)
        kind = FailureKind.HUNG if hang.culprits else FailureKind.COMM_ERROR
        return [
            WorkerFailure(
                kind,
                rank,
                self.pool.node_of(rank),
                now,
                step=self.step_of(rank),
                error_type="Hang" if hang.culprits else "StuckCollective",
                message=reason,
            )
            for rank in hang.culprits or hang.waiting
        ]

    def _tell_hang_timeout(self) -> None:
        """A `hang_timeout` event when the step timeout in use first comes to be and each
        time it moves by a tenth or more (derived: it follows the job's longest step)."""
        t = self.monitor.hang_timeouts()
        told = self._hang_told
        if (
            told is None
            or t.derived != told.derived
            or abs(t.step_s - told.step_s) >= 0.1 * told.step_s
        ):
            self._hang_told = t
            self._emit(
                "hang_timeout",
                seconds=round(t.step_s, 3),
                first_step_s=t.startup_s,
                busy_limit_s=t.busy_limit_s,
                reason=t.why,
            )

    def _capture_stacks(self) -> dict[int, dict[str, Any]]:
        """Every rank's Python stacks: asked of the worker (another of its threads answers);
        a worker that cannot answer is dumped from outside by its node's agent (py-spy)."""
        pool = self.pool
        refs = {pool.workers[r].stacks.remote(): r for r in pool.workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STACKS_TIMEOUT_S)
        out: dict[int, dict[str, Any]] = {}
        for ref in ready:
            with contextlib.suppress(*ActorGone):
                out[refs[ref]] = ray.get(ref)
        dumps = {}
        for rank in [r for r in pool.workers if r not in out]:
            info = pool.worker_info[rank]
            agent = pool.agents.get(info["node_id"])
            if agent is not None:
                dumps[agent.dump_stacks.remote(info["pid"])] = rank
        if dumps:
            ready, _ = ray.wait(list(dumps), num_returns=len(dumps), timeout=DUMP_TIMEOUT_S)
            for ref in ready:
                out[dumps[ref]] = {"rank": dumps[ref], **ray.get(ref)}
        for rank in pool.workers:
            out.setdefault(rank, {"rank": rank, "via": None, "text": "no stack: no answer"})
        return out

    # --- stragglers -------------------------------------------------------------------------

    def stragglers(self, now: float, budget: Budget) -> list[WorkerFailure]:
        """New and cleared straggler flags (events; flags kept for the result) and, when
        health.straggler.policy replaces them, the flagged ranks' failures."""
        monitor = self.monitor
        report, reason = monitor.stragglers()
        flagged = set(monitor.flagged_since)  # flags clear only after a calm span
        for rank in sorted(self._straggling - flagged):
            self._emit("straggler_cleared", rank=rank, score=report.scores.get(rank))
        new = sorted(flagged - self._straggling)
        self._straggling = flagged
        if not new:
            return []
        pool = self.pool
        node_of = {r: pool.node_of(r) for r in pool.workers}
        decision, action_reason = straggler_decision(
            tuple(new), self.spec.health.straggler.policy, node_of, pool.spare_nodes(), budget
        )
        for rank in new:
            since = monitor.flagged_since.get(rank, report.through_step)
            flag = {
                "rank": rank,
                "node": node_of[rank],
                "score": report.scores.get(rank),
                "through_step": since,  # the first step whose data supported the flag
                "rank_step": self.step_of(rank),
                # the job's rate over the steps the verdict covers
                "steps_per_s": monitor.steps_per_s(since, monitor.straggler_cfg.span),
                "at": now,
                "action": decision.action.value,
            }
            self.flags.append(flag)
            self._emit(
                "straggler", **flag, scores=report.scores, reason=reason, decision=action_reason
            )
        if decision.action is not Action.REPLACE:
            return []
        return [
            WorkerFailure(
                FailureKind.STRAGGLER,
                rank,
                node_of[rank],
                now,
                step=self.step_of(rank),
                error_type="Straggler",
                message=reason,
            )
            for rank in decision.ranks
        ]

    # --- slow links -------------------------------------------------------------------------

    def slow_links(self, now: float) -> None:
        """New and cleared slow link flags: events, a flag kept for the result, and every
        node's round trip and share of segments sent again as gauges. Never a failure
        (health/slow_link.py, health/lossy_link.py)."""
        self._lossy_links(now)
        verdict = self.links.judge(now)
        if verdict is None:
            return
        new, cleared, reason = verdict
        report = self.links.report
        self.metrics.link_round_trips(report.rtt_s)
        for node in cleared:
            self._emit(
                "slow_link_cleared", node=node, signal="round_trip", rtt_s=report.rtt_s.get(node)
            )
        for node in new:
            others = [v for n, v in report.rtt_s.items() if n != node]
            flag = {
                "node": node,
                "signal": "round_trip",
                "ranks": self.monitor.ranks_on(node),
                "rtt_s": report.rtt_s[node],
                "peers_rtt_s": round(statistics.median(others), 4) if others else None,
                "score": report.scores[node],
                "at": now,
            }
            self._flag_link(flag, reason)

    def _lossy_links(self, now: float) -> None:
        verdict = self.losses.judge(now)
        if verdict is None:
            return
        new, cleared, reason = verdict
        rates = self.losses.last.node_rates
        self.metrics.link_losses(self.losses.sent_again)
        for node in cleared:
            self._emit("slow_link_cleared", node=node, signal="loss", loss=rates.get(node))
        for node in new:
            flag = {
                "node": node,
                "signal": "loss",
                "ranks": self.monitor.ranks_on(node),
                "loss": rates.get(node),
                # On the links between its peers (health/lossy_link.py).
                "peers_loss": self.losses.last.rest_rates.get(node),
                "at": now,
            }
            self._flag_link(flag, reason)

    def _flag_link(self, flag: dict[str, Any], reason: str) -> None:
        """A slow link flag (either signal): kept for the result, and its event."""
        self.link_flags.append(flag)
        self._emit(
            "slow_link",
            **flag,
            reason=reason,
            decision="alert only: the node's ranks compute as fast as their peers, and "
            "moving them would not move its link (health.slow_link)",
        )

    # --- GPUs -------------------------------------------------------------------------------

    def _judge_gpus(self, node: str, gpus: list[dict[str, Any]]) -> list[WorkerFailure]:
        verdict, _reason = self.monitor.gpu_readings(node, gpus)
        now = time.time()
        out = []
        for (gnode, index), why in verdict.info.items():
            self._emit("gpu_note", node=gnode, gpu=index, reason=why)
        for (gnode, index), why in verdict.fatal.items():
            ranks = self.monitor.ranks_on(gnode)
            self._emit("gpu_fatal", node=gnode, gpu=index, ranks=ranks, reason=why)
            out += [WorkerFailure(FailureKind.GPU_FATAL, r, gnode, now, message=why) for r in ranks]
        for (gnode, index), why in verdict.application.items():
            ranks = self.monitor.ranks_on_gpu(gnode, index)
            self._emit("gpu_error", node=gnode, gpu=index, ranks=ranks, reason=why)
            out += [WorkerFailure(FailureKind.GPU_ERROR, r, gnode, now, message=why) for r in ranks]
        return out

"""The health monitor: turns agent reports into the observations health/ detectors read.

It keeps, per node, when its agent last answered and what Ray says of it; per rank, its
latest heartbeat, when its step last moved and its recent compute times; per GPU, the
readings. The supervisor feeds it and asks it; the detectors and policies in health/
decide. Nothing here acts.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from stalwart.health.hang_timeout import HangPolicy, HangTimeouts, derive
from stalwart.health.liveness import (
    Hang,
    hung_ranks,
    isolated_for,
    lost_nodes,
    starved_nodes,
)
from stalwart.health.observations import NodeView, RankView
from stalwart.health.straggler import StragglerConfig, StragglerReport, straggler_scores
from stalwart.health.xid import GpuReading, GpuVerdict, judge_gpus
from stalwart.orchestrator.spec import HealthSpec


@dataclass
class _Rank:
    node: str
    pid: int
    step: int = 0
    step_changed_at: float = 0.0
    beat_at: float = 0.0
    collective_since: float | None = None
    copies_since: float | None = None
    gpu_index: int | None = None
    stepped: bool = False  # finished a step in this generation
    # (received at, its training thread's CPU seconds), the last BUSY_WINDOW_S or so
    cpu: deque = field(default_factory=lambda: deque(maxlen=256))

    def busy(self) -> bool:
        """Its training thread used at least BUSY_SHARE of a core over the last
        BUSY_WINDOW_S of heartbeats (at least 2 s of them)."""
        if len(self.cpu) < 2:
            return False
        newest_at, newest_cpu = self.cpu[-1]
        older = [(t, c) for t, c in self.cpu if newest_at - t <= BUSY_WINDOW_S]
        at, cpu = older[0]
        if newest_at - at < 2.0:
            return False
        return (newest_cpu - cpu) / (newest_at - at) >= BUSY_SHARE


# A rank past its derived step timeout is busy, not hung, while its training thread uses at
# least this share of a core (health/hang_timeout.py).
BUSY_WINDOW_S = 10.0
BUSY_SHARE = 0.25


class HealthMonitor:
    def __init__(self, health: HealthSpec):
        self.cfg = health
        s = health.straggler
        self.straggler_cfg = StragglerConfig(
            s.threshold,
            s.window_steps,
            s.consecutive_windows,
            s.min_excess_s,
            s.warmup_steps,
            s.min_duration_s,
        )
        self.nodes: dict[str, NodeView] = {}
        self.ranks: dict[int, _Rank] = {}
        self.history: dict[int, dict[int, float]] = {}  # rank -> step -> compute seconds
        self.wall: dict[int, dict[int, float]] = {}  # rank -> step -> step cycle seconds
        self.gpus: dict[tuple[str, int], GpuReading] = {}
        self._ecc_base: dict[tuple[str, int], int] = {}
        # (severity, (node, gpu)) -> the finding last reported, so a lasting one is news once
        self._notes: dict[tuple[str, tuple[str, int]], str] = {}
        self.last_scores: dict[int, float] = {}  # latest straggler score per rank
        self._evaluated_through: int | None = None  # newest step the straggler verdict saw
        self._verdict: tuple[StragglerReport, str] = (StragglerReport(), "no steps yet")
        self.flagged_since: dict[int, int] = {}  # rank -> first step its flag rests on
        self._calm: dict[int, int] = {}  # flagged rank -> evaluated steps since its last flag
        self._judge_from: int | None = None  # the generation's first step + warm-up
        self._slow_s: dict[int, float] = {}  # rank -> seconds of steps its slow verdicts span
        # The job's steps, for the derived hang timeout (all generations; each one's first
        # step, which compiles and restores, left out).
        self.hang_policy = HangPolicy(**health.hang.model_dump())
        self.longest_step_s: float | None = None
        self.steps_seen = 0
        self._newest_seen = -1

    # --- nodes ------------------------------------------------------------------------------

    def forget_node(self, node: str) -> None:
        self.nodes.pop(node, None)

    def node_asked(self, node: str, now: float) -> None:
        """A report request went to `node`'s agent (watched once it first answered)."""
        v = self.nodes.get(node)
        if v is not None and v.unanswered_since is None:
            self.nodes[node] = replace(v, unanswered_since=now)

    def node_answered(self, node: str) -> None:
        v = self.nodes.get(node)
        self.nodes[node] = replace(v, unanswered_since=None) if v else NodeView(node)

    def agent_died(self, node: str) -> None:
        if node in self.nodes:
            self.nodes[node] = replace(self.nodes[node], agent_dead=True)

    def ray_states(self, alive: dict[str, bool]) -> None:
        for node, v in list(self.nodes.items()):
            if node in alive and alive[node] != v.ray_alive:
                self.nodes[node] = replace(v, ray_alive=alive[node])

    def raylet_answered(self, answered: dict[str, float]) -> None:
        """node -> when a connection its raylet accepted was begun (raylet_probe.py)."""
        for node, at in answered.items():
            v = self.nodes.get(node)
            if v is not None and (v.raylet_answered_at or 0.0) < at:
                self.nodes[node] = replace(v, raylet_answered_at=at)

    def silent_nodes(self, now: float, for_s: float) -> list[str]:
        """Nodes whose agent has left a request unanswered for `for_s` or longer."""
        return [
            node
            for node, v in self.nodes.items()
            if v.unanswered_since is not None and now - v.unanswered_since >= for_s
        ]

    def starved_nodes(self, now: float) -> list[tuple[str, float]]:
        return starved_nodes(
            list(self.nodes.values()),
            now,
            self.cfg.heartbeat_timeout_s,
            self.cfg.starved_agent_timeout_s,
        )

    def lost_nodes(self, now: float) -> tuple[list[str], str]:
        return lost_nodes(
            list(self.nodes.values()),
            now,
            self.cfg.heartbeat_timeout_s,
            self.cfg.isolated_timeout_s,
            self.cfg.starved_agent_timeout_s,
        )

    def restart_silence(self, now: float, grace_s: float = 0.0) -> None:
        """Every node still waited on counts its silence from `grace_s` after `now`."""
        for node, v in list(self.nodes.items()):
            if v.unanswered_since is not None:
                self.nodes[node] = replace(v, unanswered_since=now + grace_s)

    def isolated_for(self, now: float) -> float | None:
        return isolated_for(list(self.nodes.values()), now, self.cfg.heartbeat_timeout_s)

    # --- ranks ------------------------------------------------------------------------------

    def start_generation(self, ranks: dict[int, tuple[str, int]], now: float) -> None:
        """`ranks`: rank -> (node, pid) of the generation about to run."""
        self.ranks = {r: _Rank(node, pid, 0, now, now) for r, (node, pid) in ranks.items()}
        self.history = {r: {} for r in ranks}
        self.wall = {r: {} for r in ranks}
        self.last_scores = {}
        self._evaluated_through: int | None = None
        self._verdict: tuple[StragglerReport, str] = (StragglerReport(), "no steps yet")
        self.flagged_since: dict[int, int] = {}  # rank -> first step its flag rests on
        self._calm: dict[int, int] = {}  # flagged rank -> evaluated steps since its last flag
        self._judge_from = None
        self._slow_s = {}

    def beat(self, rank: int, beat: dict[str, Any]) -> None:
        r = self.ranks.get(rank)
        if r is None or beat.get("pid") != r.pid:
            return  # a replaced process's late heartbeat
        if beat["step"] != r.step:
            r.step, r.step_changed_at = beat["step"], beat["received_at"]
        r.beat_at = beat["received_at"]
        r.collective_since = beat.get("collective_since")
        r.copies_since = beat.get("copies_since")
        r.gpu_index = beat.get("gpu_index")
        if beat.get("train_cpu_s") is not None:
            r.cpu.append((beat["received_at"], beat["train_cpu_s"]))
            while beat["received_at"] - r.cpu[0][0] > 2 * BUSY_WINDOW_S:
                r.cpu.popleft()
        h, w = self.history[rank], self.wall[rank]
        recent = beat.get("recent", ())
        if recent:
            self._note_steps(r, recent, w)
        if recent and self._judge_from is None:
            # The generation's first step (every rank starts at the same one) opens the
            # warm-up; its steps are recorded but not judged.
            self._judge_from = min(s for s, _, _ in recent) + self.straggler_cfg.warmup_steps
        for step, compute, wall in recent:
            h[step], w[step] = compute, wall
        keep = 4 * self.straggler_cfg.span
        if len(h) > keep:
            for step in sorted(h)[:-keep]:
                del h[step]
                w.pop(step, None)

    def _note_steps(self, r: _Rank, recent: Any, seen: dict[int, float]) -> None:
        """The job's longest step and its count, from steps not seen before (a
        generation's first left out: the worker clears `recent` at each generation)."""
        first = not r.stepped
        r.stepped = True
        for i, (step, _, wall) in enumerate(recent):
            if (first and i == 0) or step in seen:
                continue
            if self.longest_step_s is None or wall > self.longest_step_s:
                self.longest_step_s = wall
            if step > self._newest_seen:
                self._newest_seen = step
                self.steps_seen += 1

    def hang_timeouts(self) -> HangTimeouts:
        """The timeouts in use: health.hang_timeout_s, else derived from the job's steps."""
        if self.cfg.hang_timeout_s is not None:
            return HangTimeouts.fixed(self.cfg.hang_timeout_s)
        return derive(self.hang_policy, self.longest_step_s, self.steps_seen)

    def rank_views(self) -> list[RankView]:
        return [
            RankView(
                rank,
                r.node,
                r.step,
                r.step_changed_at,
                r.beat_at,
                r.collective_since,
                r.copies_since,
                r.stepped,
                r.busy(),
            )
            for rank, r in self.ranks.items()
        ]

    def hang(self, now: float) -> tuple[Hang | None, str]:
        return hung_ranks(
            self.rank_views(), now, self.hang_timeouts(), self.cfg.heartbeat_timeout_s
        )

    def stragglers(self) -> tuple[StragglerReport, str]:
        """The straggler verdict as of the newest step every rank has reported.

        Every step that became common since the last call is evaluated, oldest first, so
        `flagged_since[rank]` is the first step whose data supported the rank's flag,
        however many steps one report delivered at once. With no new step, the previous
        verdict stands (a quiet poll is not a recovery)."""
        if self.cfg.straggler.policy == "none":
            return StragglerReport(), "straggler detection off (health.straggler.policy=none)"
        if len(self.history) < 2:
            return StragglerReport(), "fewer than two ranks: nothing to compare"
        common = sorted(set.intersection(*(set(h) for h in self.history.values())))
        if self._judge_from is not None:
            common = [t for t in common if t >= self._judge_from]
        fresh = [
            t for t in common if self._evaluated_through is None or t > self._evaluated_through
        ]
        if not fresh:
            if self._evaluated_through is None and self._judge_from is not None:
                return StragglerReport(), (
                    f"warm-up: steps before {self._judge_from} are not judged "
                    f"(health.straggler.warmup_steps={self.straggler_cfg.warmup_steps})"
                )
            return self._verdict
        span = self.straggler_cfg.span
        # A backlog (a slow call, a report carrying many steps) is judged over its newest two
        # spans of steps only, so one call's cost stays bounded and cannot feed on itself.
        for t in fresh[-2 * span :]:
            # Only the span of common steps ending at t matters to the verdict at t.
            window = [s for s in common if s <= t][-span:]
            upto = {r: {s: h[s] for s in window} for r, h in self.history.items()}
            report, reason = straggler_scores(upto, self.straggler_cfg)
            for rank in report.flagged:
                # A flag needs evidence spanning min_duration_s of steps, not only the
                # windows' step count: a burst of fast steps can be slow for a moment.
                if rank in self._slow_s:
                    self._slow_s[rank] += self._step_s(t)
                else:
                    self._slow_s[rank] = sum(self._step_s(s) for s in window)
                if self._slow_s[rank] >= self.straggler_cfg.min_duration_s:
                    self.flagged_since.setdefault(rank, t)
                self._calm.pop(rank, None)
            for rank in [r for r in self._slow_s if r not in report.flagged]:
                del self._slow_s[rank]
            # A flag clears only after a full span of steps without it: a straggler whose
            # score hovers at the threshold is one alert, not a flapping one.
            for rank in [r for r in self.flagged_since if r not in report.flagged]:
                self._calm[rank] = self._calm.get(rank, 0) + 1
                if self._calm[rank] >= span:
                    del self.flagged_since[rank], self._calm[rank]
        self._evaluated_through = fresh[-1]
        if report.scores:
            self.last_scores = dict(report.scores)
        self._verdict = (report, reason)
        return report, reason

    def _step_s(self, step: int) -> float:
        """The job's wall time of `step` (median over the ranks that reported it)."""
        times = [w[step] for w in self.wall.values() if step in w]
        return statistics.median(times) if times else 0.0

    def steps_per_s(self, through_step: int, steps: int) -> float | None:
        """The job's rate over the `steps` steps ending at `through_step` (median step time
        over ranks and steps)."""
        times = [
            t
            for w in self.wall.values()
            for s, t in w.items()
            if through_step - steps < s <= through_step
        ]
        return round(1 / statistics.median(times), 3) if times else None

    def rank_step_times(self, after_step: int, through_step: int) -> dict[int, float]:
        """rank -> its median compute seconds over the steps in (after_step, through_step]
        (ranks with no step there are left out): the per-rank picture of a time window."""
        out = {}
        for rank, h in self.history.items():
            times = [t for s, t in h.items() if after_step < s <= through_step]
            if times:
                out[rank] = round(statistics.median(times), 6)
        return out

    def ranks_on(self, node: str) -> list[int]:
        return sorted(r for r, v in self.ranks.items() if v.node == node)

    def ranks_on_gpu(self, node: str, index: int) -> list[int]:
        return sorted(r for r, v in self.ranks.items() if v.node == node and v.gpu_index == index)

    # --- GPUs -------------------------------------------------------------------------------

    def gpu_readings(self, node: str, gpus: list[dict[str, Any]]) -> tuple[GpuVerdict, str]:
        """Judge one report's readings. A finding is reported when it appears (or changes),
        not on every report while it lasts (a lost GPU stays lost); once a GPU reads clean
        again, the same finding is news again."""
        readings = [GpuReading(**{**g, "xids": tuple(g["xids"])}) for g in gpus]
        for r in readings:
            key = (r.node, r.index)
            self._ecc_base.setdefault(key, r.ecc_uncorrected)
            self.gpus[key] = r
        verdict, reason = judge_gpus(readings, self._ecc_base, self.cfg.gpu.max_temperature_c)
        buckets = {"fatal": verdict.fatal, "application": verdict.application, "info": verdict.info}
        fresh: dict[str, dict[tuple[str, int], str]] = {}
        for name, bucket in buckets.items():
            fresh[name] = {k: v for k, v in bucket.items() if self._notes.get((name, k)) != v}
            self._notes.update({(name, k): v for k, v in bucket.items()})
            for r in readings:
                if (r.node, r.index) not in bucket:
                    self._notes.pop((name, (r.node, r.index)), None)
        # A fatal ECC rise is reported once: the new count becomes the base.
        for key in verdict.fatal:
            self._ecc_base[key] = self.gpus[key].ecc_uncorrected
        return GpuVerdict(fresh["fatal"], fresh["application"], fresh["info"]), reason

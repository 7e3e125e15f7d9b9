"""The peer tier seen from the supervisor: which nodes copy which (ckpt/replicas.py), how far
apart the copies are (the stride), and getting a stalled commit going again.

Agents send each new shard to their peers by themselves (agent/replication.py). With
checkpoint.max_lag_steps (the default) the stride is fixed by the bound (ckpt/replicas.py
`bounded_stride`), every shard on its grid is sent and the ranks wait for their copies
(worker/copy_wait.py): the commit cannot fall further behind, and a commit that does not
move (a stalled link: the ranks wait) is only reported. Without a bound the stride
follows the measured cost of a round of copies, and when the sending falls behind and each
rank's copies are of a different step, nothing commits: the plan then names the newest step
every rank holds in its own node's memory, which every agent sends next, and says so in an
event when the commit stays behind for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stalwart.ckpt.commit import with_copies
from stalwart.ckpt.replicas import bounded_stride, choose_stride
from stalwart.ckpt.replicas import effective as effective_copies
from stalwart.ckpt.replicas import groups as replica_groups
from stalwart.ckpt.replicas import peers as replica_peers
from stalwart.orchestrator.spec import CheckpointSpec
from stalwart.orchestrator.supervisor.pool import WorkerPool

REPLICATE_PER_S = 4.0  # copies to peers at most this often (thinned to a grid of steps)
REPLICATION_ALIGN_S = 1.0  # no commit for this long: name the step every agent sends
REPLICATION_STALL_S = 30.0  # no commit for this long: an event says so (again every 30 s)
WAIT_EVENT_S = 1.0  # training held this long for copies since the last event: a new one
WAIT_EVENT_EVERY_S = 30.0  # at most this often


class ReplicaPlan:
    def __init__(
        self,
        spec: CheckpointSpec,
        pool: WorkerPool,
        emit: Callable[..., None],
        clock: Callable[[], float] = time.time,
    ):
        self.spec = spec
        self._clock = clock
        self.pool = pool
        self._emit = emit
        self.copies = 1  # copies of each shard the plan keeps (fewer nodes than replicas)
        self.nodes: tuple[str, ...] = ()  # the live nodes the plan is made of
        # node -> signatures of the DTensor shards its ranks hold (agents report them): the
        # placement keeps nodes holding the same shard (HSDP's replicas) in other groups.
        self.holds: dict[str, frozenset[str]] = {}
        self._planned_holds: dict[str, frozenset[str]] = {}
        # steps apart of the copies sent; with a bound, fixed by it (and all of them sent)
        self.bounded = spec.max_lag_steps is not None
        self.stride = (
            bounded_stride(spec.every_steps, spec.max_lag_steps)
            if spec.max_lag_steps is not None
            else spec.every_steps
        )
        self.steady_rate: float | None = None  # steps/s, median of the last 10 steps
        self.replicating: tuple[int, float] | None = None  # (step asked for, when)
        self._send_mark: dict[str, tuple[float, int]] = {}  # node -> (send seconds, rounds)
        self._round_s: float | None = None  # the last measured cost of a round of copies
        self._commit_seen: tuple[int | None, float] = (None, clock())  # (step, since)
        # Since when a step newer than the commit was in every rank's memory: the stall
        # counts from then (not from the job's start, before any step could be copied).
        self._copyable_since: float | None = None
        self.required: int | None = None  # a step asked to commit (chaos after_commit)
        self._stall_reported = 0.0
        self._waits_reported = (0.0, float("-inf"))  # (seconds waited, when) at the last event

    def sync(self) -> None:
        """Tell every agent its replica-group peers when the set of live nodes changed."""
        pool = self.pool
        nodes = tuple(sorted(n for n in pool.agents if n not in pool.bad.lost))
        holds = {n: self.holds[n] for n in nodes if self.holds.get(n)}
        if nodes == self.nodes and holds == self._planned_holds:
            return
        self.nodes, self._planned_holds = nodes, holds
        wanted = self.spec.replicas
        plan = replica_peers(nodes, wanted, holds)
        self.copies = max(1, effective_copies(nodes, wanted))
        for node, others in plan.items():
            pool.agents[node].set_stride.remote(self.stride, self.bounded)
            pool.agents[node].set_peers.remote({n: pool.agents[n] for n in others})
        self.replicating = None  # a step asked of the old groups may never complete
        self._emit(
            "replica_plan",
            groups=replica_groups(nodes, wanted, holds),
            copies=self.copies,
            reason=(
                f"{self.copies} cop{'y' if self.copies == 1 else 'ies'} of every shard on "
                f"distinct nodes"
                + (
                    f" (checkpoint.replicas={wanted}, but the job has {len(nodes)} node(s))"
                    if self.copies < wanted
                    else ""
                )
            ),
        )

    def holder_rank(self, rank: int) -> int | None:
        """A rank on the node that keeps the copies of `rank`'s shards (its first replica
        peer with a rank of the job), or None (one copy, or no rank there)."""
        pool = self.pool
        nodes = tuple(sorted(n for n in pool.agents if n not in pool.bad.lost))
        peers = replica_peers(nodes, self.spec.replicas, self._planned_holds)
        for node in peers.get(pool.node_of(rank), []):
            there = [r for r in sorted(pool.workers) if pool.node_of(r) == node]
            if there:
                return there[0]
        return None

    def replicated(
        self, own: dict[int, set[int]], live: Iterable[Mapping[int, Iterable[int]]]
    ) -> dict[int, set[int]]:
        """rank -> the steps of which `copies` nodes hold its shard (own store or a peer's
        copy; `live`: each live node's holdings, rank -> steps): the steps that count for
        the commit."""
        self.sync()
        return with_copies(own, list(live), self.copies)

    def replicate(
        self,
        own: dict[int, set[int]],
        committed: int | None,
        statuses: Mapping[str, Mapping[str, Any]],
    ) -> None:
        """When no commit came for long enough, name the newest step every rank holds in its
        own node's memory, which every agent sends next; asked again while the commit stays
        behind, with an event when it is long. `statuses`: node -> its replicator's."""
        now = self._clock()
        moved = committed != self._commit_seen[0]
        if moved:
            self._commit_seen = (committed, now)
            self.replicating = None
            self._copyable_since = None
        if self.required is not None and committed is not None and committed >= self.required:
            self.required = None
        if self.copies <= 1 or not own:
            return
        floor = committed if committed is not None else -1
        if (
            self._copyable_since is None
            and max(set.intersection(*own.values()), default=-1) > floor
        ):
            self._copyable_since = now
        if self.required is not None and all(self.required in s for s in own.values()):
            if self.replicating is None or now - self.replicating[1] >= REPLICATION_ALIGN_S:
                self.replicating = (self.required, now)
                self.send(self.required)
            return
        if moved:
            return
        complete = set.intersection(*own.values())
        # A step on the thinned grid, which the agents send anyway, when there is one.
        newest = max([s for s in complete if s % self.stride == 0] or complete, default=-1)
        if newest <= (committed if committed is not None else -1):
            return
        stalled_s = now - max(self._commit_seen[1], self._copyable_since or now)
        # Thinned copies commit once per stride: only a commit later than two strides'
        # time (or REPLICATION_ALIGN_S) is behind.
        grid_s = self.stride / self.steady_rate if self.steady_rate else 0.0
        if stalled_s < max(REPLICATION_ALIGN_S, 2 * grid_s):
            return
        if self.replicating is not None and now - self.replicating[1] < REPLICATION_ALIGN_S:
            return
        if stalled_s >= REPLICATION_STALL_S and now - self._stall_reported >= REPLICATION_STALL_S:
            self._stall_reported = now
            self._emit(
                "replication_behind",
                committed_step=committed,
                newest_step=newest,
                seconds=round(stalled_s, 1),
                errors={
                    n[:12]: st["last_error"] for n, st in statuses.items() if st.get("last_error")
                },
                reason=f"no step reached {self.copies} nodes for {stalled_s:.0f} s "
                f"(newest in every rank's own memory: {newest}, committed: {committed})",
            )
        if self.bounded:
            # Every step on the bound's grid is sent anyway and the ranks wait for their
            # copies: an older step sent again would only be held (pinned) until sent.
            return
        self.replicating = (newest, now)
        self.send(newest)

    def require(self, step: int) -> None:
        """Have `step` committed next, whatever the stride: every agent sends it now (and
        again while it is not committed). `step` must still be in every rank's memory."""
        self.required = step

    def send(self, step: int) -> None:
        """Every agent of the plan sends `step`'s shards to its peers next."""
        for node in self.nodes:
            self.pool.agents[node].replicate.remote(step)

    def steady(self, steps_per_s: float, statuses: Mapping[str, Mapping[str, Any]]) -> None:
        """The steady step rate is `steps_per_s`: thin the copies to peers (choose_stride) to
        at most REPLICATE_PER_S rounds a second, and each node's sender busy at most
        checkpoint.replication_duty of the time, by the cost of a round measured since the
        last call (the slowest node's). A lost node then redoes up to the stride's steps.
        With checkpoint.max_lag_steps the stride is the bound's: nothing to choose."""
        self.steady_rate = steps_per_s
        if self.bounded:
            return
        round_s = None
        for node, rep in statuses.items():
            seconds, rounds = rep.get("seconds", 0.0), rep.get("rounds", 0)
            before = self._send_mark.get(node)
            if before is not None and rounds < before[1]:
                before = None  # a new agent: its counters started again
            elif before is not None and rounds == before[1]:
                continue  # no round since the mark: keep it until there is one
            self._send_mark[node] = (seconds, rounds)
            if before is not None:
                cost = (seconds - before[0]) / (rounds - before[1])
                round_s = cost if round_s is None else max(round_s, cost)
        # Thinned copies are rare: without a round since the last call, the last cost stands.
        round_s = self._round_s = round_s if round_s is not None else self._round_s
        stride, why = choose_stride(
            steps_per_s,
            self.spec.every_steps,
            self.stride,
            REPLICATE_PER_S,
            self.spec.replication_duty,
            round_s,
        )
        if stride == self.stride:
            return
        self.stride = stride
        for node in self.nodes:
            self.pool.agents[node].set_stride.remote(self.stride, self.bounded)
        self._emit(
            "replication_stride", stride=stride, reason=f"copies of every {stride} steps: {why}"
        )

    def note_waits(self, waited_s: float, now: float) -> None:
        """Training has waited `waited_s` in all for its copies to reach peers (the bound,
        checkpoint.max_lag_steps): an event when that grew by WAIT_EVENT_S since the last
        one, at most every WAIT_EVENT_EVERY_S."""
        before, at = self._waits_reported
        if waited_s - before < WAIT_EVENT_S or now - at < WAIT_EVENT_EVERY_S:
            return
        self._waits_reported = (waited_s, now)
        self._emit(
            "replication_wait",
            seconds=round(waited_s - before, 2),
            total_seconds=round(waited_s, 2),
            reason=f"training waited {waited_s - before:.1f} s for its checkpoint copies to "
            f"reach peer nodes (checkpoint.max_lag_steps={self.spec.max_lag_steps}: the "
            "copies are slower than the steps; StalwartCopiesHoldTraining in "
            "docs/operations.md)",
        )

    def summary(self, statuses: list[Mapping[str, Any]], shards_held: dict[str, int]):
        return {
            "replicas": self.spec.replicas,
            "copies": self.copies,
            "max_lag_steps": self.spec.max_lag_steps,
            "groups": replica_groups(self.nodes, self.spec.replicas),
            "sent_bytes": sum(s.get("sent_bytes", 0) for s in statuses),
            "seconds": round(sum(s.get("seconds", 0.0) for s in statuses), 3),
            "errors": sum(s.get("errors", 0) for s in statuses),
            # Shards in each node's memory at the last report (own store + copies).
            "shards_held": shards_held,
        }

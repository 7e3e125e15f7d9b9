"""Executing a recovery decision (health.policy's REPLACE or RESTART_GROUP), in two steps the
supervisor's loop drives while the job is RECOVERING:

1. `replace`: release the survivors (their collectives fail, their loops unwind; the
   processes stay), stop the ranks to replace and start their successors (a warm spare,
   else a new worker), preflight new nodes, shrink or grow an elastic job;
2. (the loop polls the agents, so what memory holds is fresh)
3. `roll_back`: the newest committed step (memory, else durable storage, else step 0),
   the failures recorded, the recovery opened in the ledger. The loop then starts the next
   generation, whose ranks restore that step (worker/context.py).

It never sets the job's state: each step says how it ended and the loop sets the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.ckpt.durable import Manifest
from stalwart.health.observations import Budget, FailureKind, WorkerFailure
from stalwart.health.policy import Decision
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.checkpoints import Checkpoints
from stalwart.orchestrator.supervisor.detect import Detection
from stalwart.orchestrator.supervisor.elastic import Elastic
from stalwart.orchestrator.supervisor.generation import Generation
from stalwart.orchestrator.supervisor.ledger import Ledger
from stalwart.orchestrator.supervisor.pool import NODE_PING_TIMEOUT_S, WorkerPool
from stalwart.orchestrator.supervisor.preflight import Preflight
from stalwart.orchestrator.supervisor.resources import SchedulingError


@dataclass
class Recovering:
    """What the RECOVERING state works on: the decision with its reason and failures (more
    join as the release surfaces them), the ready idle workers to grow by, and what the
    steps found on the way."""

    decision: Decision
    reason: str
    failures: list[WorkerFailure]
    grow: list[tuple[Any, int | None]] = field(default_factory=list)
    decided_at: float = field(default_factory=time.time)
    replace: set[int] = field(default_factory=set)  # ranks that get a new worker
    phases: dict[str, float] = field(default_factory=dict)  # abort, replace (seconds)
    from_spares: dict[int, int | None] = field(default_factory=dict)  # rank -> spare's slot
    resized: bool = False
    # Failures the release surfaced that still want a decision of their own.
    requeue: list[WorkerFailure] = field(default_factory=list)


@dataclass(frozen=True)
class Resume:
    """How a recovery ends: the step the next generation restores (None: step 0) and from
    where (`durable`: storage), and the reason for the RUNNING state."""

    restore_step: int | None
    durable: Manifest | None
    reason: str


class Recovery:
    def __init__(
        self,
        spec: JobSpec,
        pool: WorkerPool,
        generation: Generation,
        preflight: Preflight,
        detection: Detection,
        checkpoints: Checkpoints,
        elastic: Elastic,
        ledger: Ledger,
        emit: Callable[..., None],
    ):
        self.spec = spec
        self.pool = pool
        self.generation = generation
        self.preflight = preflight
        self.detection = detection
        self.checkpoints = checkpoints
        self.elastic = elastic
        self.ledger = ledger
        self._emit = emit
        self.restarts = 0  # recoveries from failures (failure.max_restarts)
        self.user_errors = 0  # of them, for the user's code (failure.user_error_retries)
        self.loss_steps: list[int] = []  # of them, for a loss not finite: at which steps

    def budget(self) -> Budget:
        f = self.spec.failure
        return Budget(
            self.restarts,
            f.max_restarts,
            self.user_errors,
            f.user_error_retries,
            loss_steps=tuple(self.loss_steps),
            max_loss_rollbacks=self.spec.health.loss_guard.max_rollbacks,
        )

    def replace(self, work: Recovering) -> str | None:
        """Release the survivors and replace the ranks that need it. Returns why the job
        fails, or None when every rank has a worker (the job may have shrunk)."""
        failures = work.failures
        if failures:
            self.restarts += 1
        if any(f.kind in (FailureKind.USER_ERROR, FailureKind.OOM) for f in failures):
            self.user_errors += 1
        numeric = [f for f in failures if f.kind is FailureKind.LOSS_NOT_FINITE]
        if numeric:
            self.loss_steps.append(min(numeric, key=lambda f: f.at).step or 0)
        replace = work.replace
        replace.update(work.decision.ranks)
        detection = self.detection
        self._confirm_nodes(failures, work)

        # 1. Release survivors: fail their collectives, unwind their loops. Ranks to be
        # replaced (dead, hung, on a lost or cordoned node) are killed first.
        t0 = time.time()
        extra, also = self.generation.release(replace, work.reason, detection.beats)
        failures.extend(extra)
        replace |= also
        # Ranks found dead while releasing (a second node lost at once) get the same check.
        self._confirm_nodes(extra, work)
        # What the release surfaced about a rank this recovery does not replace wants a
        # decision of its own; a replaced rank's failure is handled here (decided again,
        # it would replace the rank's new worker).
        work.requeue = [
            f for f in extra if f.kind is not FailureKind.COMM_ERROR and f.rank not in replace
        ]
        t_aborted = time.time()

        # 2. Replace lost ranks: a warm spare on a healthy node if one is ready, else a new
        # worker in the lost rank's slot if its node is healthy, else on any healthy node.
        for rank in replace:
            detection.forget_rank(rank)
        work.from_spares, placed = self.pool.replace(replace)
        if work.from_spares:
            self._emit("spares_used", ranks=work.from_spares, spares_left=len(self.pool.spares))
        if replace:
            error = self._await_replacements(replace, placed, work)
            if error is not None:
                return error
        self.pool.refill_spares()
        work.phases = {"abort": t_aborted - t0, "replace": time.time() - t_aborted}
        if work.grow:
            self.elastic.grow(work.grow)
            work.resized = True
        return None

    def _confirm_nodes(self, found: list[WorkerFailure], work: Recovering) -> None:
        """A dead worker's node may be dead too (the worker's death often reaches us
        first): confirm it answers before its slot gets the replacement."""
        detection = self.detection
        nodes = {f.node for f in found if f.kind is FailureKind.WORKER_DIED and f.node}
        for node in detection.unresponsive(nodes - self.pool.bad.lost):
            lost = detection.lose_node(
                node,
                f"node {node[:12]}: its agent did not answer after its "
                f"worker died (within {NODE_PING_TIMEOUT_S} s)",
                time.time(),
            )
            work.failures.extend(lost)
            work.replace.update(f.rank for f in lost)

    def _await_replacements(
        self, replace: set[int], placed: dict[int, str], work: Recovering
    ) -> str | None:
        pool = self.pool
        timeout_s = self.spec.failure.replacement_timeout_s
        missing = pool.await_ready(sorted(replace), timeout_s, allow_missing=True)
        # The world stays a multiple of workers.multiple_of: the last survivors go too.
        multiple = self.spec.world_multiple
        keep = (pool.world - len(missing)) // multiple * multiple
        if missing and keep >= self.spec.min_workers:
            survivors = sorted(set(pool.workers) - set(missing))
            self.elastic.shrink(missing, survivors[keep:])
            replace -= set(missing)
            work.resized = True
        elif missing:
            return (
                f"recovery failed: no healthy node had room for rank(s) {missing} within "
                f"failure.replacement_timeout_s={timeout_s}"
                + (
                    f", and the job may not shrink below workers.min={self.spec.min_workers}"
                    if self.spec.min_workers < self.spec.max_workers
                    else ""
                )
            )
        try:
            self.preflight.check_and_move(self.preflight.fresh(list(replace)), initial=False)
        except SchedulingError as e:
            return f"recovery failed: {e}"
        self._emit(
            "replaced",
            ranks={r: {"node": pool.node_of(r), "via": placed[r]} for r in sorted(replace)},
        )
        return None

    def roll_back(self, work: Recovering, reached: int) -> Resume:
        """After `replace` and a fresh poll: roll back to the newest step with a complete
        set of shards (in memory: any live copy, a node's own store or a peer's; else on
        durable storage; else step 0), record the failures (`reached`: the newest step any
        rank reached) and open the recovery in the ledger."""
        for f in work.failures:
            if f.kind is FailureKind.RESTORE_FAILED:
                self.checkpoints.distrust(f.rank)
        restore, durable = self.checkpoints.roll_back(self.generation.number + 1)
        # From scratch counts as restoring step 0.
        recorded = self.ledger.record_failures(
            work.failures,
            restored_step=restore if restore is not None else 0,
            decided_at=work.decided_at,
            reached=reached,
        )
        self.ledger.open(
            self.generation.number + 1,
            recorded,
            phases=work.phases,
            decided_at=work.decided_at,
            restore_step=restore,
            replaced=sorted(work.replace),
            from_spares=sorted(work.from_spares),
        )
        reason = (
            f"resumed from {'durable' if durable is not None else 'committed'} step {restore}"
            + (f", replaced rank(s) {sorted(work.replace)}" if work.replace else "")
            + (f", world size {self.pool.world}" if work.resized else "")
        )
        return Resume(restore, durable, reason)

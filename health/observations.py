"""What the supervisor saw, as frozen facts. Policies read these; nothing mutates them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureKind(enum.Enum):
    WORKER_DIED = "worker_died"  # the rank's process is gone (SIGKILL, crash)
    USER_ERROR = "user_error"  # the train loop raised an exception of its own
    OOM = "oom"  # out of memory: torch's OutOfMemoryError, MemoryError, Ray's OOM killer
    COMM_ERROR = "comm_error"  # a collective failed (peer gone, connection reset)
    NODE_LOST = "node_lost"  # the rank's node stopped answering (agent silent / Ray: dead)
    HUNG = "hung"  # heartbeats arrive but the step has not advanced for hang_timeout_s
    STRAGGLER = "straggler"  # persistently slower than its peers (policy: replace)
    GPU_FATAL = "gpu_fatal"  # a fatal Xid, double-bit ECC or a lost GPU on the rank's node
    GPU_ERROR = "gpu_error"  # an application Xid on the rank's GPU (e.g. 13, 43)
    PREFLIGHT = "preflight"  # the rank's node failed its preflight check
    # The rank could not restore its shard (source gone, timed out, missing, corrupt):
    # the copy's fault, not the rank's; restored again from the next source.
    RESTORE_FAILED = "restore_failed"
    # The loss the rank reported was NaN or infinite (health.loss_guard): stopped before the
    # step was checkpointed; rolled back and retried, unless the replay repeats it.
    LOSS_NOT_FINITE = "loss_not_finite"
    # The data-parallel replicas' parameters differ (health.divergence_every_steps): a
    # rank-dependent or nondeterministic update, or silent data corruption.
    REPLICA_DIVERGENCE = "replica_divergence"


class FailureClass(enum.Enum):
    """Who is to blame, which decides how a failure is handled."""

    USER = "user"  # deterministic on replay: fail fast unless retries are configured
    RESOURCE = "resource"  # out of memory: as USER (a replay needs the same memory)
    COMMUNICATION = "communication"  # usually a symptom: wait briefly for the root cause
    INFRASTRUCTURE = "infrastructure"  # process, node or GPU lost: replace within the budget
    PERFORMANCE = "performance"  # slow or hung: replace within the budget
    # A non-finite loss: roll back and retry (a bit flip, a bad kernel); a bit-exact replay
    # that repeats it is the model's or the data's, and fails the job.
    NUMERIC = "numeric"
    # The replicas differ: the loop's nondeterminism or the hardware's corruption, never the
    # user's ordinary error and never fixed by replaying blindly: fails the job, naming
    # what diverged (the state committed since the last check may hold it).
    INTEGRITY = "integrity"


CLASS_OF = {
    FailureKind.USER_ERROR: FailureClass.USER,
    FailureKind.OOM: FailureClass.RESOURCE,
    FailureKind.COMM_ERROR: FailureClass.COMMUNICATION,
    FailureKind.WORKER_DIED: FailureClass.INFRASTRUCTURE,
    FailureKind.NODE_LOST: FailureClass.INFRASTRUCTURE,
    FailureKind.GPU_FATAL: FailureClass.INFRASTRUCTURE,
    FailureKind.GPU_ERROR: FailureClass.INFRASTRUCTURE,
    FailureKind.PREFLIGHT: FailureClass.INFRASTRUCTURE,
    FailureKind.RESTORE_FAILED: FailureClass.INFRASTRUCTURE,
    FailureKind.HUNG: FailureClass.PERFORMANCE,
    FailureKind.STRAGGLER: FailureClass.PERFORMANCE,
    FailureKind.LOSS_NOT_FINITE: FailureClass.NUMERIC,
    FailureKind.REPLICA_DIVERGENCE: FailureClass.INTEGRITY,
}

# Failures whose node should get no more ranks of this job.
CORDONING = frozenset(
    {FailureKind.NODE_LOST, FailureKind.GPU_FATAL, FailureKind.STRAGGLER, FailureKind.PREFLIGHT}
)


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure as the supervisor saw it."""

    kind: FailureKind
    rank: int
    node: str | None
    at: float  # when the supervisor observed it
    step: int | None = None  # last step the rank completed, if known
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    output_tail: tuple[str, ...] = ()  # the rank's last printed lines (a user error)
    injected_at: float | None = None  # when a chaos fault fired, if this was one
    process_lost: bool = False  # the rank's process is gone (it cannot rejoin the group)

    @property
    def failure_class(self) -> FailureClass:
        return CLASS_OF[self.kind]


@dataclass(frozen=True)
class Budget:
    """What recovery may still spend."""

    restarts_used: int
    max_restarts: int | None  # None: unlimited
    user_errors_seen: int
    user_error_retries: int
    # The steps rolled back for a non-finite loss so far (one per roll back), their limit.
    loss_steps: tuple[int, ...] = ()
    max_loss_rollbacks: int = 3

    @property
    def loss_rollbacks(self) -> int:
        return len(self.loss_steps)

    @property
    def restarts_left(self) -> int | None:
        if self.max_restarts is None:
            return None
        return max(0, self.max_restarts - self.restarts_used)


@dataclass(frozen=True)
class RankView:
    """One rank's liveness as of its latest heartbeat (relayed by its node agent)."""

    rank: int
    node: str
    step: int  # steps completed
    step_changed_at: float  # when `step` last changed (or the generation started)
    beat_at: float  # when the agent received the latest heartbeat
    collective_since: float | None = None  # oldest collective still pending, if any
    # waiting since then for its checkpoint copies to reach peer nodes (max_lag_steps)
    copies_since: float | None = None
    stepped: bool = True  # finished a step in this generation (else: its first step)
    busy: bool = False  # its training thread used its CPU lately (health/hang_timeout.py)

    @property
    def waiting(self) -> bool:
        """Blocked on others (a collective, or its copies on peers), not its own work."""
        return self.collective_since is not None or self.copies_since is not None


@dataclass(frozen=True)
class NodeView:
    """One node as the supervisor sees it.

    Silence is measured from the oldest report request the agent has not answered, not
    from its last answer: a supervisor busy elsewhere (in a recovery) asks nobody, and
    that must not look like every node going silent.
    """

    node: str
    unanswered_since: float | None = None  # when the oldest unanswered request was sent
    agent_dead: bool = False  # Ray says the agent actor died
    ray_alive: bool = True  # Ray's node table says the node is alive
    # When the newest connection its raylet accepted was begun (the supervisor probes a
    # silent agent's node: orchestrator/supervisor/raylet_probe.py)
    raylet_answered_at: float | None = None

"""Failure policy: a pure function from observations to a decision with a reason.

The supervisor executes decisions; it never decides. Everything here takes ``now``
and returns ``(Decision, reason)`` so it can be tested with a fake clock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stalwart.health.cordon import flapping_nodes
from stalwart.health.observations import CORDONING, Budget, FailureClass, FailureKind, WorkerFailure


class Action(enum.Enum):
    NOOP = "noop"  # nothing to do (yet)
    REPLACE = "replace"  # abort survivors in place, replace `ranks`, resume from last commit
    RESTART_GROUP = "restart_group"  # no rank lost: re-form the group, resume from last commit
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    ranks: tuple[int, ...] = ()
    cordon: tuple[str, ...] = field(default=())

    @staticmethod
    def noop() -> Decision:
        return Decision(Action.NOOP)


NOOP = Decision(Action.NOOP)


@dataclass(frozen=True)
class PolicyConfig:
    # A collective error usually means a peer died; Ray reports the death itself within
    # milliseconds, so wait this long for the root cause before treating the error alone.
    comm_error_grace_s: float = 2.0
    # A node with this many failures (of any kind) within flap_window_s is cordoned.
    flap_failures: int = 3
    flap_window_s: float = 600.0


NODE_CLASSES = (FailureClass.INFRASTRUCTURE, FailureClass.PERFORMANCE)

_WHAT = {
    FailureKind.WORKER_DIED: "died",
    FailureKind.NODE_LOST: "lost with its node",
    FailureKind.HUNG: "hung",
    FailureKind.STRAGGLER: "straggling",
    FailureKind.GPU_FATAL: "on a failed GPU",
    FailureKind.GPU_ERROR: "hit a GPU application error",
    FailureKind.PREFLIGHT: "on a node that failed preflight",
    FailureKind.RESTORE_FAILED: "could not restore its shard",
    FailureKind.LOSS_NOT_FINITE: "reported a loss that is not finite",
    FailureKind.REPLICA_DIVERGENCE: "found the replicas' parameters differ",
}


# When one rank shows several failures at once, the most specific names the cause: a lost
# node also kills its workers; a GPU fault may also crash the process.
SPECIFICITY = (
    FailureKind.REPLICA_DIVERGENCE,
    FailureKind.USER_ERROR,
    FailureKind.OOM,
    FailureKind.NODE_LOST,
    FailureKind.GPU_FATAL,
    FailureKind.GPU_ERROR,
    FailureKind.PREFLIGHT,
    FailureKind.RESTORE_FAILED,
    FailureKind.LOSS_NOT_FINITE,
    FailureKind.HUNG,
    FailureKind.STRAGGLER,
    FailureKind.WORKER_DIED,
    FailureKind.COMM_ERROR,
)


def per_rank(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    """One failure per rank: its most specific kind (the earliest of equals), keeping
    whether any of them saw the process go."""
    best: dict[int, WorkerFailure] = {}
    lost: set[int] = set()
    for f in sorted(failures, key=lambda f: (SPECIFICITY.index(f.kind), f.at)):
        best.setdefault(f.rank, f)
        if f.process_lost:
            lost.add(f.rank)
    return [
        replace(f, process_lost=True) if f.rank in lost and not f.process_lost else f
        for f in sorted(best.values(), key=lambda f: f.rank)
    ]


def decide(
    failures: Sequence[WorkerFailure],
    budget: Budget,
    now: float,
    config: PolicyConfig = PolicyConfig(),
    node_history: Sequence[tuple[str, float]] = (),
) -> tuple[Decision, str]:
    """Decide what to do about the failures seen since the last recovery.

    `node_history`: (node, when) of earlier incidents, one per node per recovery, for the
    flapping rule.
    """
    if not failures:
        return NOOP, "no failures"
    failures = per_rank(failures)

    diverged = [f for f in failures if f.kind is FailureKind.REPLICA_DIVERGENCE]
    if diverged:
        first = min(diverged, key=lambda f: f.at)
        return (
            Decision(Action.FAIL),
            f"{first.message}; not retried: a replay of the same steps would diverge again "
            "if the loop makes it, and the steps committed since the guard's last check may "
            "hold the difference (resume from a durable step before it once the cause is "
            "known; failure.user_error_retries does not apply)",
        )

    user = [f for f in failures if f.failure_class in (FailureClass.USER, FailureClass.RESOURCE)]
    lost = [
        f
        for f in failures
        if f.failure_class in (FailureClass.INFRASTRUCTURE, FailureClass.PERFORMANCE)
    ]
    # A rank that could not restore its shard is alive and well: the copy was bad.
    restore = [f for f in lost if f.kind is FailureKind.RESTORE_FAILED and not f.process_lost]
    lost = [f for f in lost if f not in restore]
    dead = sorted({f.rank for f in lost} | {f.rank for f in user if f.process_lost})
    comm = [f for f in failures if f.kind is FailureKind.COMM_ERROR]
    cordon, cordon_why = _cordons(failures, now, config, node_history)

    if user:
        first = min(user, key=lambda f: f.at)
        if first.process_lost:
            what = f"rank {first.rank} was killed out of memory: {first.message}"
        else:
            oom = " (out of memory)" if first.kind is FailureKind.OOM else ""
            what = f"rank {first.rank} raised {first.error_type}{oom}: {first.message}"
        if budget.user_errors_seen >= budget.user_error_retries:
            return (
                Decision(Action.FAIL),
                f"{what}; user errors are not retried "
                f"(failure.user_error_retries={budget.user_error_retries})",
            )
        if budget.restarts_left == 0:
            return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
        action = Action.REPLACE if dead else Action.RESTART_GROUP
        return (
            Decision(action, ranks=tuple(dead), cordon=cordon),
            f"{what}; retry {budget.user_errors_seen + 1} of {budget.user_error_retries}"
            + cordon_why,
        )

    if dead:
        by_kind: dict[FailureKind, list[int]] = {}
        for f in sorted(lost, key=lambda f: f.rank):
            ranks = by_kind.setdefault(f.kind, [])
            if f.rank not in ranks:
                ranks.append(f.rank)
        what = "; ".join(
            ("rank " if len(r) == 1 else "ranks ") + ", ".join(map(str, r)) + " " + _WHAT[k]
            for k, r in by_kind.items()
        )
        if budget.restarts_left == 0:
            return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
        where = "on healthy nodes" if cordon else "in place"
        return (
            Decision(Action.REPLACE, ranks=tuple(dead), cordon=cordon),
            f"{what}; replace {where}{cordon_why}",
        )

    numeric = [f for f in failures if f.kind is FailureKind.LOSS_NOT_FINITE]
    if numeric:
        return _loss_not_finite(numeric, budget)

    if restore:
        ranks = ", ".join(str(f.rank) for f in restore)
        first = (restore[0].message or "").splitlines()[:1]
        what = f"rank(s) {ranks} could not restore their shards" + (
            f" ({first[0][:200]})" if first else ""
        )
        if budget.restarts_left == 0:
            return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
        return Decision(Action.RESTART_GROUP), f"{what}; restore again from the next source"

    # Only collective errors: give Ray time to report the death that caused them.
    oldest = min(f.at for f in comm)
    if now - oldest < config.comm_error_grace_s:
        return NOOP, "collective error without a known cause; waiting for the cause"
    ranks = ", ".join(str(f.rank) for f in sorted(comm, key=lambda f: f.rank))
    what = f"collective error on rank(s) {ranks} with no dead rank"
    if budget.restarts_left == 0:
        return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
    return Decision(Action.RESTART_GROUP), f"{what}; re-form the group"


def _loss_not_finite(numeric: Sequence[WorkerFailure], budget: Budget) -> tuple[Decision, str]:
    """A non-finite loss, no rank lost: roll back to the last committed step and retry. A
    replay is bit-exact, so the same step failing again is the model's or the data's."""
    first = min(numeric, key=lambda f: f.at)
    what = f"rank {first.rank}: " + (first.message or f"the loss at step {first.step} was NaN")
    if first.step in budget.loss_steps:
        return (
            Decision(Action.FAIL),
            f"{what} again after rolling back: the replay is bit-exact, so the model or the "
            f"data makes it (a learning rate too high, no gradient clipping, a bad batch at "
            f"step {first.step}), not a fault a roll back recovers from",
        )
    if budget.loss_rollbacks >= budget.max_loss_rollbacks:
        return (
            Decision(Action.FAIL),
            f"{what}; {budget.loss_rollbacks} roll back(s) for a loss that was not finite "
            f"already (health.loss_guard.max_rollbacks={budget.max_loss_rollbacks})",
        )
    if budget.restarts_left == 0:
        return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
    return (
        Decision(Action.RESTART_GROUP),
        f"{what}; roll back to the last committed step and retry (roll back "
        f"{budget.loss_rollbacks + 1} of {budget.max_loss_rollbacks})",
    )


def _cordons(
    failures: Sequence[WorkerFailure],
    now: float,
    config: PolicyConfig,
    node_history: Sequence[tuple[str, float]],
) -> tuple[tuple[str, ...], str]:
    nodes = {f.node for f in failures if f.kind in CORDONING and f.node}
    # One incident counts once per node, however many of its ranks it took.
    # Only the infrastructure's and performance failures say something about a node.
    incident = {f.node: now for f in failures if f.node and f.failure_class in NODE_CLASSES}
    history = list(node_history) + list(incident.items())
    flapping, _ = flapping_nodes(history, now, config.flap_window_s, config.flap_failures)
    flapping = [n for n in flapping if n in incident]
    nodes.update(flapping)
    if not nodes:
        return (), ""
    why = [
        f"{n[:12]} (flapping: {config.flap_failures}+ failures in {config.flap_window_s:.0f} s)"
        if n in flapping and n not in {f.node for f in failures if f.kind in CORDONING}
        else n[:12]
        for n in sorted(nodes)
    ]
    return tuple(sorted(nodes)), "; cordon " + ", ".join(why)


def _exhausted(budget: Budget) -> str:
    return (
        f"restart budget exhausted (failure.max_restarts={budget.max_restarts}, "
        f"used {budget.restarts_used})"
    )

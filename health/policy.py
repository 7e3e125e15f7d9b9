"""Failure policy: a pure function from observations to a decision with a reason.

The supervisor executes decisions; it never decides. Everything here takes ``now``
and returns ``(Decision, reason)`` so it can be tested with a fake clock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from health.observations import Budget, FailureKind, WorkerFailure


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


def decide(
    failures: Sequence[WorkerFailure],
    budget: Budget,
    now: float,
    config: PolicyConfig = PolicyConfig(),
) -> tuple[Decision, str]:
    """Decide what to do about the failures seen since the last recovery."""
    if not failures:
        return NOOP, "no failures"

    user = [f for f in failures if f.kind is FailureKind.USER_ERROR]
    dead = sorted({f.rank for f in failures if f.kind is FailureKind.WORKER_DIED})
    comm = [f for f in failures if f.kind is FailureKind.COMM_ERROR]

    if user:
        first = min(user, key=lambda f: f.at)
        what = f"rank {first.rank} raised {first.error_type}: {first.message}"
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
            Decision(action, ranks=tuple(dead)),
            f"{what}; retry {budget.user_errors_seen + 1} of {budget.user_error_retries}",
        )

    if dead:
        what = "rank" + ("s " if len(dead) > 1 else " ") + ", ".join(map(str, dead)) + " died"
        if budget.restarts_left == 0:
            return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
        return Decision(Action.REPLACE, ranks=tuple(dead)), f"{what}; replace in place"

    # Only collective errors: give Ray time to report the death that caused them.
    oldest = min(f.at for f in comm)
    if now - oldest < config.comm_error_grace_s:
        return NOOP, "collective error without a known cause; waiting for the cause"
    ranks = ", ".join(str(f.rank) for f in sorted(comm, key=lambda f: f.rank))
    what = f"collective error on rank(s) {ranks} with no dead rank"
    if budget.restarts_left == 0:
        return Decision(Action.FAIL), f"{what}; {_exhausted(budget)}"
    return Decision(Action.RESTART_GROUP), f"{what}; re-form the group"


def _exhausted(budget: Budget) -> str:
    return (
        f"restart budget exhausted (failure.max_restarts={budget.max_restarts}, "
        f"used {budget.restarts_used})"
    )

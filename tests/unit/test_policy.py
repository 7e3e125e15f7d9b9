"""health/policy.py + health/observations.py: the failure policy as a pure function."""

from __future__ import annotations

import pytest

from stalwart.health.observations import Budget, FailureKind, WorkerFailure
from stalwart.health.policy import NOOP, Action, Decision, PolicyConfig, decide

T0 = 1_000.0
CFG = PolicyConfig(comm_error_grace_s=2.0)


def died(rank: int, at: float = T0, node: str | None = "node-a") -> WorkerFailure:
    return WorkerFailure(FailureKind.WORKER_DIED, rank, node, at)


def comm(rank: int, at: float = T0) -> WorkerFailure:
    return WorkerFailure(
        FailureKind.COMM_ERROR,
        rank,
        "node-a",
        at,
        error_type="DistBackendError",
        message="Connection reset by peer",
    )


def user(rank: int, at: float = T0, exc: str = "ValueError", msg: str = "bad batch"):
    return WorkerFailure(
        FailureKind.USER_ERROR,
        rank,
        "node-a",
        at,
        step=17,
        error_type=exc,
        message=msg,
        traceback="Traceback ...",
    )


def budget(used: int = 0, max_restarts: int | None = 10, seen: int = 0, retries: int = 0):
    return Budget(
        restarts_used=used,
        max_restarts=max_restarts,
        user_errors_seen=seen,
        user_error_retries=retries,
    )


# --- observations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "max_restarts", "left"),
    [(0, 3, 3), (2, 3, 1), (3, 3, 0), (5, 3, 0), (0, 0, 0), (7, None, None)],
)
def test_restarts_left(used, max_restarts, left):
    assert budget(used, max_restarts).restarts_left == left


def test_observations_are_frozen():
    with pytest.raises(AttributeError):
        died(0).rank = 1
    with pytest.raises(AttributeError):
        budget().restarts_used = 1


# --- decide -----------------------------------------------------------------------------------


def test_no_failures_is_noop():
    decision, reason = decide([], budget(), T0, CFG)
    assert decision == NOOP
    assert decision.action is Action.NOOP
    assert decision == Decision.noop()
    assert reason == "no failures"


def test_one_dead_rank_is_replaced():
    decision, reason = decide([died(2)], budget(), T0, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (2,)
    assert reason == "rank 2 died; replace in place"


def test_several_dead_ranks_one_replace_with_all():
    failures = [died(3), died(0, at=T0 + 0.1), died(1, at=T0 + 0.2)]
    decision, reason = decide(failures, budget(), T0 + 0.3, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (0, 1, 3)
    assert reason == "ranks 0, 1, 3 died; replace in place"


def test_same_rank_reported_twice_is_replaced_once():
    decision, _ = decide([died(1), died(1, at=T0 + 0.5)], budget(), T0 + 1, CFG)
    assert decision.ranks == (1,)


def test_max_restarts_exhausted_fails():
    decision, reason = decide([died(1)], budget(used=3, max_restarts=3), T0, CFG)
    assert decision.action is Action.FAIL
    assert decision.ranks == ()
    assert "rank 1 died" in reason
    assert "failure.max_restarts=3" in reason
    assert "used 3" in reason


def test_zero_max_restarts_fails_on_first_death():
    decision, reason = decide([died(0)], budget(used=0, max_restarts=0), T0, CFG)
    assert decision.action is Action.FAIL
    assert "failure.max_restarts=0" in reason


def test_budget_runs_out_exactly_at_the_limit():
    # max_restarts=3: recoveries number 1, 2 and 3 are allowed, the 4th failure fails the job.
    for used in range(3):
        decision, _ = decide([died(0)], budget(used=used, max_restarts=3), T0, CFG)
        assert decision.action is Action.REPLACE, used
    decision, _ = decide([died(0)], budget(used=3, max_restarts=3), T0, CFG)
    assert decision.action is Action.FAIL


def test_overspent_budget_still_fails():
    decision, _ = decide([died(0)], budget(used=9, max_restarts=3), T0, CFG)
    assert decision.action is Action.FAIL


@pytest.mark.parametrize("used", [0, 10, 1_000, 10**9])
def test_unlimited_restarts_never_fail_for_deaths(used):
    decision, reason = decide([died(0), died(5)], budget(used=used, max_restarts=None), T0, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (0, 5)
    assert "max_restarts" not in reason


def test_user_error_not_retried_fails_naming_rank_and_exception():
    decision, reason = decide([user(2, exc="KeyError", msg="'labels'")], budget(), T0, CFG)
    assert decision.action is Action.FAIL
    assert "rank 2" in reason
    assert "KeyError" in reason
    assert "'labels'" in reason
    assert "failure.user_error_retries=0" in reason


def test_user_error_reports_the_first_one():
    failures = [user(3, at=T0 + 1, exc="RuntimeError"), user(1, at=T0, exc="ZeroDivisionError")]
    _, reason = decide(failures, budget(), T0 + 2, CFG)
    assert reason.startswith("rank 1 raised ZeroDivisionError")


def test_user_error_with_retries_left_restarts_the_group():
    decision, reason = decide([user(2)], budget(seen=0, retries=2), T0, CFG)
    assert decision.action is Action.RESTART_GROUP
    assert decision.ranks == ()  # nobody died: survivors are aborted and resume in place
    assert "retry 1 of 2" in reason
    assert "rank 2 raised ValueError: bad batch" in reason


def test_user_error_retries_used_up():
    decision, _ = decide([user(2)], budget(seen=1, retries=2), T0, CFG)
    assert decision.action is Action.RESTART_GROUP
    decision, reason = decide([user(2)], budget(seen=2, retries=2), T0, CFG)
    assert decision.action is Action.FAIL
    assert "failure.user_error_retries=2" in reason


def test_user_error_retry_still_needs_restart_budget():
    decision, reason = decide([user(0)], budget(used=2, max_restarts=2, retries=5), T0, CFG)
    assert decision.action is Action.FAIL
    assert "failure.max_restarts=2" in reason


def test_user_error_with_a_death_replaces_the_dead_rank():
    decision, _ = decide([user(0), died(3)], budget(retries=1), T0, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (3,)


def test_user_error_dominates_a_death_when_not_retried():
    decision, reason = decide([died(3), user(0)], budget(retries=0), T0, CFG)
    assert decision.action is Action.FAIL
    assert "rank 0 raised" in reason


def test_comm_error_within_grace_waits(clock):
    clock.now = T0
    failures = [comm(1, at=clock.now)]
    decision, reason = decide(failures, budget(), clock.now, CFG)
    assert decision == NOOP
    assert "waiting" in reason
    clock.advance(1.999)
    assert decide(failures, budget(), clock.now, CFG)[0] == NOOP


def test_comm_error_after_grace_restarts_group(clock):
    clock.now = T0
    failures = [comm(2, at=clock.now), comm(0, at=clock.now + 0.5)]
    clock.advance(2.0)  # grace measured from the oldest error; the boundary counts as expired
    decision, reason = decide(failures, budget(), clock.now, CFG)
    assert decision.action is Action.RESTART_GROUP
    assert decision.ranks == ()
    assert "rank(s) 0, 2" in reason
    assert "no dead rank" in reason


def test_comm_error_grace_is_configurable(clock):
    failures = [comm(0, at=clock.now)]
    clock.advance(5.0)
    assert decide(failures, budget(), clock.now, PolicyConfig(comm_error_grace_s=10.0))[0] == NOOP
    assert (
        decide(failures, budget(), clock.now, PolicyConfig(comm_error_grace_s=4.0))[0].action
        is Action.RESTART_GROUP
    )


def test_default_config_grace():
    failures = [comm(0, at=T0)]
    assert decide(failures, budget(), T0 + 1.0)[0] == NOOP
    assert decide(failures, budget(), T0 + 2.0)[0].action is Action.RESTART_GROUP


def test_comm_error_after_grace_with_no_budget_fails(clock):
    failures = [comm(0, at=clock.now)]
    clock.advance(3.0)
    decision, reason = decide(failures, budget(used=1, max_restarts=1), clock.now, CFG)
    assert decision.action is Action.FAIL
    assert "failure.max_restarts=1" in reason


def test_comm_error_plus_death_replaces_only_the_dead_rank():
    # The death explains the collective errors: no waiting, and only the dead rank goes.
    failures = [comm(0, at=T0), comm(2, at=T0), died(1, at=T0 + 0.01)]
    decision, reason = decide(failures, budget(), T0 + 0.02, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (1,)
    assert reason == "rank 1 died; replace in place"


def test_failure_during_recovery_with_budget_left():
    # Rank 1 died and a REPLACE was issued (restarts_used -> 1); while recovering, rank 2 dies.
    first, _ = decide([died(1)], budget(used=0, max_restarts=3), T0, CFG)
    assert first.ranks == (1,)
    decision, reason = decide(
        [died(1), died(2, at=T0 + 5)], budget(used=1, max_restarts=3), T0 + 5, CFG
    )
    assert decision.action is Action.REPLACE
    assert decision.ranks == (1, 2)
    assert "ranks 1, 2 died" in reason


def test_failure_during_recovery_exhausts_budget():
    first, _ = decide([died(1)], budget(used=0, max_restarts=1), T0, CFG)
    assert first.action is Action.REPLACE
    decision, reason = decide([died(2, at=T0 + 5)], budget(used=1, max_restarts=1), T0 + 5, CFG)
    assert decision.action is Action.FAIL
    assert "failure.max_restarts=1, used 1" in reason


def test_decide_is_pure():
    failures = (died(1), comm(0))
    b = budget()
    assert decide(failures, b, T0, CFG) == decide(failures, b, T0, CFG)
    assert failures == (died(1), comm(0))
    assert b == budget()


# --- restore failures ---------------------------------------------------------------------


def restore_failed(rank: int, at: float = T0) -> WorkerFailure:
    return WorkerFailure(
        FailureKind.RESTORE_FAILED,
        rank,
        "node-a",
        at,
        error_type="RestoreFailed",
        message="cannot restore committed step 30: the copy is corrupt",
    )


def test_a_restore_failure_is_the_infrastructures_and_restores_again():
    # Not the user's error: the default user_error_retries=0 does not end the job.
    decision, reason = decide([restore_failed(1)], budget(), T0, CFG)
    assert decision.action is Action.RESTART_GROUP  # the rank is alive: nothing to replace
    assert decision.ranks == () and decision.cordon == ()
    assert reason == (
        "rank(s) 1 could not restore their shards (cannot restore committed step 30: the "
        "copy is corrupt); restore again from the next source"
    )
    decision, _ = decide([restore_failed(1), died(2)], budget(), T0, CFG)
    assert decision.action is Action.REPLACE and decision.ranks == (2,)
    decision, reason = decide([restore_failed(1)], budget(used=10), T0, CFG)
    assert decision.action is Action.FAIL and "restart budget exhausted" in reason


def nan(rank: int, step: int = 30, at: float = T0) -> WorkerFailure:
    return WorkerFailure(
        FailureKind.LOSS_NOT_FINITE,
        rank,
        "node-a",
        at,
        step=step,
        error_type="LossNotFinite",
        message=f"the loss at step {step} was nan",
    )


def test_a_loss_that_is_not_finite_rolls_back_and_retries():
    decision, reason = decide([nan(2), comm(1, at=T0 + 0.1)], budget(), T0, CFG)
    assert decision == Decision(Action.RESTART_GROUP)  # every rank is alive
    assert reason == (
        "rank 2: the loss at step 30 was nan; roll back to the last committed step and "
        "retry (roll back 1 of 3)"
    )
    # Not the user's error (user_error_retries=0 does not end it) and no node is suspected.
    assert nan(2).failure_class.value == "numeric"


def test_the_same_step_not_finite_again_after_a_roll_back_fails_the_job():
    again = Budget(1, 10, 0, 0, loss_steps=(30,), max_loss_rollbacks=3)
    decision, reason = decide([nan(0, step=30)], again, T0, CFG)
    assert decision.action is Action.FAIL
    assert "again after rolling back: the replay is bit-exact" in reason
    assert "a bad batch at step 30" in reason
    # Another step: a new transient, rolled back while roll backs are left.
    decision, _ = decide([nan(0, step=55)], again, T0, CFG)
    assert decision.action is Action.RESTART_GROUP


def test_loss_roll_backs_are_limited():
    spent = Budget(3, 10, 0, 0, loss_steps=(5, 9, 14), max_loss_rollbacks=3)
    decision, reason = decide([nan(1, step=40)], spent, T0, CFG)
    assert decision.action is Action.FAIL
    assert reason.endswith("(health.loss_guard.max_rollbacks=3)")
    no_restarts = Budget(10, 10, 0, 0)
    decision, reason = decide([nan(1)], no_restarts, T0, CFG)
    assert decision.action is Action.FAIL and "restart budget exhausted" in reason


def test_a_dead_rank_beside_a_loss_not_finite_is_replaced():
    decision, _ = decide([nan(1), died(3)], budget(), T0, CFG)
    assert decision.action is Action.REPLACE and decision.ranks == (3,)


def diverged(rank: int, at: float = T0) -> WorkerFailure:
    return WorkerFailure(
        FailureKind.REPLICA_DIVERGENCE,
        rank,
        "node-a",
        at,
        step=40,
        error_type="ReplicaDivergence",
        message="the ranks' parameters differ after step 40 (...): rank(s) 3 differ from "
        "the other 3; model.fc.weight",
    )


def test_diverged_replicas_fail_the_job_whatever_the_retries_saying_what_diverged():
    """Not the user's ordinary error: user_error_retries does not retry it, nor does a
    budget with restarts left; a dead rank beside it does not turn it into a replace."""
    generous = Budget(0, 10, 0, 5)  # 5 user-error retries, 10 restarts
    decision, reason = decide([diverged(0), diverged(1), died(2)], generous, T0, CFG)
    assert decision == Decision(Action.FAIL)
    assert reason.startswith("the ranks' parameters differ after step 40")
    assert "rank(s) 3 differ from the other 3; model.fc.weight" in reason
    assert "not retried" in reason and "failure.user_error_retries does not apply" in reason
    assert diverged(0).failure_class.value == "integrity"

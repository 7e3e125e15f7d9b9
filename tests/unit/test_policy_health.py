"""health/policy.py: decide() for node loss, GPU faults, hangs, stragglers, OOM and flapping."""

from __future__ import annotations

import pytest

from stalwart.health.observations import CORDONING, Budget, FailureClass, FailureKind, WorkerFailure
from stalwart.health.policy import NOOP, Action, Decision, PolicyConfig, decide

T0 = 1_000.0
CFG = PolicyConfig(comm_error_grace_s=2.0, flap_failures=3, flap_window_s=600.0)
K = FailureKind


def fail(
    kind: FailureKind, rank: int, node: str | None = "node-a", at: float = T0, **kw
) -> WorkerFailure:
    return WorkerFailure(kind, rank, node, at, **kw)


def oom(rank: int = 0, node: str = "node-a", at: float = T0) -> WorkerFailure:
    return fail(
        K.OOM,
        rank,
        node,
        at,
        step=12,
        error_type="OutOfMemoryError",
        message="CUDA out of memory. Tried to allocate 2.00 GiB",
        traceback="Traceback ...",
    )


def comm(rank: int, node: str = "node-a", at: float = T0) -> WorkerFailure:
    return fail(
        K.COMM_ERROR,
        rank,
        node,
        at,
        error_type="DistBackendError",
        message="Connection reset by peer",
    )


def budget(used: int = 0, max_restarts: int | None = 10, seen: int = 0, retries: int = 0):
    return Budget(
        restarts_used=used,
        max_restarts=max_restarts,
        user_errors_seen=seen,
        user_error_retries=retries,
    )


# --- observations -----------------------------------------------------------------------------


def test_cordoning_kinds():
    assert frozenset({K.NODE_LOST, K.GPU_FATAL, K.STRAGGLER, K.PREFLIGHT}) == CORDONING


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        (K.USER_ERROR, FailureClass.USER),
        (K.OOM, FailureClass.RESOURCE),
        (K.COMM_ERROR, FailureClass.COMMUNICATION),
        (K.WORKER_DIED, FailureClass.INFRASTRUCTURE),
        (K.NODE_LOST, FailureClass.INFRASTRUCTURE),
        (K.GPU_FATAL, FailureClass.INFRASTRUCTURE),
        (K.GPU_ERROR, FailureClass.INFRASTRUCTURE),
        (K.PREFLIGHT, FailureClass.INFRASTRUCTURE),
        (K.HUNG, FailureClass.PERFORMANCE),
        (K.STRAGGLER, FailureClass.PERFORMANCE),
    ],
)
def test_failure_classes(kind, cls):
    assert fail(kind, 0).failure_class is cls


# --- cordoning failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        (K.NODE_LOST, "lost with its node"),
        (K.GPU_FATAL, "on a failed GPU"),
        (K.STRAGGLER, "straggling"),
        (K.PREFLIGHT, "on a node that failed preflight"),
    ],
)
def test_node_failures_replace_and_cordon_their_node(kind, what):
    decision, reason = decide([fail(kind, 2, "node-b")], budget(), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(2,), cordon=("node-b",))
    assert reason == f"rank 2 {what}; replace on healthy nodes; cordon node-b"


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        (K.GPU_ERROR, "hit a GPU application error"),
        (K.HUNG, "hung"),
        (K.WORKER_DIED, "died"),
    ],
)
def test_rank_failures_replace_without_cordon(kind, what):
    decision, reason = decide([fail(kind, 1, "node-b")], budget(), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(1,), cordon=())
    assert reason == f"rank 1 {what}; replace in place"


def test_lost_node_takes_all_its_ranks_and_is_cordoned_once():
    failures = [fail(K.NODE_LOST, r, "node-b", at=T0 + r * 0.01) for r in (3, 2)]
    decision, reason = decide(failures, budget(), T0 + 0.1, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(2, 3), cordon=("node-b",))
    assert reason == "ranks 2, 3 lost with its node; replace on healthy nodes; cordon node-b"


def test_two_lost_nodes_both_cordoned_sorted():
    failures = [fail(K.NODE_LOST, 5, "node-z"), fail(K.GPU_FATAL, 0, "node-c")]
    decision, reason = decide(failures, budget(), T0, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (0, 5)
    assert decision.cordon == ("node-c", "node-z")
    assert reason.endswith("; cordon node-c, node-z")


def test_mixed_kinds_are_described_per_kind_in_rank_order():
    failures = [
        fail(K.GPU_FATAL, 3, "node-b"),
        fail(K.WORKER_DIED, 0, "node-a"),
        fail(K.HUNG, 1, "node-a"),
    ]
    decision, reason = decide(failures, budget(), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(0, 1, 3), cordon=("node-b",))
    assert reason == (
        "rank 0 died; rank 1 hung; rank 3 on a failed GPU; replace on healthy nodes; cordon node-b"
    )


def test_cordon_reason_shortens_node_ids_but_decision_keeps_them():
    long_id = "a1" * 20
    decision, reason = decide([fail(K.NODE_LOST, 0, long_id)], budget(), T0, CFG)
    assert decision.cordon == (long_id,)
    assert reason.endswith("cordon " + long_id[:12])


def test_node_failure_without_a_known_node_replaces_without_cordon():
    decision, reason = decide([fail(K.NODE_LOST, 0, None)], budget(), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(0,), cordon=())
    assert reason == "rank 0 lost with its node; replace in place"


def test_budget_exhausted_fails_for_node_loss():
    decision, reason = decide(
        [fail(K.NODE_LOST, 2, "node-b")], budget(used=3, max_restarts=3), T0, CFG
    )
    assert decision == Decision(Action.FAIL)
    assert decision.cordon == ()
    assert reason == (
        "rank 2 lost with its node; restart budget exhausted (failure.max_restarts=3, used 3)"
    )


@pytest.mark.parametrize("kind", [K.GPU_FATAL, K.HUNG, K.STRAGGLER, K.PREFLIGHT, K.GPU_ERROR])
def test_budget_exhausted_fails_for_every_replacing_kind(kind):
    decision, reason = decide([fail(kind, 0)], budget(used=1, max_restarts=1), T0, CFG)
    assert decision.action is Action.FAIL
    assert "failure.max_restarts=1" in reason


def test_unlimited_budget_replaces_lost_node():
    decision, _ = decide([fail(K.NODE_LOST, 0)], budget(used=500, max_restarts=None), T0, CFG)
    assert decision.action is Action.REPLACE


def test_node_loss_with_comm_errors_replaces_immediately():
    # The survivors' collectives fail because the node went away: no grace wait.
    failures = [comm(0, at=T0), comm(1, at=T0), fail(K.NODE_LOST, 2, "node-b", at=T0)]
    decision, reason = decide(failures, budget(), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(2,), cordon=("node-b",))
    assert reason == "rank 2 lost with its node; replace on healthy nodes; cordon node-b"


def test_comm_errors_alone_still_wait():
    assert decide([comm(0), comm(1)], budget(), T0 + 1.0, CFG)[0] == NOOP


def test_comm_errors_do_not_cordon_the_victims_node():
    failures = [comm(0, "node-a"), fail(K.GPU_FATAL, 2, "node-b")]
    decision, _ = decide(failures, budget(), T0, CFG)
    assert decision.cordon == ("node-b",)


# --- OOM --------------------------------------------------------------------------------------


def test_oom_fails_by_default_saying_out_of_memory():
    decision, reason = decide([oom(1)], budget(), T0, CFG)
    assert decision == Decision(Action.FAIL)
    assert "out of memory" in reason
    assert reason.startswith("rank 1 raised OutOfMemoryError (out of memory): CUDA out of memory")
    assert "failure.user_error_retries=0" in reason


def test_oom_is_retried_when_user_error_retries_allow():
    decision, reason = decide([oom(1)], budget(seen=0, retries=2), T0, CFG)
    assert decision == Decision(Action.RESTART_GROUP)
    assert "retry 1 of 2" in reason
    assert "(out of memory)" in reason


def test_oom_retries_run_out_like_user_errors():
    decision, reason = decide([oom(1)], budget(seen=2, retries=2), T0, CFG)
    assert decision.action is Action.FAIL
    assert "failure.user_error_retries=2" in reason


def test_oom_retry_still_needs_restart_budget():
    decision, reason = decide([oom(0)], budget(used=2, max_restarts=2, retries=3), T0, CFG)
    assert decision.action is Action.FAIL
    assert "restart budget exhausted" in reason


def test_oom_not_retried_dominates_a_node_loss():
    decision, reason = decide([fail(K.NODE_LOST, 2, "node-b"), oom(0)], budget(), T0, CFG)
    assert decision.action is Action.FAIL
    assert "out of memory" in reason


def test_oom_retried_with_a_node_loss_replaces_and_cordons():
    decision, reason = decide([fail(K.NODE_LOST, 2, "node-b"), oom(0)], budget(retries=1), T0, CFG)
    assert decision == Decision(Action.REPLACE, ranks=(2,), cordon=("node-b",))
    assert "retry 1 of 1" in reason
    assert reason.endswith("; cordon node-b")


def test_first_user_or_oom_error_is_reported():
    user = fail(K.USER_ERROR, 3, at=T0 - 1, error_type="ValueError", message="bad batch")
    _, reason = decide([oom(0, at=T0), user], budget(), T0, CFG)
    assert reason.startswith("rank 3 raised ValueError: bad batch")
    assert "out of memory" not in reason


def test_oom_kill_by_rays_memory_monitor_replaces_the_dead_rank():
    # An OOM that *killed* the process (the supervisor marks it process_lost) cannot
    # rejoin the group: it is replaced, not just restarted in place.
    killed = fail(
        K.OOM,
        1,
        "node-a",
        message="Task was killed due to the node running low on memory. Ray killed this worker",
        process_lost=True,
    )
    decision, reason = decide([killed], budget(retries=1), T0, CFG)
    assert decision.action is Action.REPLACE
    assert decision.ranks == (1,)
    assert "raised None" not in reason
    assert "killed out of memory" in reason


# --- flapping ---------------------------------------------------------------------------------


def test_flapping_node_is_cordoned_on_a_failure_that_alone_would_not_cordon():
    history = [("node-a", T0 - 300), ("node-a", T0 - 100)]
    decision, reason = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert decision == Decision(Action.REPLACE, ranks=(0,), cordon=("node-a",))
    assert reason == (
        "rank 0 died; replace on healthy nodes; cordon node-a (flapping: 3+ failures in 600 s)"
    )


def test_below_flap_threshold_no_cordon():
    history = [("node-a", T0 - 100)]
    decision, reason = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert decision.cordon == ()
    assert reason == "rank 0 died; replace in place"


def test_several_ranks_of_one_node_at_once_are_one_incident():
    # Two earlier incidents would make this the third, but one earlier incident plus four
    # ranks failing together is only two.
    history = [("node-a", T0 - 100)]
    failures = [fail(K.WORKER_DIED, r, "node-a") for r in range(4)]
    decision, _ = decide(failures, budget(), T0, CFG, history)
    assert decision.cordon == ()
    history.append(("node-a", T0 - 50))
    decision, reason = decide(failures, budget(), T0, CFG, history)
    assert decision == Decision(Action.REPLACE, ranks=(0, 1, 2, 3), cordon=("node-a",))
    assert "flapping" in reason


def test_old_incidents_fall_out_of_the_flap_window():
    history = [("node-a", T0 - 700), ("node-a", T0 - 601)]
    decision, _ = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert decision.cordon == ()


def test_flapping_counts_per_node():
    history = [("node-a", T0 - 10), ("node-b", T0 - 20)]
    decision, _ = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert decision.cordon == ()


def test_flapping_node_not_failing_now_is_not_cordoned():
    history = [("node-b", T0 - 30), ("node-b", T0 - 20), ("node-b", T0 - 10)]
    decision, _ = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert decision.cordon == ()


def test_comm_errors_are_not_incidents_for_flapping():
    history = [("node-a", T0 - 30), ("node-a", T0 - 20)]
    failures = [comm(0, "node-a"), fail(K.WORKER_DIED, 1, "node-b")]
    decision, _ = decide(failures, budget(), T0, CFG, history)
    assert decision == Decision(Action.REPLACE, ranks=(1,), cordon=())


def test_flap_config_is_honoured():
    cfg = PolicyConfig(flap_failures=2, flap_window_s=60.0)
    history = [("node-a", T0 - 30)]
    decision, reason = decide([fail(K.HUNG, 0, "node-a")], budget(), T0, cfg, history)
    assert decision.cordon == ("node-a",)
    assert reason.endswith("cordon node-a (flapping: 2+ failures in 60 s)")
    decision, _ = decide([fail(K.HUNG, 0, "node-a")], budget(), T0 + 31, cfg, history)
    assert decision.cordon == ()


def test_flapping_plus_cordoning_failure_is_named_once_without_flapping_note():
    history = [("node-a", T0 - 30), ("node-a", T0 - 20)]
    decision, reason = decide([fail(K.GPU_FATAL, 0, "node-a")], budget(), T0, CFG, history)
    assert decision.cordon == ("node-a",)
    assert reason.endswith("; cordon node-a")


def test_default_flap_config():
    assert PolicyConfig() == PolicyConfig(2.0, 3, 600.0)
    history = [("node-a", T0 - 599), ("node-a", T0 - 1)]
    decision, _ = decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, node_history=history)
    assert decision.cordon == ("node-a",)


def test_decide_does_not_mutate_history():
    history = [("node-a", T0 - 30)]
    decide([fail(K.WORKER_DIED, 0, "node-a")], budget(), T0, CFG, history)
    assert history == [("node-a", T0 - 30)]

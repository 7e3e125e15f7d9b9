"""In-process recovery on a real local Ray: the oracle is the failure-free run's model digest.

Two ranks: what these tests check (the accounting of kills, budgets, spares and aborts) does
not depend on the world's size, and each rank more is a process importing torch per job."""

from __future__ import annotations

import pytest

from tests.component.conftest import small_spec

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]


def kill(rank: int, at_step: int) -> dict:
    return {"kind": "kill_worker", "rank": rank, "at_step": at_step}


def test_two_kills_of_different_ranks_recover_bit_exact(run, baseline):
    spec = small_spec(workers=2, chaos__faults=[kill(1, 8), kill(0, 27)])
    result = run(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["model_digest"] == baseline(spec)["model_digest"]
    assert [(f["rank"], f["step"]) for f in result["failures"]] == [(1, 8), (0, 27)]
    assert all(f["steps_redone"] <= 1 for f in result["failures"])
    assert result["generations"] == 3


def test_sparse_checkpoints_redo_at_most_every_steps(run, baseline):
    spec = small_spec(workers=2, checkpoint__every_steps=5, chaos__faults=[kill(1, 23)])
    result = run(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["model_digest"] == baseline(spec)["model_digest"]
    [failure] = result["failures"]
    # Killed before step 23 ran: steps 0..22 done, last snapshot at 20.
    assert failure["restored_step"] == 20
    assert failure["steps_redone"] == 3
    assert result["lost_steps_total"] == 3


def test_max_restarts_zero_fails_on_first_kill(run):
    spec = small_spec(workers=2, failure__max_restarts=0, chaos__faults=[kill(1, 10)])
    result = run(spec)
    assert result["status"] == "failed"
    assert "failure.max_restarts=0" in result["error"]["message"]
    assert "rank 1 died" in result["error"]["message"]
    assert result["restarts"] == 0
    assert result["steps_completed"] < spec["steps"]
    [failure] = result["failures"]
    assert failure["rank"] == 1 and failure["restored_step"] is None


def test_restart_budget_runs_out(run):
    spec = small_spec(workers=2, failure__max_restarts=1, chaos__faults=[kill(1, 5), kill(0, 12)])
    result = run(spec)
    assert result["status"] == "failed"
    assert result["restarts"] == 1
    assert (
        "restart budget exhausted (failure.max_restarts=1, used 1)" in (result["error"]["message"])
    )


def test_warm_spare_takes_the_lost_rank(run, baseline):
    spec = small_spec(workers=2, failure__spares=1, chaos__faults=[kill(1, 12)])
    result = run(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["model_digest"] == baseline(spec)["model_digest"]
    [recovered] = [e for e in result["events"] if e["type"] == "recovered"]
    assert recovered["from_spares"] == [1]
    [used] = [e for e in result["events"] if e["type"] == "spares_used"]
    assert used["ranks"] == {"1": 2}  # the spare's bundle comes after the 2 workers'
    # The used spare's place is refilled with a new spare in the lost rank's bundle.
    ready = [e for e in result["events"] if e["type"] == "spare_ready"]
    assert [e["bundle"] for e in ready][:1] == [2]
    # The cold start's phases (supervisor/startup.py) sum to its time to the first step, in
    # the failure-free run (here two ranks' steps take milliseconds: a rank killed at step
    # 12 may be gone before the supervisor's next poll hears it took its first).
    startup = baseline(spec)["startup"]
    assert startup["first_step_after_s"] > 0
    assert sum(startup["phases_s"].values()) == pytest.approx(
        startup["first_step_after_s"], abs=0.05
    )


def test_survivor_stuck_outside_collectives_is_replaced(run, baseline):
    # Rank 1 dies at step 10 while rank 0 is busy for 60 s in step 9 outside any collective:
    # rank 0 cannot leave its loop within abort_timeout_s, so it is replaced too.
    spec = small_spec(
        workers=2,
        entrypoint="tests/component/loops.py:slow_step_loop",
        config__slow_rank=0,
        config__slow_at=10,
        config__slow_s=60,
        failure__abort_timeout_s=3,
        health__hang_timeout_s=300,  # the replacement is the abort timeout's, not a hang's
        chaos__faults=[kill(1, 10)],
    )
    result = run(spec)
    assert result["status"] == "succeeded", result["error"]
    [timeout] = [e for e in result["events"] if e["type"] == "abort_timeout"]
    assert timeout["rank"] == 0
    [recovered] = [e for e in result["events"] if e["type"] == "recovered"]
    assert recovered["replaced"] == [0, 1]
    clean = small_spec(workers=2, entrypoint="stalwart.examples.gpt.train:train_loop")
    assert result["model_digest"] == baseline(clean)["model_digest"]

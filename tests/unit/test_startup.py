"""orchestrator/supervisor/startup.py: the cold start's phases from timestamps (no Ray)."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.supervisor.startup import (
    StartupClock,
    boot_summary,
    phases_from_marks,
    startup_breakdown,
)

pytestmark = pytest.mark.timeout(10)

T0 = 1_000.0
DRIVER = {"started": T0, "ray_ready": T0 + 4.0, "supervisor_requested": T0 + 4.1}


def _ranks(first_step: float = 30.0) -> list[dict[str, float]]:
    # The slowest rank ends each phase: rank 1's rendezvous, rank 0's set-up and step.
    return [
        {
            "started": T0 + 25.0,
            "rendezvous_done": T0 + 25.2,
            "setup_done": T0 + 27.0,
            "restored": T0 + 27.1,
            "first_step_done": T0 + first_step,
        },
        {
            "started": T0 + 25.0,
            "rendezvous_done": T0 + 25.5,
            "setup_done": T0 + 26.0,
            "restored": T0 + 26.1,
            "first_step_done": T0 + 29.0,
        },
    ]


def test_consecutive_marks_make_phases_that_sum_to_the_total():
    phases, total = phases_from_marks(T0, [("a", T0 + 1), ("b", T0 + 3.5), ("c", T0 + 4)])
    assert phases == {"a": 1.0, "b": 2.5, "c": 0.5}
    assert total == 4.0


def test_a_mark_before_the_previous_one_takes_no_time():
    # A prestarted process started before it was asked for: its spawn took 0 s.
    phases, total = phases_from_marks(T0, [("a", T0 + 2), ("spawn", T0 + 1), ("b", T0 + 3)])
    assert phases == {"a": 2.0, "spawn": 0.0, "b": 1.0}
    assert total == 3.0


def test_the_time_after_a_missing_mark_is_other():
    phases, total = phases_from_marks(T0, [("a", T0 + 1), ("b", None), ("c", T0 + 4)])
    assert phases == {"a": 1.0, "other": 3.0}
    assert sum(phases.values()) == total == 4.0


def test_the_breakdown_runs_from_the_driver_to_the_slowest_ranks_first_step():
    marks = [
        ("supervisor_spawn", T0 + 4.5),
        ("supervisor_imports", T0 + 9.0),
        ("supervisor_init", T0 + 9.2),
        ("slots", T0 + 10.0),
        ("worker_spawn", T0 + 10.5),
        ("worker_imports", T0 + 20.0),
        ("worker_entrypoint", T0 + 20.1),
        ("worker_warmup", T0 + 23.0),
        ("worker_attach", T0 + 23.2),
        ("preflight", T0 + 24.0),
        ("launch", T0 + 24.1),
    ]
    out = startup_breakdown(DRIVER, marks, _ranks(), spans={"agents": (T0 + 10.0, T0 + 15.0)})
    p = out["phases_s"]
    assert list(p) == [
        "ray_init",
        "driver",
        *(name for name, _ in marks),
        "rendezvous",
        "train_setup",
        "snapshot0",
        "first_step",
    ]
    assert p["ray_init"] == 4.0
    assert p["rendezvous"] == pytest.approx(1.4)  # launch -> the slower rank's rendezvous
    assert p["train_setup"] == pytest.approx(1.5)
    assert p["snapshot0"] == pytest.approx(0.1)
    assert p["first_step"] == pytest.approx(2.9)
    assert out["first_step_after_s"] == 30.0
    assert sum(p.values()) == pytest.approx(out["first_step_after_s"], abs=0.05)
    assert out["spans_s"] == {"agents": [10.0, 15.0]}


def test_without_every_ranks_first_step_the_breakdown_stops_at_the_launch():
    out = startup_breakdown(DRIVER, [("launch", T0 + 24.0)], None)
    assert out["first_step_after_s"] is None
    assert sum(out["phases_s"].values()) == pytest.approx(24.0)


def test_boot_summary_takes_each_steps_median_and_max():
    boots = {
        0: {"process_started": 0.0, "init": 5.0, "entrypoint_loaded": 5.5, "ready": 7.0},
        1: {"process_started": 1.0, "init": 4.0, "entrypoint_loaded": 4.5, "ready": 8.0},
    }
    assert boot_summary(boots) == {
        "worker_imports": {"median": 4.0, "max": 5.0},
        "worker_entrypoint": {"median": 0.5, "max": 0.5},
        "worker_warmup": {"median": 2.5, "max": 3.5},
    }


def test_the_clock_splits_the_wait_for_workers_by_the_slowest_boot_and_closes_once():
    clock = StartupClock()
    clock.driver = dict(DRIVER)
    clock.marks = [("supervisor_imports", T0 + 9.0)]
    clock.mark("slots", T0 + 10.0)
    clock.mark("slots", T0 + 11.0)  # a second mark of a phase keeps the first
    boots = {
        0: {
            "process_started": T0 + 11,
            "init": T0 + 15,
            "entrypoint_loaded": T0 + 16,
            "ready": T0 + 18,
        },
        1: {
            "process_started": T0 + 12,
            "init": T0 + 19,
            "entrypoint_loaded": T0 + 19.5,
            "ready": T0 + 22,
        },
    }
    clock.workers_ready(boots)
    assert [name for name, _ in clock.marks][-5:] == [
        "worker_spawn",
        "worker_imports",
        "worker_entrypoint",
        "worker_warmup",
        "worker_attach",
    ]
    assert dict(clock.marks)["worker_imports"] == T0 + 19  # rank 1's: it was ready last
    clock.mark("launch", T0 + 24.0)
    clock.generation = 1
    ranks = _ranks()
    assert clock.close(2, ranks, 2) is None  # another generation
    assert clock.close(1, ranks[:1], 2) is None  # not every rank yet
    unstepped = {k: v for k, v in ranks[1].items() if k != "first_step_done"}
    assert clock.close(1, [ranks[0], unstepped], 2) is None  # rank 1 has not stepped
    out = clock.close(1, ranks, 2)
    assert out is not None and out["slowest_worker"] == 1
    assert out["phases_s"]["slots"] == 1.0
    assert sum(out["phases_s"].values()) == pytest.approx(out["first_step_after_s"], abs=0.05)
    assert clock.close(1, ranks, 2) is None  # closed once
    assert clock.summary() is out

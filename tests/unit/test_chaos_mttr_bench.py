"""bench/chaos_mttr.py: the scenarios it runs are valid jobs, and its table reads its figures."""

from __future__ import annotations

from bench.chaos_mttr import KINDS, _stats, render, scenario_for
from stalwart.orchestrator.chaos.scenario import job_specs


def test_every_kinds_scenario_is_a_valid_job_with_its_repeats():
    for kind in KINDS:
        sc = scenario_for(kind, 3)
        clean, faulty = job_specs(sc)
        assert clean.chaos.faults == [] and clean.steps == faulty.steps == 180
        per_kill = 2 if kind == "kill_during_restore" else 1
        assert len(faulty.chaos.faults) == 3 * per_kill
        assert {f.at_step for f in faulty.chaos.faults} == {40, 80, 120}
    # A node per kill_node, so each repeat has room to replace the node's ranks.
    assert scenario_for("kill_node", 3).cluster.worker_nodes == 6


def test_stats_and_table():
    assert _stats([1.0, None, 3.0, 2.0]) == {"n": 3, "median": 2.0, "worst": 3.0}
    assert _stats([None]) == {"n": 0, "median": None, "worst": None}
    row = {
        "passed": True,
        "failed_checks": [],
        "detected_s": _stats([0.1, 0.2]),
        "recovered_s": _stats([0.5, 0.9]),
        "steps_lost": _stats([0, 1]),
    }
    res = {
        "stalwart": {"kill_worker": row, "hang": {**row, "passed": False, "failed_checks": ["x"]}},
        "raytrain": {"recovered_s": _stats([16.0, 18.0]), "steps_lost": _stats([10, 10])},
    }
    text = render(res)
    assert (
        "| kill_worker | 2 | 0.15 / 0.20 | 0.70 / 0.90 | 0.5 / 1 | 17.00 / 18.00 | 10 / 10 |"
        in text
    )
    assert "hang (FAILED: x)" in text and "no recovery of its own" in text
    # Ray Train's figures per kind (a node's loss too), the older form read as worker loss.
    res["stalwart"]["kill_node"] = row
    res["raytrain"] = {
        "kill_worker": {"recovered_s": _stats([16.0]), "steps_lost": _stats([10])},
        "kill_node": {"recovered_s": _stats([30.0, 50.0]), "steps_lost": _stats([12, 18])},
    }
    text = render(res)
    assert (
        "| kill_node | 2 | 0.15 / 0.20 | 0.70 / 0.90 | 0.5 / 1 | 40.00 / 50.00 | 15 / 18 |" in text
    )

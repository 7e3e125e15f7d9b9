"""Faults of Ray itself, through `stalwart chaos run`'s runner on the local cluster it starts
(a GCS restart needs the cluster's own handle, and with GCS fault tolerance a Redis beside
its head): the GCS restarted under a running job with fault tolerance (trained through)
and without (the cluster lost, the job resumed from storage on a new one). The raylet kill
is a job fault: test_scenarios.py runs it with the other examples."""

from __future__ import annotations

import json

import pytest

from stalwart.orchestrator.chaos.runner import ChaosOptions, run_scenario
from stalwart.orchestrator.chaos.scenario import load_scenario
from tests.chaos.test_scenarios import EXAMPLES, _failed, _of

pytestmark = [pytest.mark.component, pytest.mark.timeout(900)]

RAY_RUN = ("restart-gcs-ft", "restart-gcs")


def _run(name, cache, tmp_path):
    opts = ChaosOptions(output=tmp_path / name, base_dir=str(EXAMPLES), cache_dir=cache)
    verdict = run_scenario(load_scenario(EXAMPLES / f"{name}.yaml"), opts)
    assert verdict.passed, _failed(verdict)
    assert [r.outcome for r in verdict.faults] == ["injected"]
    return verdict


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_gcs_restarted_with_fault_tolerance_is_trained_through(cache, tmp_path):
    verdict = _run("restart-gcs-ft", cache, tmp_path)
    result = json.loads((tmp_path / "restart-gcs-ft" / "chaos" / "result.json").read_text())
    events = _events(tmp_path / "restart-gcs-ft" / "chaos" / "events.jsonl")
    assert result["failures"] == [] and result["generations"] == 1
    [row] = verdict.faults
    assert row.target == "head (GCS)" and row.noticed.startswith("1 window(s), 5.")
    # The control loop kept polling while the GCS was away (Ray's node table is read off
    # it): no spell of every node silent at once.
    assert _of(events, "supervisor_isolated") == []


def test_a_gcs_restarted_without_it_loses_the_cluster_and_the_job_resumes(cache, tmp_path):
    verdict = _run("restart-gcs", cache, tmp_path)
    out = tmp_path / "restart-gcs"
    lost = _events(out / "chaos" / "events.jsonl")
    # The first run's driver went with its cluster: no result of its own.
    assert not (out / "chaos" / "result.json").exists()
    persisted = max(e["step"] for e in _of(lost, "persisted"))
    [resume] = _of(_events(out / "resumed" / "events.jsonl"), "resume")
    # The newest step on storage when the cluster went: the lost run's log may end before
    # its last write did.
    assert resume["step"] >= persisted
    [check] = [c for c in verdict.checks if c.name == "resumed from the newest durable step"]
    assert check.ok and check.detail.startswith(f"step {resume['step']} (the newest")

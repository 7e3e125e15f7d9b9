"""Chaos on a real multi-node local Ray: every scenario in examples/chaos/ through the runner
of `stalwart chaos run` (its verdict is the assertion: finished, the failure-free digest,
steps lost and recovery time within the scenario's bounds), `stalwart chaos run` and
`stalwart chaos inject` as a user types them, and the opt-ins a cluster the command did not
start requires.

One cluster for the module (a CPU-less head and up to 4 worker nodes of 2 CPUs; nodes a
scenario kills are replaced before the next); one baseline cache, so each job's failure-free
run happens once.
"""

from __future__ import annotations

import json
import os
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from stalwart.orchestrator.chaos.runner import ChaosOptions, baseline_digest, run_scenario
from stalwart.orchestrator.chaos.scenario import job_specs, load_scenario
from stalwart.orchestrator.driver import RunOptions, run_job
from tests.component.conftest import REPO, stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(900)]

EXAMPLES = REPO / "examples" / "chaos"
SCENARIOS = sorted(p.stem for p in EXAMPLES.glob("*.yaml") if p.name != "job.yaml")


@pytest.fixture(scope="module")
def cluster():
    from tests.component.multinode import MultiNode

    mn = MultiNode()
    try:
        yield mn
    finally:
        mn.shutdown()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-cache")


def _failed(verdict) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in verdict.checks if not c.ok]


@pytest.mark.parametrize("name", SCENARIOS)
def test_example_scenario_passes(name, cluster, cache, tmp_path):
    sc = load_scenario(EXAMPLES / f"{name}.yaml")
    cluster.ensure_worker_nodes(max(3, sc.cluster.worker_nodes), exactly=True)
    opts = ChaosOptions(
        output=tmp_path / name,
        address=cluster.address,
        owns_cluster=True,  # this module started it
        base_dir=str(EXAMPLES),
        cache_dir=cache,
    )
    verdict = run_scenario(sc, opts)
    assert verdict.passed, _failed(verdict)
    assert all(row.outcome == "injected" for row in verdict.faults)
    on_disk = json.loads((tmp_path / name / "verdict.json").read_text())
    assert on_disk["passed"] is True and on_disk["scenario"] == name
    suite = ET.parse(tmp_path / name / "junit.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(verdict.checks)
    if name == "storm":
        assert len(verdict.faults) >= 12
        during = [r for r, f in zip(verdict.faults, sc.faults, strict=True) if f.get("during")]
        assert during and all(r.failures for r in during)


def test_chaos_run_cli_on_a_cluster_it_did_not_start(cluster, cache, tmp_path):
    """Refused without --allow-remote and chaos.enabled (before anything runs); with both,
    the verdict as JSON on stdout and as JUnit XML."""
    cluster.ensure_worker_nodes(3)
    env_cache = {"STALWART_CACHE_DIR": str(cache)}
    scenario = str(EXAMPLES / "kill-worker.yaml")
    refused = _cli(env_cache, "chaos", "run", scenario, address=cluster.address, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "--allow-remote" in refused.stderr and "chaos.enabled: true" in refused.stderr
    assert "Traceback" not in refused.stderr
    refused = _cli(
        env_cache, "chaos", "run", scenario, "--allow-remote", address=cluster.address, timeout=60
    )
    assert refused.returncode == 2 and "chaos.enabled: true" in refused.stderr
    assert "--allow-remote on" not in refused.stderr
    junit = tmp_path / "chaos.xml"
    done = _cli(
        env_cache,
        "chaos",
        "run",
        scenario,
        "--allow-remote",
        "--set",
        'job.set=["chaos.enabled=true"]',
        "-o",
        "json",
        "--junit",
        str(junit),
        "--output",
        str(tmp_path / "out"),
        address=cluster.address,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [verdict] = json.loads(done.stdout)
    assert verdict["passed"] and verdict["faults"][0]["outcome"] == "injected"
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "0" and root.find("testsuite").get("name") == "kill-worker"
    # On a cluster it did not start, a kill_node would spare the raylet; a kill_worker
    # kills the job's own process only.


def _cli(env: dict, *args: str, address: str, timeout: float):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return stalwart_cli(*args, address=address, timeout=timeout)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_for(path: Path, pred, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if pred(event):
                    return event
        time.sleep(0.2)
    raise AssertionError(f"no matching event in {path} within {timeout_s} s")


def test_chaos_inject_into_a_running_job(cluster, cache, tmp_path):
    """A job on a cluster its command did not start: an injection without --allow-remote
    is refused; with it, a kill_worker and a kill_node (which kills the job's processes on
    the node, never its raylet) are carried out, recorded with who asked, and recovered,
    ending with the failure-free model."""
    cluster.ensure_worker_nodes(4, exactly=True)
    sc = load_scenario(
        EXAMPLES / "storm.yaml",
        [
            "job.set=[steps=300, health.hang_timeout_s=6, "
            "failure.max_restarts=40, chaos.enabled=true]"
        ],
    )
    clean, faulty = job_specs(sc)
    job = faulty.model_copy(update={"chaos": faulty.chaos.model_copy(update={"faults": []})})
    assert job.chaos.enabled
    opts = ChaosOptions(
        output=tmp_path,
        address=cluster.address,
        owns_cluster=True,
        base_dir=str(EXAMPLES),
        cache_dir=cache,
    )
    digest = baseline_digest(clean, cluster.address, True, opts, lambda _m: None)
    out = tmp_path / "job"
    box: dict = {}

    def target():
        # Not owned: as on a user's shared cluster.
        box["result"] = run_job(job, RunOptions(address=cluster.address, output=out))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    events = out / "events.jsonl"
    _wait_for(events, lambda e: e["type"] == "state" and e["new"] == "RUNNING", 120)
    refused = stalwart_cli(
        "chaos",
        "inject",
        job.name,
        "--kind",
        "kill_worker",
        "--rank",
        "2",
        address=cluster.address,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--allow-remote" in refused.stderr and "Traceback" not in refused.stderr
    done = stalwart_cli(
        "chaos",
        "inject",
        job.name,
        "--kind",
        "kill_worker",
        "--rank",
        "2",
        "--allow-remote",
        "-o",
        "json",
        address=cluster.address,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)
    assert first["kind"] == "kill_worker" and first["rank"] == 2 and first["live"]
    _wait_for(events, lambda e: e["type"] == "recovered", 120)
    raylets = [cluster._alive(n) for n in cluster.cluster.worker_nodes]
    # The node of rank 1, by a prefix of its id.
    sched = _wait_for(events, lambda e: e["type"] == "scheduled", 5)
    node = sched["workers"]["1"]["node_id"]
    second = stalwart_cli(
        "chaos",
        "inject",
        job.name,
        "--kind",
        "kill_node",
        "--node",
        node[:10],
        "--allow-remote",
        address=cluster.address,
        timeout=60,
    )
    assert second.returncode == 0, second.stderr
    assert "injected fault" in second.stdout
    thread.join(timeout=600)
    result = box["result"]
    assert result["status"] == "succeeded", result["error"]
    assert result["model_digest"] == digest
    log = [json.loads(line) for line in events.read_text().splitlines()]
    requested = [e for e in log if e["type"] == "fault_requested"]
    assert [e["kind"] for e in requested] == ["kill_worker", "kill_node"]
    assert all("@" in e["by"] for e in requested)
    fired = {e["index"] for e in log if e["type"] == "fault_injected"}
    assert {e["index"] for e in requested} <= fired
    [lost] = [e for e in log if e["type"] == "node_lost"]
    assert lost["node"] == node
    assert {f["fault_index"] for f in result["failures"]} == {e["index"] for e in requested}
    # Only the job's processes died there: the raylet still runs.
    assert [cluster._alive(n) for n in cluster.cluster.worker_nodes] == raylets

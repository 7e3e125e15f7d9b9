"""orchestrator/chaos: scenarios (loading, targets, the two job specs), the verdict, its
renderings, and the opt-ins a fault on somebody else's cluster needs."""

from __future__ import annotations

import json
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from stalwart.orchestrator.chaos.render import junit, table
from stalwart.orchestrator.chaos.runner import AlertWatch, baseline_key
from stalwart.orchestrator.chaos.scenario import job_specs, load_scenario
from stalwart.orchestrator.chaos.verdict import judge
from stalwart.orchestrator.driver import ChaosRefused, RunOptions, check_chaos_allowed
from stalwart.orchestrator.spec import SpecError, validate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "chaos"

JOB = """\
name: tiny
entrypoint: stalwart.examples.gpt.train:train_loop
workers: 4
resources: {cpu: 1}
steps: 100
"""


def _scenario(tmp_path: Path, body: str, job: str = JOB) -> Path:
    (tmp_path / "job.yaml").write_text(job)
    path = tmp_path / "s.yaml"
    path.write_text(body)
    return path


def test_every_example_scenario_loads_and_builds_its_jobs():
    paths = sorted(EXAMPLES.glob("*.yaml"))
    scenarios = [p for p in paths if p.name != "job.yaml"]
    assert len(scenarios) >= 5
    for path in scenarios:
        sc = load_scenario(path)
        clean, faulty = job_specs(sc)
        assert clean.chaos.faults == []
        steps, timed = sc.resolved(faulty.max_workers)
        assert len(faulty.chaos.faults) == len(steps)
        outside = len(sc.network_faults(faulty.max_workers)) + len(sc.ray_faults())
        assert len(steps) + len(timed) + outside >= 1
        assert clean.name.endswith("-baseline") and faulty.name.endswith("-chaos")
        # Both are the same job but for the faults, and for what only keeps the job alive
        # through them: the baseline starts no spare or standby, writes no durable
        # checkpoint (nor resumes from one), copies nothing to peers and snapshots once.
        assert (clean.failure.spares, clean.failure.standby) == (0, False)
        assert clean.checkpoint.persist.uri is None
        assert (clean.checkpoint.replicas, clean.checkpoint.every_steps) == (1, clean.steps)
        assert clean.checkpoint.init_from == faulty.checkpoint.init_from
        a = clean.model_dump(exclude={"name", "chaos"})
        b = faulty.model_dump(exclude={"name", "chaos"})
        for spec in (a, b):
            del spec["failure"]["spares"], spec["failure"]["standby"]
            del spec["checkpoint"]
        assert a == b, path


def test_specs_that_differ_only_in_how_the_job_is_kept_alive_share_a_baseline():
    base = {**yaml.safe_load(JOB), "config": {"lr": 0.003}}
    key = baseline_key(validate(base), None)
    operational = [
        {"placement": "SPREAD"},
        {"checkpoint": {"every_steps": 5, "replicas": 3, "shm_dir": "/tmp/x"}},
        {"failure": {"spares": 0, "max_restarts": 40}},
        {"health": {"hang_timeout_s": 5}},
        {"chaos": {"enabled": True}},
        {"output_dir": "/tmp/out"},
    ]
    for change in operational:
        assert baseline_key(validate({**base, **change}), None) == key, change
    assert baseline_key(validate({**base, "name": "another"}), None) == key
    computing = [
        {"steps": 101},
        {"seed": 1},
        {"workers": 2},
        {"config": {"lr": 0.001}},
        # In the checkpoint section, but the weights the job starts from.
        {"checkpoint": {"init_from": "/tmp/another-jobs-step"}},
    ]
    for change in computing:
        assert baseline_key(validate({**base, **change}), None) != key, change


def test_random_rank_is_drawn_with_the_seed(tmp_path):
    body = "name: r\njob: {spec: job.yaml}\nseed: %d\nfaults:\n" + "".join(
        f"  - {{kind: kill_worker, rank: random, at_step: {10 + i}}}\n" for i in range(6)
    )
    ranks = {}
    for seed in (1, 1, 2):
        sc = load_scenario(_scenario(tmp_path, body % seed))
        ranks.setdefault(seed, []).append([f.rank for f in job_specs(sc)[1].chaos.faults])
    assert ranks[1][0] == ranks[1][1]
    assert all(0 <= r < 4 for r in ranks[1][0])
    assert ranks[1][0] != ranks[2][0]


def test_bad_scenarios_name_the_field(tmp_path):
    with pytest.raises(SpecError) as e:
        load_scenario(_scenario(tmp_path, "name: x\njob: {spec: job.yaml}\nfaults: []\nbogus: 1\n"))
    assert any("bogus: unknown field" in m for m in e.value.errors)
    assert any(m.startswith("faults:") for m in e.value.errors)
    # A fault wrong for the job (rank 9 of 4 workers) names the scenario's fault.
    sc = load_scenario(
        _scenario(
            tmp_path,
            "name: x\njob: {spec: job.yaml}\nfaults:\n"
            "  - {kind: kill_worker, rank: 9, at_step: 5}\n",
        )
    )
    with pytest.raises(SpecError) as e:
        job_specs(sc)
    assert e.value.source.endswith("s.yaml")
    assert e.value.errors == ["faults.0.rank: must be < workers (4), got 9"]
    sc = load_scenario(_scenario(tmp_path, "name: x\njob: {spec: missing.yaml}\nfaults: [{}]\n"))
    with pytest.raises(SpecError) as e:
        job_specs(sc)
    assert "cannot read" in e.value.errors[0] and "missing.yaml" in e.value.errors[0]
    with pytest.raises(SpecError) as e:
        load_scenario(tmp_path / "nope.yaml")
    assert e.value.errors[0].startswith("cannot read")


def test_overrides_reach_the_job_and_chaos_enabled_stays_the_specs(tmp_path):
    body = (
        "name: o\njob: {spec: job.yaml, set: [steps=50, chaos.enabled=true]}\n"
        "faults: [{kind: hang, rank: 0, at_step: 10}]\n"
    )
    clean, faulty = job_specs(load_scenario(_scenario(tmp_path, body)))
    assert clean.steps == faulty.steps == 50
    assert faulty.chaos.enabled
    body = "name: o\njob: {spec: job.yaml}\nfaults: [{kind: hang, rank: 0, at_step: 10}]\n"
    assert not job_specs(load_scenario(_scenario(tmp_path, body)))[1].chaos.enabled


# --- the verdict ----------------------------------------------------------------------------


def _failure(index, rank, *, redone=0, restored=30, recovered=1.5, tiers=None):
    return {
        "kind": "worker_died",
        "rank": rank,
        "step": 30,
        "injected": True,
        "fault_index": index,
        "detected_after_s": 0.1,
        "recovered_after_s": recovered,
        "steps_redone": redone,
        "restored_step": restored,
        "restore_tiers": tiers or {"memory": 4},
    }


def _run(tmp_path, faults, failures, *, status="succeeded", digest="d" * 64, events=()):
    body = "name: v\njob: {spec: job.yaml}\nfaults:\n" + "".join(
        f"  - {json.dumps(f)}\n" for f in faults
    )
    body += "expect: {max_steps_lost_per_failure: 1, max_recovery_seconds: {default: 5}}\n"
    sc = load_scenario(_scenario(tmp_path, body))
    spec_faults = [f.model_dump(mode="json") for f in job_specs(sc)[1].chaos.faults]
    result = {
        "status": status,
        "model_digest": digest,
        "failures": failures,
        "steps_completed": 100,
        "wall_seconds": 12.0,
        "error": None if status == "succeeded" else {"message": "boom"},
    }
    injected = [
        {"type": "fault_injected", "index": i, "ts": 100.0 + i, "at": 100.0 + i}
        for i in range(len(faults))
    ]
    return sc, spec_faults, result, injected + list(events)


def test_a_clean_recovery_passes(tmp_path):
    faults = [{"kind": "kill_worker", "rank": 1, "at_step": 30}]
    sc, f, result, events = _run(tmp_path, faults, [_failure(0, 1)])
    v = judge(sc, f, result, events, "d" * 64)
    assert v.passed, v.checks
    row = v.faults[0]
    assert (row.outcome, row.steps_lost, row.restored_step, row.tiers) == (
        "injected",
        0,
        30,
        {"memory": 4},
    )


def test_each_broken_expectation_fails_with_its_reason(tmp_path):
    faults = [
        {"kind": "kill_worker", "rank": 1, "at_step": 30},
        {"kind": "kill_node", "rank": 2, "at_step": 50},
        {"kind": "hang", "rank": 3, "at_step": 70},
    ]
    failures = [
        _failure(0, 1, redone=3, recovered=9.0),
        _failure(1, 2, redone=50, restored=None),
    ]
    refused = {"type": "fault_refused", "index": 1, "ts": 1, "reason": "supervisor's node"}
    sc, f, result, events = _run(tmp_path, faults, failures, digest="e" * 64)
    events = [e for e in events if e["index"] != 2]  # the hang never fired
    v = judge(sc, f, result, events, "d" * 64)
    assert not v.passed
    bad = {c.name: c.detail for c in v.checks if not c.ok}
    assert "identical model" in bad
    assert bad["fault 0 (kill_worker): steps lost"] == "3 (at most 1)"
    assert bad["fault 0 (kill_worker): recovery time"] == "9.00 s (at most 5 s)"
    assert bad["fault 2 (hang): injected"] == "not fired"
    assert "sent the job back to step 0" in bad["no restart from step 0"]
    events = [e for e in events if e["index"] != 1]
    v = judge(sc, f, result, [*events, refused], "d" * 64)
    assert v.faults[1].outcome.startswith("refused: supervisor's node")


def test_a_failed_job_and_missing_alerts_fail(tmp_path):
    faults = [{"kind": "slow", "rank": 1, "at_step": 10, "factor": 3}]
    sc, f, result, events = _run(tmp_path, faults, [], status="failed")
    sc.expect.alerts = ["StalwartGoodputLow"]
    v = judge(sc, f, result, events, "d" * 64)
    bad = {c.name: c.detail for c in v.checks if not c.ok}
    assert bad["finishes"] == "status failed: boom"
    assert bad["fault 0 (slow): noticed"] == "no straggler event followed"
    assert "no --prometheus URL" in bad["alerts"]
    flagged = {"type": "straggler", "ts": 104.0, "ranks": [1]}
    v = judge(sc, f, result, [*events, flagged], "d" * 64, alerts={"StalwartGoodputLow": 30.0})
    bad = {c.name for c in v.checks if not c.ok}
    assert bad == {"finishes"}
    assert v.faults[0].noticed == "straggler after 4.0 s"
    # Prometheus did not answer: the check says so instead of "never fired".
    v = judge(sc, f, result, events, "d" * 64, alerts={}, alerts_error="cannot query: refused")
    bad = {c.name: c.detail for c in v.checks if not c.ok}
    assert bad["alert StalwartGoodputLow"] == "not seen firing: cannot query: refused"


def test_the_alert_watch_reports_a_prometheus_it_cannot_reach():
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    watch = AlertWatch(f"http://127.0.0.1:{port}", "job", time.time())
    assert watch.finish(["StalwartWorkerLost"], within_s=2.5) == {}
    assert watch.error.startswith(f"cannot query Prometheus at http://127.0.0.1:{port}: ")


def test_renderings(tmp_path):
    faults = [
        {"kind": "kill_worker", "rank": 1, "at_step": 30},
        {"kind": "kill_node", "rank": 2, "at_step": 50},
    ]
    failures = [_failure(0, 1), _failure(1, 2, redone=40, restored=None)]
    sc, f, result, events = _run(tmp_path, faults, failures)
    ok = judge(sc, f, result, events, "d" * 64)
    sc2, f2, result2, events2 = _run(tmp_path, faults[:1], [_failure(0, 1)])
    good = judge(sc2, f2, result2, events2, "d" * 64)
    console = Console(width=80, record=True)
    console.print(table(ok))
    assert max(len(line) for line in console.export_text().splitlines()) <= 80
    console = Console(width=160, record=True)
    console.print(table(ok))
    text = console.export_text()
    assert "FAIL" in text and "nothing: step 0" in text and "step 30, memory x4" in text
    root = ET.fromstring(junit([ok, good]))
    assert root.tag == "testsuites"
    assert root.get("tests") == str(len(ok.checks) + len(good.checks))
    assert root.get("failures") == str(sum(not c.ok for c in ok.checks))
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["v", "v"]
    failed = [c for c in suites[0].findall("testcase") if c.find("failure") is not None]
    assert {c.get("name") for c in failed} == {
        "fault 1 (kill_node): steps lost",
        "no restart from step 0",
    }
    assert "kill_node rank 2" in suites[0].find("system-out").text
    json.dumps(ok.to_dict())  # -o json


# --- opt-ins --------------------------------------------------------------------------------


def test_remote_faults_need_both_opt_ins(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    data = {
        "name": "j",
        "entrypoint": "m:f",
        "workers": 2,
        "steps": 10,
        "chaos": {"faults": [{"kind": "kill_worker", "rank": 0, "at_step": 5}]},
    }
    spec = validate(data)
    check_chaos_allowed(spec, RunOptions())  # embedded: ours
    check_chaos_allowed(spec, RunOptions(address="10.0.0.1:6379", owns_cluster=True))
    with pytest.raises(ChaosRefused) as e:
        check_chaos_allowed(spec, RunOptions(address="10.0.0.1:6379"))
    assert "chaos.enabled: true" in str(e.value) and "--allow-remote" in str(e.value)
    with pytest.raises(ChaosRefused) as e:
        check_chaos_allowed(spec, RunOptions(address="10.0.0.1:6379", allow_remote_chaos=True))
    assert "--allow-remote" not in str(e.value)
    enabled = validate({**data, "chaos": {**data["chaos"], "enabled": True}})
    with pytest.raises(ChaosRefused) as e:
        check_chaos_allowed(enabled, RunOptions(address="10.0.0.1:6379"))
    assert "chaos.enabled" not in str(e.value)
    check_chaos_allowed(enabled, RunOptions(address="10.0.0.1:6379", allow_remote_chaos=True))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ChaosRefused):
        check_chaos_allowed(spec, RunOptions())
    check_chaos_allowed(validate({**data, "chaos": {"faults": []}}), RunOptions())


def test_memory_flat_after_the_last_fault(tmp_path):
    faults = [{"kind": "kill_supervisor", "rank": 0, "at_step": 10}]
    sc, f, result, events = _run(tmp_path, faults, [])
    sc.expect.memory_flat = True

    def run_with(held):
        readings = [
            {"type": "throughput", "ts": 200.0 + i, "memory_bytes": b} for i, b in enumerate(held)
        ]
        v = judge(sc, f, result, [*events, *readings], "d" * 64)
        return next(c for c in v.checks if c.name == "memory flat")

    flat = run_with([50 << 20] * 40)
    assert flat.ok, flat.detail
    # A sawtooth (the commit lag and the copies' stride), with its highest spike late.
    saw = run_with([(11 + 5 * (i % 4) + (20 if i == 33 else 0)) << 20 for i in range(40)])
    assert saw.ok, saw.detail
    leak = run_with([(50 + 2 * i) << 20 for i in range(40)])
    assert not leak.ok and "MiB" in leak.detail
    few = run_with([50 << 20] * 3)
    assert not few.ok and "too few" in few.detail


def test_timed_faults_are_drawn_with_the_seed(tmp_path):
    body = (
        "name: t\njob: {spec: job.yaml}\nseed: %d\nfaults:\n"
        "  - {kind: kill_worker, rank: 1, at_step: 10}\n"
        "  - {kind: kill_worker, rank: random, after_seconds: 4}\n"
        "  - {kind: hang, rank: 2, every_seconds: 5, jitter_s: 1, count: 4}\n"
        "  - {kind: kill_worker, rank: 0, at_step: 20, probability: 0.0}\n"
    )
    sc = load_scenario(_scenario(tmp_path, body % 1))
    steps, timed = sc.resolved(4)
    assert [f["at_step"] for f in steps] == [10]  # probability 0: never
    assert [t.fault["kind"] for t in timed] == ["kill_worker"] + ["hang"] * 4
    offsets = [t.after_s for t in timed]
    assert offsets[0] == 4.0 and offsets == sorted(offsets)
    hangs = offsets[1:]
    gaps = [b - a for a, b in zip([0.0, *hangs], hangs, strict=False)]
    assert all(3.0 <= g <= 7.0 for g in gaps), gaps  # every 5 s, jitter 1 s each side
    assert sc.resolved(4) == (steps, timed)  # the same seed, the same faults
    assert load_scenario(_scenario(tmp_path, body % 2)).resolved(4)[1] != timed
    # A timed fault's own fields are checked like a step fault's.
    bad = (
        "name: t\njob: {spec: job.yaml}\nfaults:\n  - {kind: gpu_xid, rank: 1, after_seconds: 3}\n"
    )
    with pytest.raises(SpecError) as e:
        job_specs(load_scenario(_scenario(tmp_path, bad)))
    assert any("xid" in m for m in e.value.errors)


def test_ray_faults_name_the_field_and_the_cluster_they_need(tmp_path):
    def errors(body: str) -> list[str]:
        with pytest.raises(SpecError) as e:
            load_scenario(_scenario(tmp_path, "name: x\njob: {spec: job.yaml}\n" + body))
        return e.value.errors

    gcs = "{kind: restart_gcs, at_step: 5, down_s: 5}"
    [msg] = errors(f"faults: [{gcs}]\n")  # the embedded Ray has no GCS to restart alone
    assert msg.startswith("faults.0: a restart_gcs fault needs the local cluster")
    [msg] = errors(f"cluster: {{worker_nodes: 2, network: netns}}\nfaults: [{gcs}]\n")
    assert "network: loopback" in msg
    [msg] = errors("cluster: {worker_nodes: 2}\nfaults: [{kind: restart_gcs, down_s: 0}]\n")
    assert msg == "faults.0: down_s: must be > 0.0, got 0"
    [msg] = errors("cluster: {worker_nodes: 2}\nfaults: [{kind: restart_gcs}]\n")
    assert "name one of `at_step` or `after_seconds`" in msg
    both = f"[{gcs}, {{kind: kill_worker, rank: 1, at_step: 3}}]"
    [msg] = errors(f"cluster: {{worker_nodes: 2}}\nfaults: {both}\n")
    assert "without cluster.gcs_ft a restart_gcs loses the whole cluster" in msg
    # With GCS fault tolerance it may come with the job's own faults.
    sc = load_scenario(
        _scenario(
            tmp_path,
            f"name: x\njob: {{spec: job.yaml}}\ncluster: {{worker_nodes: 2, gcs_ft: true}}\n"
            f"faults: {both}\n",
        )
    )
    assert [f.kind for f in sc.ray_faults()] == ["restart_gcs"]
    assert [f["kind"] for f in sc.resolved_faults(4)] == ["kill_worker"]
    # Only on the local cluster the command starts: refused at --address, before anything
    # runs (no baseline, no connection).
    from stalwart.orchestrator.chaos.runner import ChaosOptions, run_scenario

    with pytest.raises(ChaosRefused) as e:
        run_scenario(sc, ChaosOptions(output=tmp_path / "out", address="127.0.0.1:1"))
    assert "restart_gcs is carried out on the local cluster this command starts" in str(e.value)


def test_a_gcs_ft_scenario_without_redis_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from stalwart.orchestrator.chaos import ray_faults
    from stalwart.orchestrator.cli import main

    real_which = ray_faults.shutil.which
    monkeypatch.setattr(
        ray_faults.shutil, "which", lambda n: None if n == "redis-server" else real_which(n)
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _scenario(
        tmp_path,
        "name: x\njob: {spec: job.yaml}\ncluster: {worker_nodes: 1, gcs_ft: true}\n"
        "faults: [{kind: restart_gcs, at_step: 5}]\n",
    )
    result = CliRunner().invoke(
        main, ["chaos", "run", str(path), "--run-dir", str(tmp_path / "out")]
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "cluster.gcs_ft needs redis-server" in result.stderr

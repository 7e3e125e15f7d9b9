"""A real Prometheus scrapes a real job's exporter through injected failures, with
stalwart's rules loaded: the metrics are there, and the alerts for the faults fire."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

from stalwart.dashboards.definitions import ALL
from stalwart.orchestrator.observe.report import build_report
from tests.component.conftest import HEAVIER, make_runner, small_spec
from tests.component.prometheus import Prometheus

pytestmark = [pytest.mark.component, pytest.mark.timeout(400)]

LONG = 100_000  # steps: more than any check needs; the jobs are cancelled after them
RULES = Path(__file__).resolve().parents[2] / "dashboards" / "rules" / "stalwart.rules.yml"


@pytest.fixture
def file_sd(tmp_path):
    # There before Prometheus starts, as in a deployment: it watches the folder for files.
    (tmp_path / "file_sd").mkdir()
    return tmp_path / "file_sd"


@pytest.fixture
def prometheus(tmp_path, file_sd):
    # No target of its own: it finds each job's exporter, on a port picked at random, in
    # the target file the job writes into file_sd (metrics.file_sd_dir).
    prom = Prometheus(tmp_path / "prometheus", [], [RULES], file_sd=file_sd)
    yield prom
    prom.stop()
    assert not (tmp_path / "prometheus" / "data").exists()


_STARTED: list[tuple[str, threading.Thread]] = []


def _run_in_background(run, spec):
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=run(spec)), daemon=True)
    job.start()
    _STARTED.append((spec["name"], job))
    return job, box


@pytest.fixture(autouse=True)
def _no_job_left_running():
    """A test that fails while its job runs (a long one, cancelled only once everything
    was checked) cancels it on the way out: left polling from a thread of this process,
    it broke the Ray driver state of every later test in the session (their supervisors
    "died unexpectedly", 14 failures after one here)."""
    yield
    while _STARTED:
        name, job = _STARTED.pop()
        if job.is_alive():
            with contextlib.suppress(Exception):
                _cancel(name, job)


def _cancel(name: str, job: threading.Thread) -> None:
    """Cancel a running job (as Ctrl-C on `stalwart run` does) and wait for its result."""
    import ray

    ray.get_actor(f"stalwart-{name}", namespace="stalwart").cancel.remote()
    job.join(timeout=120)
    assert not job.is_alive(), f"job {name} did not end within 120 s of its cancel"


def _panel_queries():
    for name, make in ALL.items():
        for panel in make()["panels"]:
            for target in panel.get("targets", ()):
                yield name, panel["title"], target["expr"]


def _every_panel_has_data(prometheus, train_job: str, job: threading.Thread) -> None:
    """Every dashboard panel's query, its variables filled in, returns data while the job
    runs."""
    for board, panel, expr in _panel_queries():
        promql = (
            expr.replace("$train_job", train_job)
            .replace("$__rate_interval", "10s")
            .replace("$__range", "5m")
        )
        assert job.is_alive(), f"job {train_job} ended before {board} / {panel} was checked"
        prometheus.wait_for(promql, timeout_s=30)


def test_real_prometheus_scrapes_the_job_and_the_fault_alerts_fire(
    run, prometheus, file_sd, tmp_path
):
    metrics = {"port": 0, "linger_s": 4, "file_sd_dir": str(file_sd)}
    # Job A recovers from a killed worker and from a GPU's application Xid, persists
    # checkpoints, and is left with one restart.
    spec_a = small_spec(
        name="prom-a",
        steps=LONG,  # cancelled once everything was checked
        metrics=metrics,
        health__gpu={"probe": "fake"},
        failure__max_restarts=3,
        checkpoint__persist={"uri": str(tmp_path / "durable"), "every_steps": 20},
        chaos__faults=[
            {"kind": "kill_worker", "rank": 1, "at_step": 20},
            {"kind": "gpu_xid", "rank": 2, "xid": 13, "at_step": 60},
        ],
    )
    job, box = _run_in_background(run, spec_a)
    up = prometheus.wait_for('up{job="stalwart"} == 1', timeout_s=120)
    (target,) = json.loads((file_sd / "stalwart-prom-a.json").read_text())
    assert up[0]["metric"]["instance"] == target["targets"][0]
    assert up[0]["metric"]["stalwart_name"] == "prom-a"
    fired = prometheus.wait_for(
        'ALERTS{alertname="StalwartRestartBudgetLow",alertstate="firing",train_job="prom-a"}',
        timeout_s=120,
    )
    assert fired[0]["metric"]["severity"] == "ticket"
    # Every dashboard panel's query, its variables filled in, has data while the job runs.
    prometheus.wait_for('stalwart_recoveries_total{train_job="prom-a"} == 2', timeout_s=120)
    # Persistence runs beside training, as far behind as its writes take: waited for.
    prometheus.wait_for('stalwart_persisted_step{train_job="prom-a"} >= 40', timeout_s=120)
    _every_panel_has_data(prometheus, "prom-a", job)
    _cancel("prom-a", job)
    assert box["result"]["status"] == "cancelled", box["result"]["error"]
    # The same run as pictures (`stalwart report`): every figure of a run with failures.
    report = build_report(box["result"]["output"])
    assert sorted(p.name for p in report) == [
        "checkpoints.png",
        "goodput.png",
        "index.html",
        "recovery_phases.png",
        "step_time_heatmap.png",
        "timeline.png",
    ]
    assert report.warnings == []
    window = "[5m]"
    a = 'train_job="prom-a"'
    for promql in (
        f'max_over_time(stalwart_failures_total{{{a},kind="worker_died"}}{window}) == 1',
        f'max_over_time(stalwart_failures_total{{{a},kind="gpu_error"}}{window}) == 1',
        f'max_over_time(stalwart_recoveries_total{{{a},outcome="recovered"}}{window}) == 2',
        f"max_over_time(stalwart_step{{{a}}}{window}) >= 60",
        f"max_over_time(stalwart_persisted_step{{{a}}}{window}) >= 40",
        f'max_over_time(stalwart_job_state{{{a},state="CANCELLED"}}{window}) == 1',
        f"max_over_time(stalwart_samples_total{{{a}}}{window}) > 0",
        f'max_over_time(stalwart_train_metric{{{a},name="loss"}}{window}) > 0',
        f"max_over_time(stalwart_recovery_duration_seconds_count{{{a}}}{window}) == 2",
        f"max_over_time(stalwart_productive_seconds_total{{{a}}}{window}) > 0",
        f"count(max_over_time(stalwart_heartbeat_age_seconds{{{a}}}{window})) == 4",
        f"histogram_quantile(0.5, sum by (le) (max_over_time("
        f"stalwart_step_duration_seconds_bucket{{{a}}}{window}))) > 0",
    ):
        assert prometheus.query(promql), f"no data: {promql}"

    # Job B has no restart budget: the kill fails it, and the linger lets Prometheus see it
    # (two ranks: that alert does not depend on the world's size).
    spec_b = small_spec(
        name="prom-b",
        workers=2,
        steps=150,
        metrics=metrics,
        failure__max_restarts=0,
        chaos__faults=[{"kind": "kill_worker", "rank": 1, "at_step": 10}],
    )
    job, box = _run_in_background(run, spec_b)
    failed = prometheus.wait_for(
        'ALERTS{alertname="StalwartJobFailed",alertstate="firing",train_job="prom-b"}',
        timeout_s=180,
    )
    assert failed[0]["metric"]["severity"] == "page"
    job.join(timeout=120)
    assert box["result"]["status"] == "failed"
    # The target files go once the exporters stopped serving (metrics.linger_s after).
    deadline = time.monotonic() + 60
    while list(file_sd.glob("*.json")):
        assert time.monotonic() < deadline, list(file_sd.glob("*.json"))
        time.sleep(0.5)  # the supervisor's linger timer, bounded by the deadline


def test_real_prometheus_sees_a_lost_node_a_fatal_xid_and_a_straggler(
    multinode, prometheus, file_sd, tmp_path
):
    """Job C, on a multi-node cluster: a node is killed, a GPU reports a fatal Xid (its node
    is cordoned) and a rank turns slow (policy alert: flagged, kept)."""
    multinode.ensure_worker_nodes(4)  # room for 4 ranks after one node is lost, one cordoned
    run = make_runner(multinode.address, tmp_path)
    spec = small_spec(
        name="prom-c",
        steps=LONG,  # cancelled once everything was checked
        metrics={"port": 0, "linger_s": 4, "file_sd_dir": str(file_sd)},
        health__gpu={"probe": "fake"},
        failure__max_restarts=5,
        checkpoint__every_steps=5,
        checkpoint__persist={"uri": str(tmp_path / "durable"), "every_steps": 20},
        # Compute, not a busy two-core machine's scheduling, should dominate a step here.
        config__batch_size=HEAVIER["batch_size"],
        config__model=HEAVIER["model"],
        health__straggler={"policy": "alert"},
        chaos__faults=[
            {"kind": "kill_node", "rank": 1, "at_step": 15},
            {"kind": "gpu_xid", "rank": 2, "xid": 79, "at_step": 35},
            {"kind": "slow", "rank": 3, "at_step": 60, "factor": 3},
        ],
    )
    job, box = _run_in_background(run, spec)
    c = 'train_job="prom-c"'
    xid = prometheus.wait_for(
        f'ALERTS{{alertname="StalwartFatalGpuXid",alertstate="firing",{c}}}', timeout_s=180
    )
    assert xid[0]["metric"]["severity"] == "page"
    prometheus.wait_for(f'stalwart_gpu_xid_total{{{c},xid="79"}} == 1', timeout_s=30)
    prometheus.wait_for(f'stalwart_failures_total{{{c},kind="node_lost"}} >= 1', timeout_s=30)
    # The straggler rule holds for 10 minutes before it fires: here it must be pending, on
    # the slow rank and only on it.
    pending = prometheus.wait_for(
        f'ALERTS{{alertname="StalwartStragglerPersistent",alertstate="pending",{c}}}',
        timeout_s=120,
    )
    assert {p["metric"]["rank"] for p in pending} == {"3"}, pending
    # The detector's own flag (two slow windows spanning 3 s) follows the score.
    prometheus.wait_for(f"stalwart_stragglers_flagged_total{{{c}}} >= 1", timeout_s=120)
    prometheus.wait_for(
        f'stalwart_checkpoint_duration_seconds_count{{{c},tier="peer"}} > 0', timeout_s=30
    )
    _every_panel_has_data(prometheus, "prom-c", job)
    _cancel("prom-c", job)
    result = box["result"]
    assert result["status"] == "cancelled", result["error"]
    assert {f["kind"] for f in result["failures"]} >= {"node_lost", "gpu_fatal"}
    # Flagged, and again after a calm spell if it recurs: only ever rank 3.
    assert {s["rank"] for s in result["stragglers"]} == {3}, result["stragglers"]
    window = "[5m]"
    for promql in (
        f"max_over_time(stalwart_stragglers_flagged_total{{{c}}}{window}) >= 1",
        f"max_over_time(stalwart_cordoned_nodes{{{c}}}{window}) >= 1",
        f"max_over_time(stalwart_gpu_temperature_celsius{{{c}}}{window}) > 0",
        f'max_over_time(stalwart_failures_total{{{c},kind="gpu_fatal"}}{window}) >= 1',
    ):
        assert prometheus.query(promql), f"no data: {promql}"

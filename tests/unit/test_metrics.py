"""orchestrator/observe/metric_defs.py and orchestrator/observe/metrics.py: definitions, naming
rules, event and refresh updates, the exporter over real HTTP on loopback, and docs/metrics.md
being current."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from stalwart.orchestrator.observe.metric_defs import DEFINITIONS, JOB_STATES, render_docs
from stalwart.orchestrator.observe.metrics import JobMetrics
from stalwart.orchestrator.state import JobState

REPO = Path(__file__).resolve().parents[2]
JOB = "demo"


def value(m: JobMetrics, metric: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(metric, {"train_job": JOB, **labels})


def test_docs_are_generated_from_the_definitions():
    assert (REPO / "docs" / "metrics.md").read_text() == render_docs(), (
        "docs/metrics.md is stale: "
        "run `python -m stalwart.orchestrator.observe.metric_defs > docs/metrics.md`"
    )


@pytest.mark.parametrize("d", DEFINITIONS, ids=lambda d: d.name)
def test_names_follow_the_conventions(d):
    assert re.fullmatch(r"stalwart_[a-z0-9_]+", d.name)
    assert (d.kind == "counter") == d.name.endswith("_total")
    assert "step" not in d.labels and "job" not in d.labels and "train_job" not in d.labels
    if d.kind == "histogram":
        assert d.name.endswith(("_seconds", "_bytes")), "histograms carry their base unit"
    assert d.help and not d.help[0].isupper()


def test_names_are_unique():
    names = [d.name for d in DEFINITIONS]
    assert len(names) == len(set(names))


def test_counters_start_at_zero_and_gauges_appear_with_a_value():
    m = JobMetrics(JOB)
    assert value(m, "stalwart_steps_redone_total") == 0
    assert value(m, "stalwart_recovery_duration_seconds_count") == 0
    # No durable checkpoint yet: no series (a 0 would read as "persisted at 1970").
    assert value(m, "stalwart_persisted_timestamp_seconds") is None
    assert value(m, "stalwart_committed_timestamp_seconds") is None


def test_the_state_series_are_the_state_machines_states():
    assert set(JOB_STATES) == {s.value for s in JobState}


def test_job_state_is_one_series_per_state():
    m = JobMetrics(JOB)
    assert value(m, "stalwart_job_state", state="PENDING") == 1
    m.on_event({"type": "state", "ts": 10.0, "old": "PENDING", "new": "RUNNING"})
    assert [value(m, "stalwart_job_state", state=s) for s in JOB_STATES] == [
        1 if s == "RUNNING" else 0 for s in JOB_STATES
    ]


def test_failures_recoveries_and_phases_from_events():
    m = JobMetrics(JOB)
    m.count_failures(["worker_died", "node_lost", "node_lost"])
    m.on_event(
        {
            "type": "recovered",
            "ts": 2.0,
            "recovered_after_s": [0.8, 1.2],
            "phases_s": {"abort": 0.05, "restore": 0.3, "first_step": 0.4},
            "detected_after_s": [0.1, None],  # the second failure was not injected
            "decided_after_s": [0.01, 0.02],
        }
    )
    assert value(m, "stalwart_failures_total", kind="worker_died") == 1
    assert value(m, "stalwart_failures_total", kind="node_lost") == 2
    assert value(m, "stalwart_recoveries_total", outcome="recovered") == 1
    assert value(m, "stalwart_recovery_duration_seconds_count") == 2
    assert value(m, "stalwart_recovery_duration_seconds_sum") == pytest.approx(2.0)
    assert value(m, "stalwart_recovery_phase_duration_seconds_count", phase="restore") == 1
    assert value(m, "stalwart_recovery_phase_duration_seconds_count", phase="detect") == 1
    assert value(m, "stalwart_recovery_phase_duration_seconds_count", phase="decide") == 2
    # first_step is not a recovery phase of the metric (it is training)
    assert value(m, "stalwart_recovery_phase_duration_seconds_count", phase="first_step") is None
    m.on_event({"type": "state", "ts": 3.0, "old": "RECOVERING", "new": "FAILED"})
    assert value(m, "stalwart_recoveries_total", outcome="gave_up") == 1


def test_checkpoint_and_throughput_events():
    m = JobMetrics(JOB)
    m.on_event({"type": "persisted", "ts": 1.0, "step": 40})
    m.on_event({"type": "persist_failed", "ts": 1.0, "step": 50})
    m.on_event(
        {
            "type": "throughput",
            "ts": 2.0,
            "steps_per_s": 7.5,
            "committed_step": 48,
            "commit_lag_steps": 3,
        }
    )
    m.on_event({"type": "straggler", "ts": 3.0, "rank": 2})
    m.on_event({"type": "throughput", "ts": 4.0, "steps_per_s": 7.0, "committed_step": 48})
    m.on_event({"type": "gpu_fatal", "ts": 5.0, "node": "n1", "gpu": 3, "reason": "Xid 79"})
    m.on_event({"type": "gpu_note", "ts": 5.0, "node": "n1", "gpu": 0, "reason": "hot"})
    assert value(m, "stalwart_persisted_timestamp_seconds") == 1.0
    # The commit timestamp moves with the committed step, not with every event.
    assert value(m, "stalwart_committed_timestamp_seconds") == 2.0
    assert value(m, "stalwart_gpu_faults_total", node="n1", gpu="3", severity="fatal") == 1
    assert value(m, "stalwart_gpu_faults_total", node="n1", gpu="0", severity="note") == 1
    assert value(m, "stalwart_persisted_step") == 40
    assert value(m, "stalwart_persist_failures_total") == 1
    assert value(m, "stalwart_steps_per_second") == 7.0
    assert value(m, "stalwart_committed_step") == 48
    assert value(m, "stalwart_commit_lag_steps") == 3
    assert value(m, "stalwart_stragglers_flagged_total") == 1


def _progress(**kw):
    p = {
        "step": 12,
        "total_steps": 100,
        "committed_step": 10,
        "workers": 2,
        "generation": 1,
        "spares": 1,
        "cordoned": 0,
    }
    return {**p, **kw}


def _beat(step: int, at: float, samples: float, node: str = "node-a", **kw):
    return {
        "received_at": at,
        "compute_seconds": 0.02,
        "collective_seconds": 0.005,
        "rss_bytes": 1000,
        "samples": samples,
        "tokens": samples * 16,
        "metrics": {"loss": 2.0 + step / 100},
        "recent": [(step - 1, 0.02, 0.03)],
        "node_id": node,
        **kw,
    }


def test_refresh_sets_gauges_and_advances_counters_monotonically():
    m = JobMetrics(JOB)
    beats = {0: _beat(12, 99.5, 64), 1: _beat(12, 99.0, 64, node="node-b")}
    m.refresh(
        _progress(), beats, {0: 1.0, 1: 1.4}, 100.0, 3, 0, {"node-a": {"sent_bytes": 1000}}, 0.1
    )
    assert value(m, "stalwart_step") == 12
    assert value(m, "stalwart_restarts_left") == 3
    assert value(m, "stalwart_heartbeat_age_seconds", rank="1") == pytest.approx(1.0)
    assert value(m, "stalwart_rank_compute_seconds", rank="0", node="node-a") == 0.02
    assert value(m, "stalwart_straggler_score", rank="1") == 1.4
    assert value(m, "stalwart_samples_total") == 128
    assert value(m, "stalwart_tokens_total") == 128 * 16
    assert value(m, "stalwart_train_metric", name="loss") == pytest.approx(2.12)
    assert value(m, "stalwart_step_duration_seconds_count") == 2
    assert value(m, "stalwart_replication_sent_bytes_total") == 1000
    # Rank 1 is replaced on another node: its count starts again, the counter never drops,
    # and the old node's series of rank 1 goes.
    beats = {0: _beat(13, 100.5, 72), 1: _beat(13, 100.4, 8, node="node-c")}
    # node-a's agent is gone; node-c's new one has sent 500 bytes.
    m.refresh(_progress(step=13), beats, {}, 101.0, None, 2, {"node-c": {"sent_bytes": 500}}, 0.1)
    # +8 from rank 0; rank 1's new process counts from 0: +8
    assert value(m, "stalwart_samples_total") == 128 + 8 + 8
    assert value(m, "stalwart_restarts_left") == -1
    assert value(m, "stalwart_steps_redone_total") == 2
    assert value(m, "stalwart_replication_sent_bytes_total") == 1500
    assert value(m, "stalwart_rank_compute_seconds", rank="1", node="node-b") is None
    assert value(m, "stalwart_rank_compute_seconds", rank="1", node="node-c") == 0.02
    # A step already observed is not observed again.
    m.refresh(_progress(step=13), beats, {}, 101.5, None, 2, {"node-c": {"sent_bytes": 500}}, 0.1)
    assert value(m, "stalwart_step_duration_seconds_count") == 4


def test_goodput_counters_never_run_ahead_of_each_other_or_backwards():
    m = JobMetrics(JOB)
    m.on_event({"type": "state", "ts": 1000.0, "old": "SCHEDULING", "new": "RUNNING"})
    m.refresh(_progress(), {}, {}, 1100.0, 3, 0, {}, 1.0)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(100.0)
    # A recovery reports 5 steps redone, and the step time grows: productive seconds drop
    # to 96 - 7.5; the counter holds at 100 (it may not go down, nor count again from 0)...
    m.refresh(_progress(), {}, {}, 1101.0, 3, 5, {}, 1.5)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(100.0)
    assert value(m, "stalwart_wall_seconds_total") == pytest.approx(101.0)
    # ...and goes on once they pass it again; the ratio never exceeds 1.
    m.refresh(_progress(), {}, {}, 1120.0, 3, 5, {}, 1.5)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(112.5)
    assert value(m, "stalwart_wall_seconds_total") == pytest.approx(120.0)
    assert m.goodput == pytest.approx(112.5 / 120)


def test_a_recovery_counts_from_its_failure_to_its_first_step_not_only_its_state():
    m = JobMetrics(JOB)
    m.on_event({"type": "state", "ts": 1000.0, "old": "SCHEDULING", "new": "RUNNING"})
    m.on_event({"type": "state", "ts": 1040.0, "old": "RUNNING", "new": "RECOVERING"})
    m.on_event({"type": "state", "ts": 1042.0, "old": "RECOVERING", "new": "RUNNING"})
    # Detected 0.5 s after the failure, the first step 1.5 s after RUNNING: 4 s down.
    m.on_event({"type": "recovered", "ts": 1043.5, "recovered_after_s": [4.0, 3.5]})
    m.refresh(_progress(), {}, {}, 1100.0, 3, 0, {}, 1.0)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(96.0)
    # A recovery shorter than its state (not measured from an injected fault) takes the state.
    m.on_event({"type": "state", "ts": 1100.0, "old": "RUNNING", "new": "RECOVERING"})
    m.on_event({"type": "state", "ts": 1110.0, "old": "RECOVERING", "new": "RUNNING"})
    m.on_event({"type": "recovered", "ts": 1111.0, "recovered_after_s": [1.0]})
    m.refresh(_progress(), {}, {}, 1200.0, 3, 0, {}, 1.0)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(200.0 - 4.0 - 10.0)


def test_goodput_leaves_out_recovery_and_redone_steps():
    m = JobMetrics(JOB)
    m.on_event({"type": "state", "ts": 1000.0, "old": "SCHEDULING", "new": "RUNNING"})
    m.on_event({"type": "state", "ts": 1040.0, "old": "RUNNING", "new": "RECOVERING"})
    m.on_event({"type": "state", "ts": 1050.0, "old": "RECOVERING", "new": "RUNNING"})
    # 100 s of wall time, 10 s recovering, 5 steps of 1 s redone: 85 s productive.
    m.refresh(_progress(), {}, {}, 1100.0, 3, 5, {}, 1.0)
    assert value(m, "stalwart_wall_seconds_total") == pytest.approx(100.0)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(85.0)
    # The job ends: the wall clock stops with it.
    m.on_event({"type": "state", "ts": 1120.0, "old": "RUNNING", "new": "SUCCEEDED"})
    m.refresh(_progress(), {}, {}, 1500.0, 3, 5, {}, 1.0)
    assert value(m, "stalwart_wall_seconds_total") == pytest.approx(120.0)
    assert value(m, "stalwart_productive_seconds_total") == pytest.approx(105.0)


def test_the_exporter_serves_on_loopback_and_two_jobs_do_not_share_series():
    a, b = JobMetrics("job-a"), JobMetrics("job-b")
    port = a.serve("127.0.0.1", 0)
    try:
        assert port > 0
        b.on_event({"type": "state", "ts": 1.0, "old": "PENDING", "new": "RUNNING"})
        a.on_event({"type": "persisted", "ts": 1.0, "step": 7})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'stalwart_persisted_step{train_job="job-a"} 7.0' in text
        assert 'stalwart_job_state{state="PENDING",train_job="job-a"} 1.0' in text
        assert "job-b" not in text
        assert "# TYPE stalwart_failures_total counter" in text
    finally:
        a.close()


def test_checkpoint_duration_by_tier_and_bytes():
    m = JobMetrics(JOB)
    snap = {"captures": 4, "capture_seconds": 0.04, "handover_seconds": 0.04, "last_bytes": 1000}
    beats = {0: _beat(12, 99.5, 64, pid=7, snapshot=snap), 1: _beat(12, 99.5, 64, pid=8)}
    rep = {"node-a": {"sent_bytes": 10, "rounds": 2, "seconds": 1.0}}
    m.refresh(_progress(), beats, {}, 100.0, 3, 0, rep, 0.1)
    hist = "stalwart_checkpoint_duration_seconds"
    # Four snapshots of rank 0 at their mean (0.02 s), two rounds of copies at 0.5 s.
    assert value(m, f"{hist}_count", tier="memory") == 4
    assert value(m, f"{hist}_sum", tier="memory") == pytest.approx(0.08)
    assert value(m, f"{hist}_count", tier="peer") == 2
    assert value(m, f"{hist}_sum", tier="peer") == pytest.approx(1.0)
    assert value(m, "stalwart_checkpoint_bytes", tier="memory") == 1000
    # Two more snapshots; then rank 0 is replaced (a new pid counting from 1): +1, not -5.
    snap2 = {**snap, "captures": 6, "capture_seconds": 0.05, "handover_seconds": 0.05}
    m.refresh(
        _progress(), {0: _beat(13, 100, 72, pid=7, snapshot=snap2)}, {}, 101.0, 3, 0, rep, 0.1
    )
    assert value(m, f"{hist}_count", tier="memory") == 6
    assert value(m, f"{hist}_count", tier="peer") == 2  # no round since: nothing observed
    snap3 = {**snap, "captures": 1, "capture_seconds": 0.01, "handover_seconds": 0.0}
    m.refresh(_progress(), {0: _beat(14, 101, 80, pid=9, snapshot=snap3)}, {}, 102.0, 3, 0, {}, 0.1)
    assert value(m, f"{hist}_count", tier="memory") == 7
    assert value(m, f"{hist}_sum", tier="memory") == pytest.approx(0.11)
    # A durable checkpoint: observed exactly, its size set.
    m.on_event({"type": "persisted", "ts": 103.0, "step": 40, "seconds": 1.5, "bytes": 4000})
    assert value(m, f"{hist}_count", tier="durable") == 1
    assert value(m, f"{hist}_sum", tier="durable") == 1.5
    assert value(m, "stalwart_checkpoint_bytes", tier="durable") == 4000


def test_gpu_readings_set_gauges_and_count_xids_by_code():
    m = JobMetrics(JOB)
    reading = {
        "index": 0,
        "xids": [13],
        "temperature_c": 61.0,
        "power_w": 300.5,
        "ecc_uncorrected": 0,
        "retired_pages": 2,
        "lost": False,
        "error": None,
    }
    m.gpu_readings("node-a", [reading, {**reading, "index": 1, "xids": [79, 79]}])
    assert value(m, "stalwart_gpu_xid_total", node="node-a", gpu="0", xid="13") == 1
    assert value(m, "stalwart_gpu_xid_total", node="node-a", gpu="1", xid="79") == 2
    assert value(m, "stalwart_gpu_temperature_celsius", node="node-a", gpu="0") == 61.0
    assert value(m, "stalwart_gpu_power_watts", node="node-a", gpu="1") == 300.5
    assert value(m, "stalwart_gpu_retired_pages", node="node-a", gpu="0") == 2
    assert value(m, "stalwart_gpu_up", node="node-a", gpu="0") == 1
    # The next report: no new Xid, GPU 1 lost, ECC errors on GPU 0.
    m.gpu_readings(
        "node-a",
        [
            {**reading, "xids": [], "ecc_uncorrected": 3},
            {**reading, "index": 1, "xids": [], "lost": True, "temperature_c": None},
        ],
    )
    assert value(m, "stalwart_gpu_xid_total", node="node-a", gpu="0", xid="13") == 1
    assert value(m, "stalwart_gpu_ecc_uncorrected_errors", node="node-a", gpu="0") == 3
    assert value(m, "stalwart_gpu_up", node="node-a", gpu="1") == 0
    # A GPU the probe cannot read has no temperature rather than a stale one.
    assert value(m, "stalwart_gpu_temperature_celsius", node="node-a", gpu="1") is None
    assert value(m, "stalwart_gpu_temperature_celsius", node="node-a", gpu="0") == 61.0
    # An Xid of an unknown GPU (index -1) is counted, with no readings of a GPU -1.
    m.gpu_readings("node-a", [{"index": -1, "xids": [48]}])
    assert value(m, "stalwart_gpu_xid_total", node="node-a", gpu="-1", xid="48") == 1
    assert value(m, "stalwart_gpu_up", node="node-a", gpu="-1") is None
    # Without gauges (a CPU node's stand-in probe): Xids only.
    m.gpu_readings("node-b", [{**reading, "xids": [13]}], gauges=False)
    assert value(m, "stalwart_gpu_xid_total", node="node-b", gpu="0", xid="13") == 1
    assert value(m, "stalwart_gpu_up", node="node-b", gpu="0") is None
    # The node is lost: its readings go, its counters stay.
    m.forget_node("node-a")
    for name in ("stalwart_gpu_up", "stalwart_gpu_temperature_celsius", "stalwart_gpu_power_watts"):
        assert value(m, name, node="node-a", gpu="0") is None
    assert value(m, "stalwart_gpu_xid_total", node="node-a", gpu="0", xid="13") == 1


def test_labelled_counters_with_known_labels_start_at_zero():
    # Prometheus's increase() does not count a series born at 1: the first failure of a kind
    # must have a 0 sample before it.
    m = JobMetrics(JOB)
    for kind in ("worker_died", "node_lost", "gpu_fatal", "straggler"):
        assert value(m, "stalwart_failures_total", kind=kind) == 0
    assert value(m, "stalwart_recoveries_total", outcome="gave_up") == 0
    # Not per GPU (three zero series for each of thousands of GPUs): StalwartFatalGpuXid
    # also sees a series born at 1, and the panels show these counters' values.
    assert value(m, "stalwart_gpu_faults_total", node="n", gpu="0", severity="fatal") is None


def test_batch_histogram_matches_prometheus_bucket_semantics():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from stalwart.orchestrator.observe.histogram import BatchHistogram

    buckets = (0.1, 0.5, 1.0)
    values = [0.05, 0.1, 0.1000001, 0.5, 0.7, 1.0, 3.0, 0.0]
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("x_seconds", "h", ("train_job",), buckets)
    ours_reg.register(ours)
    theirs = Histogram("x_seconds", "h", ("train_job",), buckets=buckets, registry=theirs_reg)
    ours.labels("j").observe_many(values[:4])
    ours.labels("j").observe(values[4])
    ours.labels("j").observe_n(1.0, 1)
    ours.labels("j").observe_many(values[6:])
    ours.labels("j").observe_many([])
    for v in values:
        theirs.labels("j").observe(v)

    def samples(reg):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(reg).decode())
            for s in f.samples
            if not s.name.endswith("_created")
        }

    assert samples(ours_reg) == pytest.approx(samples(theirs_reg))
    # n equal observations at once: exact count and sum.
    ours.labels("k").observe_n(0.2, 1000)
    assert ours_reg.get_sample_value("x_seconds_count", {"train_job": "k"}) == 1000
    assert ours_reg.get_sample_value("x_seconds_sum", {"train_job": "k"}) == pytest.approx(200)
    assert ours_reg.get_sample_value("x_seconds_bucket", {"train_job": "k", "le": "0.1"}) == 0
    assert ours_reg.get_sample_value("x_seconds_bucket", {"train_job": "k", "le": "0.5"}) == 1000

"""orchestrator/chaos/network.py without a cluster: a scenario's network faults (checked,
refused where the cluster has no networks of its own), what the job's events say about
where ranks are, and the verdict's rows for faults done to the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.orchestrator.chaos.network import Flap, JobWatch, Partition, parse
from stalwart.orchestrator.chaos.scenario import job_specs, load_scenario
from stalwart.orchestrator.chaos.verdict import judge
from stalwart.orchestrator.spec import SpecError
from tests.unit.test_chaos_verdict import _scenario

NETNS = "cluster: {worker_nodes: 3, network: netns}\n"


def _load(tmp_path: Path, faults: str, cluster: str = NETNS, expect: str = ""):
    body = f"name: n\njob: {{spec: job.yaml}}\n{cluster}faults:\n{faults}{expect}"
    return load_scenario(_scenario(tmp_path, body))  # test_chaos_verdict's job of 4 workers


def test_network_faults_are_checked_and_stay_out_of_the_job_spec(tmp_path):
    sc = _load(
        tmp_path,
        "  - {kind: partition, rank: 1, at_step: 30, seconds: 12}\n"
        "  - {kind: partition, node: 2, from: [head, 3], after_seconds: 5}\n"
        "  - {kind: loss, rank: random, percent: 5, at_step: 10, seconds: 20}\n"
        "  - {kind: flap, rank: 0, at_step: 20, down_s: 1, up_s: 4, count: 2}\n"
        "  - {kind: kill_worker, rank: 2, at_step: 50}\n",
    )
    cut, side, lossy, flap = sc.network_faults(4)
    assert isinstance(cut, Partition) and (cut.rank, cut.at_step, cut.seconds) == (1, 30, 12)
    assert side.from_ == ["head", 3] and side.after_seconds == 5 and side.seconds is None
    assert 0 <= lossy.rank < 4 and lossy.rank == sc.network_faults(4)[2].rank  # the seed's
    assert isinstance(flap, Flap) and flap.count == 2
    # The job carries only its own faults; the baseline none.
    _clean, faulty = job_specs(sc)
    assert [f.kind for f in faulty.chaos.faults] == ["kill_worker"]
    assert sc.resolved(4) == ([{"kind": "kill_worker", "rank": 2, "at_step": 50}], [])


@pytest.mark.parametrize(
    ("fault", "cluster", "message"),
    [
        (
            "{kind: partition, rank: 1, at_step: 3}",
            "cluster: {worker_nodes: 3}\n",
            "faults.0: a partition fault needs worker nodes with networks of their own: "
            "cluster: {network: netns, worker_nodes: N}",
        ),
        (
            "{kind: loss, rank: 1, at_step: 3, percent: 150}",
            NETNS,
            "faults.0: percent: must be < 100.0, got 150",
        ),
        (
            "{kind: partition, at_step: 3}",
            NETNS,
            "faults.0: name one of `rank` (its node), `node` (1, 2, ...) or `nodes`",
        ),
        (
            "{kind: delay, rank: 1, ms: 200}",
            NETNS,
            "faults.0: name one of `at_step` or `after_seconds`",
        ),
        (
            "{kind: partition, node: 4, at_step: 3}",
            NETNS,
            "faults.0.node: must be <= cluster.worker_nodes (3), got 4",
        ),
        (
            "{kind: partition, nodes: [1, 5], from: [head], at_step: 3}",
            NETNS,
            "faults.0.nodes.1: must be <= cluster.worker_nodes (3), got 5",
        ),
        (
            "{kind: partition, node: 1, at_step: 3, from: [head, 7]}",
            NETNS,
            "faults.0.from.1: must be <= cluster.worker_nodes (3), got 7",
        ),
        (
            "{kind: partition, node: 1, at_step: 3, from: [rack]}",
            NETNS,
            "faults.0: from.0.int: input should be a valid integer, unable to parse string as an "
            "integer, got \"rack\"; from.0.literal['head']: input should be 'head', got \"rack\"",
        ),
    ],
)
def test_a_bad_network_fault_names_its_field(tmp_path, fault, cluster, message):
    with pytest.raises(SpecError) as e:
        _load(tmp_path, f"  - {fault}\n", cluster=cluster)
    assert e.value.errors == [message]


def test_the_watch_follows_the_steps_and_where_each_rank_is(tmp_path):
    events = tmp_path / "events.jsonl"
    watch = JobWatch(events)
    watch.poll()  # no log yet: nothing known
    assert (watch.step, watch.running_since, watch.node_of) == (-1, None, {})
    lines = [
        {"type": "state", "new": "RUNNING", "ts": 10.0},
        {"type": "scheduled", "workers": {"0": {"node_id": "a"}, "1": {"node_id": "b"}}},
        {"type": "throughput", "step": 12},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"type": "thro')
    watch.poll()
    assert (watch.step, watch.running_since, watch.node_of) == (12, 10.0, {0: "a", 1: "b"})
    # The torn last line is read once it is whole.
    with open(events, "a") as fh:
        fh.write('ughput", "step": 30}\n')
        fh.write(json.dumps({"type": "replaced", "ranks": {"1": {"node": "c"}}}) + "\n")
    watch.poll()
    assert (watch.step, watch.node_of) == (30, {0: "a", 1: "c"})


def _netrun(tmp_path, applied, failures, expect=""):
    sc = _load(
        tmp_path, "  - {kind: partition, rank: 1, at_step: 30, seconds: 12}\n", NETNS, expect
    )
    result = {
        "status": "succeeded",
        "model_digest": "d" * 64,
        "failures": failures,
        "steps_completed": 100,
        "wall_seconds": 30.0,
    }
    return judge(sc, [], result, [], "d" * 64, network=applied)


def _cut(**kw):
    rec = parse({"kind": "partition", "rank": 1, "at_step": 30, "seconds": 12})
    return {
        **rec.model_dump(mode="json", by_alias=True),
        "outcome": "injected",
        "target": "n2",
        "node_ids": ["nodeB"],
        "step": 31,
        "at": 100.0,
        "healed_at": 112.0,
        "windows": [[100.0, 112.0]],
        **kw,
    }


def _lost(rank, node="nodeB", detected=103.1):
    return {
        "kind": "node_lost",
        "rank": rank,
        "node": node,
        "detected_at": detected,
        "recovered_after_s": 4.0,
        "steps_redone": 2,
        "restored_step": 29,
        "restore_tiers": {"memory": 4},
        "fault_index": None,
    }


def test_a_partitions_row_counts_its_nodes_failures_from_when_it_was_cut(tmp_path):
    other = _lost(3, node="nodeC", detected=150.0)
    v = _netrun(tmp_path, [_cut()], [_lost(0), _lost(1), other])
    [row] = v.faults
    assert (row.kind, row.outcome, row.label) == ("partition", "injected", "n2 (rank 1) @30")
    assert row.failures == 2  # the other node's failure is not the partition's
    assert (row.detected_after_s, row.recovered_after_s) == (3.1, 7.1)
    assert (row.steps_lost, row.restored_step) == (2, 29)
    assert row.noticed == "1 window(s), 12.0 s in all"
    names = {c.name: c for c in v.checks}
    assert names["fault 0 (partition): injected"].ok


def test_a_fault_the_job_must_ride_out_fails_the_verdict_if_it_recovered(tmp_path):
    short = _cut(seconds=1.5, healed_at=101.5, windows=[[100.0, 101.5]])
    v = _netrun(tmp_path, [short], [_lost(1)], expect="expect: {max_failures: 0}\n")
    [failures] = [c for c in v.checks if c.name == "failures"]
    assert not failures.ok and failures.detail == "1 (at most 0): node_lost"
    assert not v.passed
    v = _netrun(tmp_path, [short], [], expect="expect: {max_failures: 0}\n")
    assert v.passed, v.checks
    # A fault that found no target is not injected: the verdict says why.
    missing = {**_cut(), "outcome": "refused: rank 1 is on no node the job's events name"}
    v = _netrun(tmp_path, [missing], [])
    [check] = [c for c in v.checks if c.name.endswith("injected")]
    assert not check.ok and "on no node" in check.detail


def test_a_network_faults_rank_must_be_one_of_the_jobs(tmp_path):
    sc = _load(tmp_path, "  - {kind: loss, rank: 9, percent: 5, at_step: 3}\n")
    with pytest.raises(SpecError) as e:
        job_specs(sc)
    assert e.value.errors == ["faults.0.rank: must be < workers (4), got 9"]

"""Which node writes each rank's shard of a durable step (orchestrator/supervisor/checkpoints.py
`_start_persist`): the rank's own node, which holds it in memory, even when a peer's report of
its copy came in first; a peer only once the own node no longer holds it or is gone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.supervisor import checkpoints
from stalwart.orchestrator.supervisor.checkpoints import OWN_REPORT_WAIT_S, Checkpoints

pytestmark = pytest.mark.timeout(60)


class _Agent:
    def __init__(self):
        self.prune = SimpleNamespace(remote=lambda **kw: None)


def _checkpoints(tmp_path) -> tuple[Checkpoints, list]:
    spec = validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "workers": 2,
            "steps": 200,
            "checkpoint": {"persist": {"uri": str(tmp_path / "durable"), "every_steps": 20}},
        }
    )
    pool = SimpleNamespace(
        world=2,
        store_key="run",
        agents={"A": _Agent(), "B": _Agent()},
        bad=SimpleNamespace(lost=set()),
        workers=[0, 1],
        worker_info={0: {"node_id": "A"}, 1: {"node_id": "B"}},
    )
    ckpt = Checkpoints(spec, pool, lambda etype, **kw: None)
    started: list = []
    ckpt.persister.start = lambda step, world, assignment, faults: started.append(
        (step, {node: ranks for node, (_, ranks) in assignment.items()})
    )
    return ckpt, started


def test_a_copy_reported_before_the_own_shard_waits_for_the_own_nodes_report(tmp_path):
    ckpt, started = _checkpoints(tmp_path)
    # B's report came in with its own shard of step 40 and its copy of rank 0's; A's last
    # report was sent before rank 0 wrote step 40.
    ckpt.stored = {"A": {0: [38, 39]}, "B": {1: [39, 40]}}
    ckpt.replicas_held = {"A": {1: [40]}, "B": {0: [40]}}
    assert not ckpt._start_persist(40, 41)
    assert started == []
    ckpt.stored["A"] = {0: [39, 40, 41]}  # A's next report
    assert ckpt._start_persist(40, 42)
    assert started == [(40, {"A": [0], "B": [1]})]


def test_a_peer_writes_a_shard_its_own_node_holds_no_more_or_lost(tmp_path):
    ckpt, started = _checkpoints(tmp_path)
    # A reported newer steps of rank 0 without 40 (dropped): B's copy is the one to write.
    ckpt.stored = {"A": {0: [44, 45]}, "B": {1: [40, 45]}}
    ckpt.replicas_held = {"A": {1: [40]}, "B": {0: [40]}}
    assert ckpt._start_persist(40, 45)
    assert started[-1] == (40, {"B": [0, 1]})
    # A lost (its report is old): not waited for.
    ckpt, started = _checkpoints(tmp_path)
    ckpt.stored = {"A": {0: [38]}, "B": {1: [40]}}
    ckpt.replicas_held = {"B": {0: [40]}}
    ckpt.pool.bad.lost.add("A")
    assert ckpt._start_persist(40, 41)
    assert started[-1] == (40, {"B": [0, 1]})


def test_an_own_node_that_never_reports_the_shard_holds_the_write_up_for_seconds_only(
    tmp_path, monkeypatch
):
    now = [1000.0]
    monkeypatch.setattr(checkpoints.time, "monotonic", lambda: now[0])
    ckpt, started = _checkpoints(tmp_path)
    ckpt.stored = {"A": {0: [38, 39]}, "B": {1: [39, 40]}}
    ckpt.replicas_held = {"A": {1: [40]}, "B": {0: [40]}}
    assert not ckpt._start_persist(40, 41)
    now[0] += OWN_REPORT_WAIT_S - 0.1
    assert not ckpt._start_persist(40, 41) and started == []
    now[0] += 0.1
    assert ckpt._start_persist(40, 42)
    assert started == [(40, {"B": [0, 1]})]

"""When the durable tier writes a step, and which steps the node stores must keep for it
(orchestrator/supervisor/persist.py; no Ray involved in these decisions)."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.spec import PersistSpec
from stalwart.orchestrator.supervisor.persist import Persister

pytestmark = pytest.mark.timeout(60)


def make(tmp_path, **kw) -> Persister:
    return Persister(PersistSpec(uri=str(tmp_path / "ck"), **kw), "job", lambda *a, **k: None)


def test_every_steps_persists_the_newest_complete_multiple(tmp_path):
    p = make(tmp_path, every_steps=10)
    assert p.choose({7, 8, 9}, committed=9, now=0.0) is None
    assert p.choose({9, 10, 11}, committed=11, now=0.0) == 10
    assert p.choose({19, 20, 21, 30}, committed=30, now=0.0) == 30  # skips to the newest
    p.last_step = 30
    assert p.choose({30, 31, 35}, committed=35, now=0.0) is None


def test_every_seconds_persists_the_newest_committed_step_once_due(tmp_path):
    p = make(tmp_path, every_seconds=60)
    start = p.last_at
    assert p.choose({5, 6}, committed=6, now=start + 30) is None
    assert p.choose({5, 6}, committed=6, now=start + 61) == 6
    assert p.choose({5, 6}, committed=None, now=start + 61) is None
    assert p.choose({5}, committed=6, now=start + 61) is None  # 6 not all in memory


def test_uri_without_interval_defaults_to_every_five_minutes():
    assert PersistSpec(uri="/tmp/x").every_seconds == 300.0
    assert PersistSpec(uri="/tmp/x", every_steps=5).every_seconds is None


def test_step_zero_is_never_persisted(tmp_path):
    p = make(tmp_path, every_steps=1)
    assert p.choose({0}, committed=0, now=0.0) is None


def test_pinned_keeps_the_next_grid_steps_and_the_one_in_flight(tmp_path):
    p = make(tmp_path, every_steps=10)
    assert p.pinned(newest=3) == {10, 20}
    assert p.pinned(newest=25) == {10, 20, 30}
    p.last_step = 20
    assert p.pinned(newest=25) == {30, 40}
    p._in_flight = {"step": 20}
    assert p.pinned(newest=25) == {20, 30, 40}
    assert make(tmp_path, every_seconds=10).pinned(newest=25) == set()


def test_in_flight_and_cooldown_block_a_new_attempt(tmp_path):
    p = make(tmp_path, every_steps=10)
    p._in_flight = {"step": 10}
    assert p.choose({20}, committed=20, now=0.0) is None
    p._in_flight = None
    p._cooldown_until = 100.0
    assert p.choose({20}, committed=20, now=50.0) is None
    assert p.choose({20}, committed=20, now=101.0) == 20


def test_resumed_from_counts_the_interval_from_the_resumed_step(tmp_path):
    p = make(tmp_path, every_steps=10)
    p.resumed_from(40)
    assert p.choose({45}, committed=45, now=0.0) is None
    assert p.choose({50}, committed=50, now=0.0) == 50
    assert p.pinned(newest=41) == {50, 60}


def test_bad_uris_are_refused_at_the_edge():
    with pytest.raises(ValueError, match=r"no usable fsspec backend for nosuch://"):
        PersistSpec(uri="nosuch://bucket/x")
    with pytest.raises(ValueError, match="must not be empty"):
        PersistSpec(uri="  ")


def test_a_step_whose_manifest_is_written_is_persisted_even_if_retention_fails(tmp_path):
    # Storage goes away between the manifest and the retention pass: the step is complete
    # (persisted, not persist_failed), and the older steps wait for the next pass.
    from stalwart.ckpt.durable import DurableError
    from tests.unit.test_durable import make_snapshot

    events: list = []
    p = Persister(
        PersistSpec(uri=str(tmp_path / "ck"), every_steps=10, keep_last=1),
        "job",
        lambda etype, **kw: events.append((etype, kw)),
        run="run-a",
    )
    snap, _ = make_snapshot(10)
    records = [p.store.write_rank(10, 0, snap)]

    def gone(*a, **k):
        raise DurableError("listing: storage unavailable")

    p.store.prune = gone
    p._in_flight = job = {"step": 10, "world": 1, "started": 0.0, "generation": 1}
    p._finish(job, records)
    [(kind, event)] = events
    assert kind == "persisted" and event["step"] == 10 and event["pruned"] == []
    assert "older steps not pruned yet: " in event["reason"]
    assert p.failures == 0 and p.last_step == 10
    extra = p.store.newest_valid(1)[0].extra
    assert extra["run"] == "run-a" and extra["generation"] == 1 and extra["committed_at"] > 0


def _writing(tmp_path, generation: int):
    """A persister whose generation `generation` wrote rank 0's file of step 10 (its agent's
    answer in), and the events it emits."""
    from tests.unit.test_durable import make_snapshot

    events: list = []
    p = Persister(
        PersistSpec(uri=str(tmp_path / "ck"), every_steps=10),
        "job",
        lambda etype, **kw: events.append((etype, kw)),
        run="run-a",
    )
    p.fence(generation)
    snap, _ = make_snapshot(10)
    records = [p.store.write_rank(10, 0, snap, generation)]
    p._in_flight = job = {"step": 10, "world": 1, "started": 0.0, "generation": generation}
    return p, job, records, events


def test_a_recovery_drops_the_write_its_fenced_generation_had_not_committed(tmp_path):
    p, job, records, events = _writing(tmp_path, generation=2)
    assert records[0]["record"]["file"] == "__0_0.gen2.distcp"  # named for its generation
    p.fence(3, restore_step=7)
    [(kind, event)] = events
    assert kind == "persist_fenced" and event["path"] == "durable"
    assert event["step"] == 10 and event["generation"] == 2
    assert "generation 3 restarts from step 7" in event["reason"]
    assert p.idle() and p.generation == 3  # the next write may start at once
    p._finish(job, records)  # the agents' answers, late: nothing is committed
    assert p.store.steps() == [10] and p.store.split_complete([10]) == ([], [10])
    assert p.last_step is None and len(events) == 1


def test_a_write_committing_when_the_fence_comes_is_kept(tmp_path):
    # Its check passed while its generation ran: the manifest says when (committed_at).
    p, job, _, events = _writing(tmp_path, generation=2)
    job["committing"] = True
    p.fence(3)
    assert events == [] and not p.idle()
    p.fence(2)  # an older generation's fence changes nothing
    assert p.generation == 3


def test_writes_start_under_the_generation_running_then(tmp_path):
    p = make(tmp_path, every_steps=10)
    p.fence(4)

    class Agent:
        class persist:  # a Ray actor method's shape
            @staticmethod
            def remote(*args):
                calls.append(args)
                return object()

    calls: list = []
    p.start(10, 1, {"n1": (Agent, [0])})
    assert calls[0][-1] == 4 and p._in_flight["generation"] == 4


def test_a_write_of_the_jobs_history_by_live_nodes_is_adopted(tmp_path):
    # A recovery restarting from step 12 finds step 10 being written by live nodes: the
    # same bytes whichever generation writes them, so the next generation takes it over
    # (a storm of recoveries must not keep storage from ever getting a step).
    p, job, records, events = _writing(tmp_path, generation=2)
    job["refs"] = {"ref": "node-a"}
    p.fence(3, restore_step=12, lost={"node-b"})
    p.fence(3)  # the launch's own fence: nothing more
    assert events == [] and job["adopted_by"] == 3 and not p.idle()
    p._finish(job, records)
    extra = p.store.newest_valid(1)[0].extra
    assert extra["generation"] == 2 and extra["adopted_by"] == 3
    # Written by a lost node, or above the restore step: dropped.
    for lost, restore in (({"node-a"}, 12), (set(), 9)):
        q, job, _, events = _writing(tmp_path / f"{restore}", generation=2)
        job["refs"] = {"ref": "node-a"}
        q.fence(3, restore_step=restore, lost=lost)
        assert [e for e, _ in events] == ["persist_fenced"] and q.idle()


def test_a_write_by_a_node_lost_is_dropped_at_the_loss_not_at_the_next_generation(tmp_path):
    # The other writers' answers (retries against a failing target running out) must not
    # turn it into a persist_failed first, however long the recovery takes.
    p, job, records, events = _writing(tmp_path, generation=2)
    job["refs"] = {"ref-a": "node-a", "ref-b": "node-b"}
    p.writer_lost("node-c")  # not writing it: nothing
    assert events == [] and not p.idle()
    p.writer_lost("node-b")
    [(kind, event)] = events
    assert kind == "persist_fenced" and event["path"] == "durable"
    assert event["step"] == 10 and event["generation"] == 2 and event["node"] == "node-b"
    assert "node node-b, writing shards of it, was lost" in event["reason"]
    assert p.idle() and p.failures == 0
    p.fence(3, restore_step=12)  # the next generation's fence: nothing left to drop
    p._finish(job, records)  # the live writer's answer, late: nothing is committed
    assert len(events) == 1 and p.store.split_complete([10]) == ([], [10])
    # One whose shards are all written (its manifest next), or already committing, is kept.
    for state in ({"phase": "manifest"}, {"committing": True}):
        q, job, _, events = _writing(tmp_path / str(len(state)) / next(iter(state)), 2)
        job.update(refs={"ref-a": "node-a"}, **state)
        q.writer_lost("node-a")
        assert events == [] and not q.idle()

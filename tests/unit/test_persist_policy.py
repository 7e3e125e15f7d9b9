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
    p._finish({"step": 10, "world": 1, "started": 0.0}, records)
    [(kind, event)] = events
    assert kind == "persisted" and event["step"] == 10 and event["pruned"] == []
    assert "older steps not pruned yet: " in event["reason"]
    assert p.failures == 0 and p.last_step == 10
    assert p.store.newest_valid(1)[0].extra == {"run": "run-a"}

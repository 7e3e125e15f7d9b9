"""orchestrator/chaos/fencing.py: the verdict's check that no fenced generation's write
reached the durable store, on a real store in a temporary directory."""

from __future__ import annotations

import pytest

from stalwart.ckpt.durable import DurableStore
from stalwart.orchestrator.chaos.fencing import audit, check
from tests.unit.test_durable import make_snapshot

pytestmark = pytest.mark.timeout(60)

RUN = "job-abc"
# Generation 1 from t=100, generation 2 (a recovery) from t=200.
EVENTS = [
    {"type": "generation", "generation": 1, "ts": 100.0},
    {"type": "generation", "generation": 2, "ts": 200.0},
]


def _persist(store, step, generation, committed_at, run=RUN, world=2, files_of=None):
    """Step `step` written by `generation` (its ranks' files by `files_of`, default the
    same), committed at `committed_at`."""
    writes = []
    for rank in range(world):
        snap, _ = make_snapshot(step, seed=rank)
        writes.append(store.write_rank(step, rank, snap, files_of or generation))
    extra = {"run": run, "generation": generation, "committed_at": committed_at}
    store.write_manifest(step, world, extra=extra, writes=writes)


def test_steps_committed_by_the_generation_running_then_pass(tmp_path):
    store = DurableStore(str(tmp_path), "job")
    _persist(store, 10, 1, committed_at=150.0)
    _persist(store, 20, 2, committed_at=250.0)
    # Generation 1's node, cut off, still wrote rank 0's file of step 30 after the fence:
    # no manifest lists it.
    snap, _ = make_snapshot(30)
    store.write_rank(30, 0, snap, 1)
    _persist(store, 40, 2, committed_at=260.0, run="another-run")  # not this run's
    fenced = [{"type": "persist_fenced", "path": "durable"}, {"type": "fenced", "path": "ring"}]
    ok, detail = check(audit(str(tmp_path), "job", RUN), EVENTS + fenced)
    assert ok, detail
    assert detail.startswith("2 steps on ") and "(1, 2)" in detail
    assert "1 file(s) no manifest lists" in detail
    assert "fenced off: durable (1 event), ring (1 event)" in detail


def test_a_step_committed_after_its_generation_ended_fails(tmp_path):
    store = DurableStore(str(tmp_path), "job")
    _persist(store, 10, 1, committed_at=150.0)
    _persist(store, 20, 1, committed_at=230.0)  # generation 2 started at 200
    ok, detail = check(audit(str(tmp_path), "job", RUN), EVENTS)
    assert not ok
    assert detail == "step 20: committed by generation 1 after generation 2 started"


def test_a_manifest_listing_another_generations_files_fails(tmp_path):
    store = DurableStore(str(tmp_path), "job")
    _persist(store, 20, 2, committed_at=250.0, files_of=1)
    ok, detail = check(audit(str(tmp_path), "job", RUN), EVENTS)
    assert not ok and "generation 2's manifest lists files of generation(s) 1" in detail


def test_without_a_durable_store_or_a_run_the_check_says_so(tmp_path):
    assert check(None, EVENTS) == (True, "the job writes no durable checkpoints")
    store = DurableStore(str(tmp_path), "job")
    _persist(store, 10, 1, committed_at=150.0)
    ok, detail = check(audit(str(tmp_path), "job", None), EVENTS)  # a run that never said
    assert ok and detail.startswith("0 steps on ")


def test_an_adopted_step_counts_as_the_adopting_generations(tmp_path):
    store = DurableStore(str(tmp_path), "job")
    writes = [store.write_rank(10, 0, make_snapshot(10)[0], 1)]
    adopted = {"run": RUN, "generation": 1, "committed_at": 250.0, "adopted_by": 2}
    store.write_manifest(10, 1, extra=adopted, writes=writes)
    events = [{**e, "restore_step": 12 if e["generation"] == 2 else None} for e in EVENTS]
    ok, detail = check(audit(str(tmp_path), "job", RUN), events)
    assert ok, detail
    # Adopted by a generation that restarted below it: a fenced write.
    events[1]["restore_step"] = 8
    ok, detail = check(audit(str(tmp_path), "job", RUN), events)
    assert not ok and "adopted by generation 2, which restarted from step 8" in detail


def test_a_store_that_shows_nothing_of_what_the_run_persisted_fails(tmp_path):
    persisted = [{"type": "persisted", "step": 10}]
    ok, detail = check(audit(str(tmp_path / "elsewhere"), "job", RUN), EVENTS + persisted)
    assert not ok and "persisted steps [10], but" in detail and "nothing could be checked" in detail

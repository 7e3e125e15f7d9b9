"""A recovery restores only this run's durable past (orchestrator/supervisor/checkpoints.py):
the steps it wrote, or the step it resumed from and those before it; never a step another
run of the same job left under the same URI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stalwart.ckpt.durable import DurableStore
from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.supervisor.checkpoints import Checkpoints
from tests.unit.test_durable import make_snapshot

pytestmark = pytest.mark.timeout(60)


def _checkpoints(uri: str, run: str) -> tuple[Checkpoints, list]:
    spec = validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "workers": 1,
            "steps": 200,
            "checkpoint": {"persist": {"uri": uri}},
        }
    )
    events: list = []
    pool = SimpleNamespace(world=1, store_key=run, agents={}, bad=SimpleNamespace(lost=set()))
    ckpt = Checkpoints(spec, pool, lambda etype, **kw: events.append((etype, kw)))
    return ckpt, events


def _write(uri: str, step: int, run: str | None) -> None:
    store = DurableStore(uri, "j")
    snap, _ = make_snapshot(step)
    record = store.write_shard(step, 0, snap)
    store.write_manifest(step, 1, [record], extra={"run": run} if run else None)


def test_a_recovery_skips_steps_another_run_left_under_the_same_uri(tmp_path):
    uri = str(tmp_path / "durable")
    _write(uri, 120, "run-old")  # a finished earlier run of the same job
    _write(uri, 20, "run-new")
    _write(uri, 40, "run-new")
    ckpt, events = _checkpoints(uri, "run-new")
    assert ckpt.durable_restore_point(this_run=True).step == 40
    assert [kw["step"] for etype, kw in events if etype == "checkpoint_skipped"] == [120]
    assert "another run of the job (run-old)" in events[-1][1]["reason"]
    # Resuming at start takes any run's newest (that is what --resume auto means).
    assert ckpt.durable_restore_point().step == 120


def test_the_step_a_run_resumed_from_is_its_past(tmp_path):
    uri = str(tmp_path / "durable")
    for step, run in ((30, "run-a"), (60, "run-a"), (90, None)):
        _write(uri, step, run)  # None: written before manifests named their run
    ckpt, _ = _checkpoints(uri, "run-b")
    assert ckpt.durable_restore_point(this_run=True) is None  # nothing of run-b's yet
    ckpt.resumed_from = 60
    assert ckpt.durable_restore_point(this_run=True).step == 60
    _write(uri, 80, "run-b")
    assert ckpt.durable_restore_point(this_run=True).step == 80


def test_what_a_fault_after_commit_or_after_persist_waits_for(tmp_path):
    ckpt, _ = _checkpoints(str(tmp_path / "d"), "run-a")  # every step, persisting by time
    wanted, committed = ckpt.restore_point(45, durable=False)
    assert wanted == 45 and committed() is None
    wanted, persisted = ckpt.restore_point(45, durable=True)
    assert wanted == 0 and persisted() is None  # any persisted step will do
    ckpt.persister.last_step = 30
    assert persisted() == 30
    spec = ckpt.spec.model_copy(
        update={
            "checkpoint": ckpt.spec.checkpoint.model_copy(
                update={
                    "every_steps": 5,
                    "persist": ckpt.spec.checkpoint.persist.model_copy(update={"every_steps": 10}),
                }
            )
        }
    )
    ckpt.spec = spec
    assert ckpt.restore_point(47, durable=False)[0] == 45  # the snapshot grid
    assert ckpt.restore_point(47, durable=True)[0] == 40  # the durable grid

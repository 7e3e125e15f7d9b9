"""ckpt/pipeline.py: hand-over off the training thread, errors, backpressure."""

from __future__ import annotations

import threading

import torch

from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.snapshot import Snapshot, restore

WAIT = 10.0  # generous upper bound for anything that should happen promptly


def state(step: int) -> dict:
    return {"w": torch.full((32,), float(step)), "step": step}


class Recorder:
    """A fake `send`: restores each snapshot at once (the buffer is reused afterwards)."""

    def __init__(self):
        self.received: list[tuple[int, dict]] = []

    def __call__(self, snap: Snapshot) -> None:
        self.received.append((snap.step, restore(snap)))


def test_snapshots_handed_over_in_order():
    rec = Recorder()
    pipe = SnapshotPipeline(rec)
    for step in range(10):
        pipe.submit(step, state(step))
    assert pipe.drain(WAIT) is True
    assert [s for s, _ in rec.received] == list(range(10))
    for step, got in rec.received:
        assert got["step"] == step
        assert torch.equal(got["w"], torch.full((32,), float(step)))
    assert pipe.stats.captures == 10
    assert pipe.stats.last_stored_step == 9
    assert pipe.stats.errors == 0
    assert pipe.stats.last_bytes > 0


def test_drain_with_nothing_submitted():
    pipe = SnapshotPipeline(Recorder())
    assert pipe.drain(WAIT) is True
    assert pipe.stats.last_stored_step is None


def test_capture_is_taken_at_submit_time():
    rec = Recorder()
    pipe = SnapshotPipeline(rec)
    live = state(1)
    pipe.submit(1, live)
    live["w"].fill_(-1.0)  # the train loop keeps going
    assert pipe.drain(WAIT)
    assert torch.equal(rec.received[0][1]["w"], torch.full((32,), 1.0))


def test_send_error_is_counted_and_pipeline_survives():
    received = []

    def send(snap: Snapshot) -> None:
        if snap.step == 2:
            raise ConnectionError("store is gone")
        received.append(snap.step)

    pipe = SnapshotPipeline(send)
    for step in range(5):
        pipe.submit(step, state(step))
    assert pipe.drain(WAIT) is True
    assert received == [0, 1, 3, 4]
    assert pipe.stats.errors == 1
    assert pipe.stats.last_error == "ConnectionError: store is gone"
    assert pipe.stats.last_stored_step == 4


def test_every_send_failing_still_drains():
    def send(snap):
        raise RuntimeError(f"nope {snap.step}")

    pipe = SnapshotPipeline(send)
    for step in range(4):
        pipe.submit(step, state(step))
    assert pipe.drain(WAIT) is True
    assert pipe.stats.errors == 4
    assert pipe.stats.last_error == "RuntimeError: nope 3"
    assert pipe.stats.last_stored_step is None


def test_backpressure_third_submit_waits_for_handover():
    entered = threading.Event()
    release = threading.Event()
    sent: list[int] = []

    def send(snap: Snapshot) -> None:
        entered.set()
        assert release.wait(WAIT), "test never released the send"
        sent.append(snap.step)

    pipe = SnapshotPipeline(send)
    try:
        pipe.submit(0, state(0))  # buffer A: being handed over, blocked in send
        assert entered.wait(WAIT)
        pipe.submit(1, state(1))  # buffer B: queued

        third_done = threading.Event()
        errors: list[BaseException] = []

        def third():
            try:
                pipe.submit(2, state(2))  # no free buffer until the send returns
            except BaseException as e:
                errors.append(e)
            finally:
                third_done.set()

        t = threading.Thread(target=third, daemon=True)
        t.start()
        assert not third_done.wait(0.2), "third submit should block while both buffers are busy"
        assert pipe.stats.captures == 2
        assert pipe.drain(0.05) is False

        release.set()
        assert third_done.wait(WAIT)
        t.join(WAIT)
        assert errors == []
        assert pipe.drain(WAIT) is True
        assert sent == [0, 1, 2]
        assert pipe.stats.captures == 3
        assert pipe.stats.wait_seconds > 0
    finally:
        release.set()

"""orchestrator/supervisor/ray_nodes.py: the control loop takes Ray's node table without
ever waiting on the GCS (a GCS restarting holds such a read until it is back)."""

from __future__ import annotations

import threading
import time

import pytest

from stalwart.orchestrator.supervisor.ray_nodes import RayNodeTable

pytestmark = pytest.mark.timeout(30)


def _until(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.01)  # polling a thread's result, bounded by the deadline
    raise AssertionError("not within the deadline")


def _rows(alive: dict[str, bool]) -> list[dict]:
    """Ray's node table (ray.nodes()) with these nodes, each raylet on a port of its own."""
    return [
        {"NodeID": n, "Alive": a, "NodeManagerAddress": "10.0.0.1", "NodeManagerPort": 7000 + i}
        for i, (n, a) in enumerate(sorted(alive.items()))
    ]


def test_a_read_held_by_the_gcs_never_holds_the_taker():
    release = threading.Event()
    answers = iter([RuntimeError("GCS away"), _rows({"a": True}), _rows({"a": False})])

    def read():
        answer = next(answers, None)
        if answer is None:
            release.wait()  # the GCS is down: the read waits until it is back
            return _rows({"a": True, "b": True})
        if isinstance(answer, Exception):
            raise answer
        return answer

    table = RayNodeTable(0.01, read)
    t0 = time.monotonic()
    assert table.take() is None  # starts the reader, returns at once
    assert _until(lambda: table.take() == {"a": False} or None)  # the newest, taken once
    assert table.take() is None  # the reader is held in its read now
    # The raylets' addresses (the raylet probe's) are the reads' so far, never waited for.
    assert table.raylets() == {"a": ("10.0.0.1", 7000)}
    assert time.monotonic() - t0 < 5.0
    release.set()
    assert _until(table.take) == {"a": True, "b": True}
    assert table.raylets() == {"a": ("10.0.0.1", 7000), "b": ("10.0.0.1", 7001)}
    table.close()

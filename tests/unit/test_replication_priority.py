"""The replicator's two sending threads (orchestrator/agent/replication.py): a calm one at
nice 10 while it keeps up, the urgent one at full priority once a rank's copies fall
`urgent_strides` behind or shards wait `urgent_after_s`; never both at once. No Ray: the
store's shards are gone by the time they are sent, so nothing goes out."""

from __future__ import annotations

import os
import threading
import time

import pytest

from stalwart.orchestrator.agent.replication import CALM_NICE, Replicator

pytestmark = pytest.mark.timeout(30)


class _Store:
    """Records which thread asked for each shard; the first ask waits for `gate`."""

    def __init__(self):
        self.gate = threading.Event()
        self.asked: list[tuple[int, str, int]] = []  # (step, thread name, its niceness)
        self._lock = threading.Lock()

    def stored(self):
        return {}

    def get(self, rank, step):
        with self._lock:
            first = not self.asked
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.asked.append((step, threading.current_thread().name, nice))
        if first:
            self.gate.wait(10)  # the calm thread, starved in the middle of a send
        return None


def _until(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_sender_strides_behind_hands_over_to_the_urgent_thread_until_caught_up():
    store = _Store()
    rep = Replicator(store, urgent_strides=2, urgent_after_s=60)
    try:
        rep.set_peers({"peer": object()})
        rep.offer(0, 1)
        _until(lambda: len(store.asked) == 1)
        for step in (2, 3, 4):  # three newer shards while step 1 is on its way: behind
            rep.offer(0, step)
        assert rep.status()["sends"]["urgent"] == 0  # never two sends at once
        store.gate.set()
        _until(lambda: len(store.asked) == 2)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert store.asked[0][1:] == ("stalwart-replicate", max(base, CALM_NICE))
        assert store.asked[1] == (4, "stalwart-replicate-urgent", base)  # the newest only
        assert rep.status()["sends"]["urgent"] == 1
        rep.offer(0, 5)  # caught up: the calm thread again
        _until(lambda: len(store.asked) == 3)
        assert store.asked[2][:2] == (5, "stalwart-replicate")
        _until(lambda: rep.status()["rounds"] == 3)
    finally:
        rep.close()


def test_shards_waiting_too_long_go_urgent():
    store = _Store()
    rep = Replicator(store, urgent_strides=100, urgent_after_s=0.3)
    try:
        rep.set_peers({"peer": object()})
        rep.offer(0, 1)
        _until(lambda: len(store.asked) == 1)
        rep.offer(1, 1)
        time.sleep(0.4)  # the calm thread is stuck past urgent_after_s (no other way to wait)
        store.gate.set()
        _until(lambda: len(store.asked) == 2)
        assert store.asked[1][:2] == (1, "stalwart-replicate-urgent")
    finally:
        rep.close()

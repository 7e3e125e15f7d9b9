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


class _Recording(Replicator):
    """Sends nothing: records each (rank, step) it would send; the first waits for `gate`."""

    def __init__(self, **kw):
        self.gate = threading.Event()
        self.sent: list[tuple[int, int]] = []
        self.replicated: list[tuple[int, int, int | None]] = []
        super().__init__(_Store(), on_replicated=lambda *a: self.replicated.append(a), **kw)

    def _send(self, rank, step, peers, gen=None):
        if not self.sent:
            self.gate.wait(10)
        self.sent.append((rank, step))
        return 1, "sent"


def test_with_a_bounded_lag_every_shard_on_the_grid_is_sent_in_order_and_reported():
    """checkpoint.max_lag_steps: nothing skipped (the ranks' copies never end up on
    different steps), oldest first, each reported with the generation that wrote it."""
    rep = _Recording(urgent_strides=100, urgent_after_s=60)
    try:
        rep.set_stride(2, bounded=True)
        rep.set_peers({"peer": object()})
        rep.offer(0, 0, 1)
        _until(lambda: rep.status()["queued"] == 0)  # taken: its send waits at the gate
        for step in range(1, 7):
            for rank in (1, 0):
                rep.offer(rank, step, 1)
        assert rep.pinned() >= {2, 4, 6}  # queued shards stay in the store
        rep.gate.set()
        _until(lambda: len(rep.replicated) == 7)
        assert rep.sent == [(0, 0), (0, 2), (1, 2), (0, 4), (1, 4), (0, 6), (1, 6)]
        assert rep.replicated == [(r, s, 1) for r, s in rep.sent]
    finally:
        rep.close()


def test_without_a_bound_a_sender_behind_skips_to_each_ranks_newest():
    rep = _Recording(urgent_strides=100, urgent_after_s=60)
    try:
        rep.set_peers({"peer": object()})
        rep.offer(0, 0, 1)
        _until(lambda: rep.status()["queued"] == 0)
        for step in range(1, 5):
            rep.offer(0, step, 1)
        rep.gate.set()
        _until(lambda: len(rep.replicated) == 2)
        assert rep.sent == [(0, 0), (0, 4)]
    finally:
        rep.close()


def test_with_a_bounded_lag_a_failed_copy_is_sent_again_and_a_damaged_one_passed():
    """A rank waits for its copy: one a peer failed is sent again (after a back-off) rather
    than left behind, and one that cannot be sent (damaged) is reported as passed, so that
    its rank is not held forever."""

    class Flaky(_Recording):
        outcomes = {(0, 2): ["failed", "sent"], (0, 4): ["unsendable"]}

        def _send(self, rank, step, peers, gen=None):
            self.sent.append((rank, step))
            todo = self.outcomes.get((rank, step), [])
            return 1, todo.pop(0) if todo else "sent"

    rep = Flaky(urgent_strides=100, urgent_after_s=60)
    try:
        rep.set_stride(2, bounded=True)
        rep.set_peers({"peer": object()})
        for step in (2, 4, 6):
            rep.offer(0, step, 3)
        _until(lambda: len(rep.replicated) == 3)
        assert rep.sent == [(0, 2), (0, 2), (0, 4), (0, 6)]
        assert rep.replicated == [(0, 2, 3), (0, 4, 3), (0, 6, 3)]
    finally:
        rep.close()


def test_a_rollback_undoes_the_queued_shards_of_the_old_generation():
    """Generation 2 restarted from step 56 and writes step 57 again: generation 1's queued
    57 and 58 go (sent, they would be refused as fenced while the new 57 waited behind
    them); its 55 and 56 (the job's history) stay, and a new generation's entries too."""
    from stalwart.orchestrator.agent.replication import unrolled

    queued = [(55, 1), (56, 1), (57, 1), (58, 1)]
    assert unrolled(queued, 57, 2) == [(55, 1), (56, 1)]
    assert unrolled(queued, 59, 1) == queued  # the same generation: nothing undone
    assert unrolled([(57, 2), (58, None)], 57, 2) == [(57, 2), (58, None)]
    assert unrolled(queued, 57, None) == queued  # a writer not known: nothing undone

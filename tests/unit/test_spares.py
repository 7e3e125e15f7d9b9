"""supervisor/spares.py: a spare that failed to start or died with its node is started
again by the next refill, in its slot where that slot's node is healthy, and a spare that
cannot start at all is not started forever (RESTARTS per spare the job has)."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.supervisor import spares as spares_mod
from stalwart.orchestrator.supervisor.spares import RESTARTS, Spares
from stalwart.orchestrator.supervisor.startup import StartupClock

pytestmark = pytest.mark.timeout(30)


class _Actor:
    def __init__(self, slot):
        self.slot = slot
        self.ready = self  # .ready.remote() -> a "ref": the actor itself

    def remote(self, *args):
        return self


def _spares(monkeypatch, per_job=1, bad=frozenset()):
    killed, started, events = [], [], []
    monkeypatch.setattr(spares_mod.ray, "kill", lambda a, no_restart: killed.append(a))

    def create(slot):
        started.append(slot)
        return _Actor(slot)

    warm = Spares(
        per_job,
        create,
        agent_of=lambda node: None,
        usable=lambda slot: None if slot == 9 else slot,  # slot 9's node is bad
        bad_nodes=lambda: set(bad),
        clock=StartupClock(),
        emit=lambda kind, **kw: events.append(kind),
    )
    return warm, killed, started


def test_spares_lost_with_their_node_are_started_again_by_the_next_refill(monkeypatch):
    """(Not during a recovery: its replacements take the room first.)"""
    warm, killed, started = _spares(monkeypatch, per_job=2)
    a, b, c = _Actor(4), _Actor(9), _Actor(5)
    warm.ready = [(a, 4, "n1"), (b, 9, "n1"), (c, 5, "n2")]
    assert warm.drop_node("n1") == 2
    assert killed == [a, b] and [s for _, s, _ in warm.ready] == [5]
    assert started == []  # not during the recovery: its replacements come first
    warm.refill()
    assert started == [4, None]  # slot 9 is on a bad node: anywhere healthy instead
    assert warm.slots() == {4, 5} and not warm.refills


def test_a_spare_that_keeps_failing_is_given_up_after_its_restarts(monkeypatch):
    warm, _, started = _spares(monkeypatch, per_job=1)
    for _ in range(RESTARTS + 2):
        warm.lost(4)
        warm.refill()
    assert started == [4] * RESTARTS


def test_only_failures_in_a_row_count_and_lost_nodes_never(monkeypatch):
    warm, _, started = _spares(monkeypatch, per_job=1)
    for _ in range(RESTARTS - 1):
        warm.lost(4)
    monkeypatch.setattr(spares_mod.ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(spares_mod.ray, "get", lambda ref, timeout=None: {"node_id": "n1"})
    ok = _Actor(4)
    ok.attach = ok  # attach.remote(agent) -> a "ref"
    warm.starting = {ok: (ok, 4)}
    warm.check()  # one started: the count starts again
    assert warm.failures == 0 and [s for _, s, _ in warm.ready] == [4]
    for _ in range(10):  # its node lost, over and over: always started again
        warm.drop_node("n1")
        warm.ready = [(_Actor(4), 4, "n1")]
    warm.refill()
    assert len(started) == RESTARTS - 1 + 10


def test_nodes_are_the_healthy_ones_with_a_ready_spare(monkeypatch):
    warm, _, _ = _spares(monkeypatch, bad={"n2"})
    warm.ready = [(_Actor(4), 4, "n1"), (_Actor(5), 5, "n2")]
    assert warm.nodes() == frozenset({"n1"})

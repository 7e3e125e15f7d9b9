"""supervisor/standby.py Standbys: each node is filled to the depth asked, ready and
starting counted together; a node's standbys are taken oldest first, one that died is
passed over for the next; a lost node's are all stopped."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.supervisor import spares as spares_mod
from stalwart.orchestrator.supervisor import standby as standby_mod
from stalwart.orchestrator.supervisor.standby import Standbys

pytestmark = pytest.mark.timeout(30)


class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    def __init__(self, node, dead=False):
        self.node, self.dead, self.rank = node, dead, None
        self.ready = _Call(lambda: ("ready", self))
        self.assume = _Call(lambda rank: ("assume", self, rank))


def _standbys(monkeypatch, done=True):
    """Standbys whose ready() calls return at once when `done`; ray.get of a dead actor's
    assume raises like Ray does."""
    started, killed, events = [], [], []
    monkeypatch.setattr(
        spares_mod.ray,
        "wait",
        lambda refs, num_returns, timeout: (list(refs) if done else [], []),
    )

    def get(ref, timeout=None):
        if ref[0] == "assume":
            actor = ref[1]
            if actor.dead:
                raise standby_mod.GONE[0]("the actor died")
            actor.rank = ref[2]
        return None

    monkeypatch.setattr(standby_mod.ray, "get", get)
    monkeypatch.setattr(standby_mod.ray, "kill", lambda a, no_restart: killed.append(a))

    def start(node):
        actor = _Actor(node)
        started.append(actor)
        return actor

    return Standbys(start, lambda kind, **kw: events.append(kind)), started, killed, events


def test_fill_tops_each_node_up_to_the_depth_counting_those_starting(monkeypatch):
    standbys, started, _, _ = _standbys(monkeypatch, done=False)
    standbys.fill({"n1", "n2"}, 1)
    assert sorted(a.node for a in started) == ["n1", "n2"]
    standbys.fill({"n1", "n2"}, 1)  # still starting: none more
    assert len(started) == 2
    standbys.fill({"n1", "n2"}, 2)
    assert sorted(a.node for a in started) == ["n1", "n1", "n2", "n2"]
    assert standbys.count() == 0 and len(standbys.actors()) == 4


def test_a_node_gives_its_oldest_ready_standby_and_passes_over_a_dead_one(monkeypatch):
    standbys, started, killed, events = _standbys(monkeypatch)
    standbys.fill({"n1"}, 3)
    standbys.poll()
    assert standbys.count() == 3 and standbys.ready_nodes() == {"n1"}
    first, second, third = started
    first.dead = True
    assert standbys.take("n1", 5) is second and second.rank == 5
    assert killed == [first] and events.count("standby_failed") == 1
    assert standbys.take("n1", 6) is third
    assert standbys.take("n1", 7) is None and standbys.ready_nodes() == set()
    assert standbys.take(None, 7) is None
    # The next fill starts the two used and the dead one again.
    standbys.fill({"n1"}, 3)
    assert len(started) == 6


def test_a_lost_node_loses_all_its_standbys_ready_and_starting(monkeypatch):
    standbys, _, killed, _ = _standbys(monkeypatch)
    standbys.fill({"n1", "n2"}, 2)
    standbys.poll()
    monkeypatch.setattr(spares_mod.ray, "wait", lambda refs, num_returns, timeout: ([], []))
    standbys.fill({"n1", "n2"}, 3)  # one more each, starting
    standbys.drop({"n1"})
    assert sorted(a.node for a in killed) == ["n1"] * 3
    assert standbys.ready_nodes() == {"n2"} and standbys.count() == 2
    assert sorted(a.node for a in standbys.actors()) == ["n2"] * 3

"""An agent silent past its timeout on a node whose raylet still answers is starved, not
lost (health/liveness.py starved, starved_nodes, lost_nodes), up to its own limit; and the
probe that asks a raylet for a connection off the control loop
(orchestrator/supervisor/raylet_probe.py), against real sockets on loopback."""

from __future__ import annotations

import socket
import time

import pytest

from stalwart.health.liveness import ANSWER_FRESH_S, lost_nodes, starved_nodes
from stalwart.health.observations import NodeView
from stalwart.orchestrator.supervisor.raylet_probe import RayletProbe, connect, connect_all

pytestmark = pytest.mark.timeout(60)

NOW = 1_000.0
BEAT = 3.0  # health.heartbeat_timeout_s
LIMIT = 15.0  # health.starved_agent_timeout_s


def node(silent_s: float, answered_ago_s: float | None, **kw) -> NodeView:
    """Silent for `silent_s`; its raylet answered a probe begun `answered_ago_s` ago."""
    return NodeView(
        "node-a",
        unanswered_since=NOW - silent_s,
        raylet_answered_at=None if answered_ago_s is None else NOW - answered_ago_s,
        **kw,
    )


def lost(n: NodeView, limit: float = LIMIT) -> list[str]:
    return lost_nodes([n], NOW, BEAT, starved_timeout_s=limit)[0]


def test_a_silent_agent_whose_raylet_answered_during_the_silence_is_starved_not_lost():
    n = node(silent_s=4.0, answered_ago_s=0.5)
    assert lost(n) == []
    assert starved_nodes([n], NOW, BEAT, LIMIT) == [("node-a", 4.0)]


def test_a_silent_agent_whose_raylet_does_not_answer_is_lost_at_the_timeout():
    assert lost(node(silent_s=3.0, answered_ago_s=None)) == ["node-a"]


def test_an_answer_from_before_the_silence_says_nothing_of_it():
    # The raylet answered during an earlier silence; this one began after.
    assert lost(node(silent_s=4.0, answered_ago_s=4.5)) == ["node-a"]


def test_an_answer_older_than_the_freshness_bound_says_nothing_of_now():
    # The host answered early in the silence, then nothing: it may have gone since.
    n = node(silent_s=8.0, answered_ago_s=ANSWER_FRESH_S + 0.1)
    assert lost(n) == ["node-a"] and starved_nodes([n], NOW, BEAT, LIMIT) == []
    assert lost(node(silent_s=8.0, answered_ago_s=ANSWER_FRESH_S)) == []


def test_a_starved_agent_loses_its_node_at_its_limit_and_says_why():
    n = node(silent_s=LIMIT, answered_ago_s=0.2)
    found, reason = lost_nodes([n], NOW, BEAT, starved_timeout_s=LIMIT)
    assert found == ["node-a"]
    assert "raylet answering" in reason and "starved_agent_timeout_s=15" in reason
    assert lost(node(silent_s=LIMIT - 0.1, answered_ago_s=0.2)) == []


def test_a_limit_at_or_below_the_timeout_turns_it_off():
    assert lost(node(silent_s=3.5, answered_ago_s=0.2), limit=0.0) == ["node-a"]
    assert lost(node(silent_s=3.5, answered_ago_s=0.2), limit=BEAT) == ["node-a"]


def test_below_the_timeout_nobody_is_starved_or_lost():
    n = node(silent_s=2.0, answered_ago_s=0.2)
    assert lost(n) == [] and starved_nodes([n], NOW, BEAT, LIMIT) == []


def test_dead_in_ray_or_a_dead_agent_is_lost_whatever_its_raylet_said():
    assert lost(node(silent_s=4.0, answered_ago_s=0.2, ray_alive=False)) == ["node-a"]
    assert lost(node(silent_s=4.0, answered_ago_s=0.2, agent_dead=True)) == ["node-a"]
    n = node(silent_s=4.0, answered_ago_s=0.2, agent_dead=True)
    assert starved_nodes([n], NOW, BEAT, LIMIT) == []


# --- the probe, on real sockets ----------------------------------------------------------------


@pytest.fixture
def listening():
    """A port on loopback that accepts connections (a raylet's, as far as TCP goes)."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def closed():
    """A port on loopback nothing listens on (a killed raylet's): refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_connect_tells_a_listening_port_from_a_closed_one(listening, closed):
    assert connect("127.0.0.1", listening, 0.5) is True
    assert connect("127.0.0.1", closed, 0.5) is False


def test_every_silent_node_is_asked_at_once(listening, closed):
    addresses = {
        "up": ("127.0.0.1", listening),
        "up-again": ("127.0.0.1", listening),
        "gone": ("127.0.0.1", closed),
        "no-such-host": ("no-such-host.invalid", 1),
    }
    assert connect_all(addresses, 0.5) == {"up", "up-again"}
    assert connect_all({}, 0.5) == set()


def test_the_probe_asks_its_nodes_in_one_round():
    rounds: list[dict] = []

    def connect_(addresses, timeout_s):
        rounds.append(dict(addresses))
        return {n for n in addresses if n != "b"}

    table = {n: (f"{n}-host", 1) for n in "abc"}
    probe = RayletProbe(lambda: table, connect=connect_, clock=lambda: 42.0)
    probe.probe_once()  # nothing watched: nothing asked
    assert rounds == []
    assert probe.up(["a", "b", "c", "unknown"]) == {"a", "c"}
    assert rounds == [table]


def _wait(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)  # polling what the probe's thread writes; bounded by the deadline
    return got


def test_the_probe_reports_the_watched_nodes_whose_raylet_answers(listening, closed):
    table = {"up": ("127.0.0.1", listening), "gone": ("127.0.0.1", closed)}
    reads = []

    def addresses():
        reads.append(1)
        return table

    probe = RayletProbe(addresses)
    try:
        assert probe.take() == {}  # nothing watched: no thread, no address asked for
        assert reads == []
        before = time.time()
        probe.watch(["up", "gone", "unknown"])
        answered = _wait(probe.take)
        assert set(answered) == {"up"} and answered["up"] >= before
        assert probe.up(["up", "gone", "unknown"]) == {"up"}
    finally:
        probe.close()

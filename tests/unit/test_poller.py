"""orchestrator/poller.py: one report request per agent in flight, answers taken as they come."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from orchestrator import poller as poller_module
from orchestrator.monitor import HealthMonitor
from orchestrator.poller import ReportPoller
from orchestrator.spec import HealthSpec

TIMEOUT = 3.0  # health.heartbeat_timeout_s


class Ref:
    """A fake object ref: one report request sent to `node`'s agent."""

    def __init__(self, node: str, n: int):
        self.node, self.n = node, n

    def __repr__(self) -> str:
        return f"Ref({self.node}#{self.n})"


class FakeRay:
    """ray.wait / ray.get over refs the test answers (or fails) when it likes."""

    def __init__(self) -> None:
        self.results: dict[Ref, Any] = {}
        self.waits: list[tuple[list[Ref], int, float]] = []
        self.gets: list[Ref] = []

    def wait(self, refs: list[Ref], num_returns: int, timeout: float):
        self.waits.append((list(refs), num_returns, timeout))
        ready = [r for r in refs if r in self.results][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref: Ref) -> Any:
        self.gets.append(ref)
        out = self.results[ref]
        if isinstance(out, BaseException):
            raise out
        return out


class Agents:
    """The `ask` callable: records every request and hands out its ref."""

    def __init__(self) -> None:
        self.sent: list[Ref] = []

    def __call__(self, node: str) -> Ref:
        ref = Ref(node, sum(r.node == node for r in self.sent))
        self.sent.append(ref)
        return ref

    def asked(self, node: str) -> int:
        return sum(r.node == node for r in self.sent)

    def last(self, node: str) -> Ref:
        return [r for r in self.sent if r.node == node][-1]


@pytest.fixture
def fake_ray(monkeypatch, clock) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(poller_module, "ray", fake)
    monkeypatch.setattr(poller_module, "time", SimpleNamespace(time=clock))
    return fake


@pytest.fixture
def agents() -> Agents:
    return Agents()


@pytest.fixture
def monitor() -> HealthMonitor:
    return HealthMonitor(HealthSpec(heartbeat_timeout_s=TIMEOUT))


@pytest.fixture
def poller(agents, monitor, fake_ray) -> ReportPoller:
    return ReportPoller(agents, monitor)


def answer(fake: FakeRay, ref: Ref, report: Any = None) -> dict[str, Any]:
    report = {"node": ref.node, "n": ref.n} if report is None else report
    fake.results[ref] = report
    return report


def test_first_poll_asks_every_node_once(poller, agents, fake_ray, clock):
    assert poller.poll(["a", "b"], wait_s=0.5) == []
    assert [r.node for r in agents.sent] == ["a", "b"]
    assert set(poller.outstanding) == {"a", "b"}
    assert poller.last_poll == clock.now
    [(refs, num_returns, timeout)] = fake_ray.waits
    assert set(refs) == set(agents.sent)
    assert (num_returns, timeout) == (2, 0.5)
    assert fake_ray.gets == []


def test_a_node_with_a_request_in_flight_is_not_asked_again(poller, agents, fake_ray, clock):
    poller.poll(["a", "b"])
    clock.advance(0.2)
    assert poller.poll(["a", "b"]) == []
    assert agents.asked("a") == agents.asked("b") == 1
    assert len(fake_ray.waits) == 2
    assert set(fake_ray.waits[1][0]) == set(agents.sent)  # still waiting on the first requests


def test_answers_are_returned_and_those_nodes_asked_again(poller, agents, fake_ray, clock):
    poller.poll(["a", "b"])
    report = answer(fake_ray, agents.last("a"), {"node": "a", "beats": {}})
    assert poller.poll(["a", "b"]) == [report]
    assert set(poller.outstanding) == {"b"}
    assert agents.asked("a") == 1  # taken this poll, asked again on the next
    poller.poll(["a", "b"])
    assert agents.asked("a") == 2
    assert agents.asked("b") == 1


def test_several_answers_in_one_poll(poller, agents, fake_ray):
    poller.poll(["a", "b", "c"])
    ra = answer(fake_ray, agents.last("a"))
    rc = answer(fake_ray, agents.last("c"))
    reports = poller.poll(["a", "b", "c"])
    assert sorted(reports, key=lambda r: r["node"]) == [ra, rc]
    assert set(poller.outstanding) == {"b"}


def test_a_node_is_watched_once_it_answered(poller, monitor, agents, fake_ray, clock):
    t0 = clock()
    poller.poll(["a"])
    assert monitor.nodes == {}  # asked, never answered: not watched
    answer(fake_ray, agents.last("a"))
    clock.advance(0.2)
    poller.poll(["a"])
    assert "a" in monitor.nodes
    assert monitor.nodes["a"].unanswered_since is None
    assert monitor.lost_nodes(t0 + 100)[0] == []


def test_silence_counts_from_the_oldest_unanswered_request(
    poller, monitor, agents, fake_ray, clock
):
    poller.poll(["a"])
    answer(fake_ray, agents.last("a"))
    poller.poll(["a"])
    t1 = clock.advance(0.2)
    poller.poll(["a"])  # asks again: the agent does not answer
    assert monitor.nodes["a"].unanswered_since == t1
    clock.advance(2.0)
    poller.poll(["a"])
    assert monitor.nodes["a"].unanswered_since == t1
    assert monitor.lost_nodes(t1 + TIMEOUT - 0.1)[0] == []
    lost, reason = monitor.lost_nodes(t1 + TIMEOUT)
    assert lost == ["a"]
    assert "agent silent" in reason
    # The late answer arrives: the node answers again.
    answer(fake_ray, agents.last("a"))
    poller.poll(["a"])
    assert monitor.nodes["a"].unanswered_since is None


def test_dead_agent_is_marked_dead(poller, monitor, agents, fake_ray):
    poller.poll(["a", "b"])
    answer(fake_ray, agents.last("a"))
    answer(fake_ray, agents.last("b"))
    poller.poll(["a", "b"])  # takes the answers: both nodes are watched
    poller.poll(["a", "b"])  # asks again
    fake_ray.results[agents.last("a")] = RayActorError()
    rb = answer(fake_ray, agents.last("b"))
    assert poller.poll(["a", "b"]) == [rb]
    assert monitor.nodes["a"].agent_dead is True
    assert monitor.nodes["b"].agent_dead is False
    assert monitor.lost_nodes(0.0) == (["a"], "node a: its agent died")
    assert "a" not in poller.outstanding


def test_unavailable_agent_stays_silent_but_alive(poller, monitor, agents, fake_ray, clock):
    poller.poll(["a"])
    answer(fake_ray, agents.last("a"))
    poller.poll(["a"])
    t1 = clock.advance(0.2)
    poller.poll(["a"])
    fake_ray.results[agents.last("a")] = ActorUnavailableError("agent unreachable", None)
    clock.advance(0.2)
    assert poller.poll(["a"]) == []
    assert monitor.nodes["a"].agent_dead is False
    assert monitor.nodes["a"].unanswered_since == t1  # its silence keeps counting
    assert "a" not in poller.outstanding
    clock.advance(0.2)
    poller.poll(["a"])  # asked again
    assert agents.asked("a") == 3
    assert monitor.nodes["a"].unanswered_since == t1
    assert monitor.lost_nodes(t1 + TIMEOUT)[0] == ["a"]


def test_discard_in_flight_asks_again_and_keeps_the_silence(
    poller, monitor, agents, fake_ray, clock
):
    poller.poll(["a", "b"])
    answer(fake_ray, agents.last("a"))
    poller.poll(["a", "b"])
    t1 = clock.advance(0.2)
    poller.poll(["a", "b"])
    stale = set(poller.outstanding.values())
    poller.discard_in_flight()
    assert poller.outstanding == {}
    clock.advance(0.2)
    poller.poll(["a", "b"])
    assert agents.asked("a") == 3
    assert agents.asked("b") == 2
    assert not stale & set(poller.outstanding.values())
    assert not stale & set(fake_ray.waits[-1][0])  # old requests are no longer waited on
    assert monitor.nodes["a"].unanswered_since == t1


def test_forget_drops_a_node(poller, agents, fake_ray):
    poller.poll(["a", "b"])
    forgotten = agents.last("a")
    poller.forget("a")
    poller.forget("never-asked")
    assert set(poller.outstanding) == {"b"}
    answer(fake_ray, forgotten)  # a late answer from the forgotten node is not taken
    assert poller.poll(["b"]) == []
    assert fake_ray.waits[-1][0] == [agents.last("b")]
    assert agents.asked("a") == 1


def test_nothing_to_ask_and_nothing_in_flight(poller, fake_ray, clock):
    assert poller.poll([]) == []
    assert fake_ray.waits == []
    assert poller.last_poll == clock.now

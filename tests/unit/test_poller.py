"""orchestrator/supervisor/poller.py: one report request per agent in flight, answers taken as
they come."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from stalwart.orchestrator.spec import HealthSpec
from stalwart.orchestrator.supervisor import poller as poller_module
from stalwart.orchestrator.supervisor.monitor import HealthMonitor
from stalwart.orchestrator.supervisor.poller import ReportPoller

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
    monkeypatch.setattr(poller_module, "time", SimpleNamespace(time=clock, monotonic=clock))
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
    assert fake_ray.waits == []  # nothing was in flight to collect
    clock.advance(0.2)
    assert poller.poll(["a", "b"]) == []
    assert agents.asked("a") == agents.asked("b") == 1
    [(refs, _, timeout)] = fake_ray.waits
    assert set(refs) == set(agents.sent) and timeout == 0.0  # still waiting on the first


def test_answers_are_taken_first_and_those_nodes_asked_again_at_once(
    poller, agents, fake_ray, clock
):
    poller.poll(["a", "b"])
    report = answer(fake_ray, agents.last("a"), {"node": "a", "beats": {}})
    assert poller.poll(["a", "b"]) == [report]
    # One request per node per poll in steady state: a answered and is asked again.
    assert set(poller.outstanding) == {"a", "b"}
    assert agents.asked("a") == 2
    assert agents.asked("b") == 1


def test_several_answers_in_one_poll(poller, agents, fake_ray):
    poller.poll(["a", "b", "c"])
    ra = answer(fake_ray, agents.last("a"))
    rc = answer(fake_ray, agents.last("c"))
    reports = poller.poll(["a", "b", "c"])
    assert sorted(reports, key=lambda r: r["node"]) == [ra, rc]
    assert (agents.asked("a"), agents.asked("b"), agents.asked("c")) == (2, 1, 2)


def test_a_node_is_watched_once_it_answered(poller, monitor, agents, fake_ray, clock):
    poller.poll(["a"])
    assert monitor.nodes == {}  # asked, never answered: not watched
    answer(fake_ray, agents.last("a"))
    t1 = clock.advance(0.2)
    poller.poll(["a"])
    assert "a" in monitor.nodes
    # Answered, then asked again in the same poll: silence counts from that request.
    assert monitor.nodes["a"].unanswered_since == t1
    assert monitor.lost_nodes(t1 + TIMEOUT - 0.1)[0] == []


def test_silence_counts_from_the_oldest_unanswered_request(
    poller, monitor, agents, fake_ray, clock
):
    poller.poll(["a"])
    answer(fake_ray, agents.last("a"))
    t1 = clock.advance(0.2)
    poller.poll(["a"])  # takes the answer, asks again: the agent does not answer this one
    assert monitor.nodes["a"].unanswered_since == t1
    clock.advance(2.0)
    poller.poll(["a"])
    assert monitor.nodes["a"].unanswered_since == t1
    assert agents.asked("a") == 2
    assert monitor.lost_nodes(t1 + TIMEOUT - 0.1)[0] == []
    lost, reason = monitor.lost_nodes(t1 + TIMEOUT)
    assert lost == ["a"]
    assert "agent silent" in reason
    # The late answer arrives: the silence ends, a new request starts a new count.
    answer(fake_ray, agents.last("a"))
    t2 = clock.advance(0.2)
    poller.poll(["a"])
    assert monitor.nodes["a"].unanswered_since == t2


def test_waiting_poll_asks_everyone_then_collects(poller, agents, fake_ray):
    poller.poll(["a", "b"])
    answer(fake_ray, agents.last("a"))
    poller.poll(["a", "b"], wait_s=2.0)
    # first the answer in hand, then the fresh requests waited on for up to 2 s
    assert [w[2] for w in fake_ray.waits] == [0.0, 2.0]
    assert set(fake_ray.waits[1][0]) == {agents.last("a"), agents.last("b")}


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
    poller.forget("a")  # what the supervisor does with a lost node
    assert "a" not in poller.outstanding


def test_unavailable_agent_stays_silent_but_alive(poller, monitor, agents, fake_ray, clock):
    poller.poll(["a"])
    answer(fake_ray, agents.last("a"))
    t1 = clock.advance(0.2)
    poller.poll(["a"])  # answered, asked again at t1
    fake_ray.results[agents.last("a")] = ActorUnavailableError("agent unreachable", None)
    clock.advance(0.2)
    assert poller.poll(["a"]) == []
    assert monitor.nodes["a"].agent_dead is False
    assert monitor.nodes["a"].unanswered_since == t1  # its silence keeps counting
    assert agents.asked("a") == 3  # the failed request is replaced at once


class TimedRef(Ref):
    """A ref whose reply arrives when the test says: future() as Ray's ObjectRef gives it."""

    def __init__(self, node: str, n: int):
        super().__init__(node, n)
        self.reply: concurrent.futures.Future = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future:
        return self.reply


def test_each_answers_round_trip_is_timed_at_its_arrival_not_at_the_next_poll(
    monitor, fake_ray, clock
):
    """A poll every report_interval_s would round a round trip up to it: the callback on
    the reply times it as it arrives. A failed answer is no round trip of the link."""
    sent: list[TimedRef] = []
    trips: list[tuple[str, float]] = []

    def ask(node: str) -> TimedRef:
        sent.append(TimedRef(node, len(sent)))
        return sent[-1]

    poller = ReportPoller(ask, monitor, lambda node, s: trips.append((node, round(s, 3))))
    poller.poll(["a", "b"])
    clock.advance(0.003)
    sent[0].reply.set_result({"node": "a"})
    clock.advance(0.2)
    sent[1].reply.set_result({"node": "b"})
    assert trips == [("a", 0.003), ("b", 0.203)]
    # The replies that arrived are the answers taken: not fetched again with ray.get.
    fake_ray.results.update({sent[0]: "unused", sent[1]: "unused"})
    assert poller.poll(["a", "b", "c"]) == [{"node": "a"}, {"node": "b"}]
    assert fake_ray.gets == []
    sent[4].reply.set_exception(RayActorError())  # c's request: an error, no round trip
    assert len(trips) == 2
    fake_ray.results[sent[4]] = "unused"
    assert poller.poll(["a", "b", "c"]) == []  # and its error is the answer taken
    assert fake_ray.gets == [] and sent[-1].node == "c"  # c asked again at once

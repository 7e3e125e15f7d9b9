"""supervisor/replica_plan.ReplicaPlan: which step the agents are asked to copy next."""

from __future__ import annotations

from types import SimpleNamespace

from stalwart.orchestrator.spec import CheckpointSpec
from stalwart.orchestrator.supervisor.replica_plan import REPLICATION_STALL_S, ReplicaPlan


class _Call:
    def __init__(self, log: list, name: str):
        self._log, self._name = log, name

    def remote(self, *args):
        self._log.append((self._name, *args))


class _Agent:
    def __init__(self):
        self.calls: list[tuple] = []
        for name in ("replicate", "set_stride", "set_peers"):
            setattr(self, name, _Call(self.calls, name))

    def asked(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "replicate"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plan(every: int = 10, clock: _Clock | None = None, max_lag: int | None = 2):
    agents = {"a": _Agent(), "b": _Agent()}
    pool = SimpleNamespace(agents=agents, bad=SimpleNamespace(lost=set()))
    events: list = []
    plan = ReplicaPlan(
        CheckpointSpec(every_steps=every, replicas=2, max_lag_steps=max_lag),
        pool,
        lambda kind, **f: events.append((kind, f)),
        clock=clock or _Clock(),
    )
    plan.sync()
    return plan, agents, events


def test_a_required_step_is_sent_at_once_whatever_the_stride():
    clock = _Clock()
    plan, agents, _ = _plan(clock=clock)
    plan.stride = 40  # thinned: 30 is not on the grid the agents send by themselves
    own = {0: {10, 20, 30}, 1: {10, 20, 30}}
    plan.replicate(own, committed=10, statuses={})  # a commit moved: nothing asked
    assert agents["a"].asked() == []
    plan.require(30)
    plan.replicate(own, committed=10, statuses={})
    assert agents["a"].asked() == [30] and agents["b"].asked() == [30]
    assert plan.replicating is not None and plan.replicating[0] == 30  # kept by trimming
    # Asked once per REPLICATION_ALIGN_S, not on every poll.
    clock.now += 0.5
    plan.replicate(own, committed=10, statuses={})
    assert agents["a"].asked() == [30]
    clock.now += 0.6
    plan.replicate(own, committed=10, statuses={})
    assert agents["a"].asked() == [30, 30]
    # Committed: the requirement is met and forgotten.
    plan.replicate(own, committed=30, statuses={})
    assert plan.required is None


def test_a_required_step_not_yet_in_every_ranks_memory_waits_for_it():
    plan, agents, _ = _plan(every=1)
    plan.require(15)
    plan.replicate({0: {13, 14, 15}, 1: {13, 14}}, committed=12, statuses={})
    assert agents["a"].asked() == []  # rank 1's hand-over of 15 is still on its way
    plan.replicate({0: {13, 14, 15}, 1: {13, 14, 15}}, committed=12, statuses={})
    assert agents["a"].asked() == [15]


def test_with_one_copy_nothing_is_sent():
    agents = {"a": _Agent()}
    plan = ReplicaPlan(
        CheckpointSpec(every_steps=1, replicas=2),
        SimpleNamespace(agents=agents, bad=SimpleNamespace(lost=set())),
        lambda kind, **f: None,
        clock=_Clock(),
    )
    plan.sync()
    assert plan.copies == 1
    plan.require(5)
    plan.replicate({0: {5}}, committed=4, statuses={})
    assert agents["a"].asked() == []
    plan.replicate({0: {5}}, committed=5, statuses={})
    assert plan.required is None


def test_the_plan_is_made_again_when_the_agents_report_which_shards_their_ranks_hold():
    agents = {n: _Agent() for n in "abcd"}
    pool = SimpleNamespace(agents=agents, bad=SimpleNamespace(lost=set()))
    events: list = []
    plan = ReplicaPlan(
        CheckpointSpec(replicas=2), pool, lambda kind, **f: events.append((kind, f)), _Clock()
    )
    plan.sync()
    assert events[-1][1]["groups"] == [["a", "b"], ["c", "d"]]
    # HSDP: a and b hold the same shard (replicas along the replicate dimension), c and d.
    plan.holds.update(
        a=frozenset({"s0"}), b=frozenset({"s0"}), c=frozenset({"s1"}), d=frozenset({"s1"})
    )
    plan.sync()
    assert [e[1]["groups"] for e in events if e[0] == "replica_plan"][-1] == [
        ["a", "c"],
        ["b", "d"],
    ]
    assert ("set_peers", {"c": agents["c"]}) in agents["a"].calls
    count = len(events)
    plan.sync()  # nothing changed: no new plan
    assert len(events) == count


def test_a_stalled_commit_is_aligned_without_a_bound_and_only_reported_with_one():
    for max_lag in (None, 2):
        clock = _Clock()
        plan, agents, events = _plan(every=1, clock=clock, max_lag=max_lag)
        own = {0: {40, 41, 42}, 1: {40, 41, 42}}
        plan.replicate(own, committed=39, statuses={})  # the commit moved to 39
        clock.now += REPLICATION_STALL_S + 1  # and stayed there
        plan.replicate(own, committed=39, statuses={"a": {"last_error": "peer b: refused"}})
        [fields] = [f for kind, f in events if kind == "replication_behind"]
        assert fields["newest_step"] == 42
        assert fields["errors"] == {"a": "peer b: refused"}
        if max_lag is None:
            assert agents["a"].asked() == [42] and plan.replicating[0] == 42
        else:  # every step is sent anyway; the ranks wait for theirs
            assert agents["a"].asked() == [] and plan.replicating is None


def test_the_stall_counts_from_the_first_step_that_could_be_copied_not_from_the_start():
    """A job whose workers took 40 s to start: its first step is not 40 s behind."""
    clock = _Clock()
    plan, _agents, events = _plan(every=1, clock=clock, max_lag=None)
    plan.replicate({0: set(), 1: set()}, committed=None, statuses={})
    clock.now += 40  # starting
    plan.replicate({0: {0}, 1: {0}}, committed=None, statuses={})
    assert [k for k, _ in events if k == "replication_behind"] == []
    clock.now += REPLICATION_STALL_S + 1  # step 0 copyable, and still not committed
    plan.replicate({0: {0, 1}, 1: {0, 1}}, committed=None, statuses={})
    [fields] = [f for kind, f in events if kind == "replication_behind"]
    assert fields["seconds"] == REPLICATION_STALL_S + 1

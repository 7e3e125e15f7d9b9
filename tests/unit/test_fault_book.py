"""orchestrator/chaos/faults.py's FaultBook: faults during recoveries, live injections, the
opt-ins a live fault needs, faults recalled from the agents; and the ledger's account of
failures that interrupt a recovery (orchestrator/supervisor/ledger.py)."""

from __future__ import annotations

import pytest

from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.orchestrator.chaos.faults import FaultBook, InjectRefused
from stalwart.orchestrator.observe.metrics import JobMetrics
from stalwart.orchestrator.spec import SpecError, validate
from stalwart.orchestrator.supervisor.ledger import Ledger


def _spec(*faults, enabled=False):
    return validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "workers": 4,
            "steps": 100,
            "chaos": {"enabled": enabled, "faults": list(faults)},
        }
    )


def _book(*faults, scope="job") -> FaultBook:
    spec = validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "workers": 4,
            "steps": 100,
            "chaos": {"faults": list(faults)},
        }
    )
    return FaultBook(spec.chaos.faults, scope)


def _gen(book, recovery=False, reached=0, events=None):
    emit = (lambda etype, **kw: events.append((etype, kw))) if events is not None else print
    return book.for_generation(lambda r: "n1", "head", emit, recovery=recovery, reached=reached)


def test_a_fault_during_a_recovery_rides_only_a_recovery_after_its_step():
    book = _book(
        {"kind": "kill_worker", "rank": 1, "at_step": 30},
        {"kind": "kill_worker", "rank": 2, "at_step": 30, "during": "restore"},
    )
    assert [f["index"] for f in _gen(book)] == [0]  # the first generation
    assert [f["index"] for f in _gen(book, recovery=True, reached=29)] == [0]
    both = _gen(book, recovery=True, reached=30)
    assert [(f["index"], f["during"]) for f in both] == [(0, None), (1, "restore")]


def test_kill_node_carries_its_scope():
    for scope in ("job", "raylet"):
        (f,) = _gen(_book({"kind": "kill_node", "rank": 1, "at_step": 5}, scope=scope))
        assert f["scope"] == scope


def test_live_faults_fire_at_the_next_step_and_name_their_target():
    book = _book()
    SPEC = _spec()
    ranks_on = {"abc123": [2, 3]}.get
    f = book.add_live({"kind": "kill_worker", "rank": 1, "by": "u@h"}, 41, SPEC, True, ranks_on)
    assert (f["index"], f["rank"], f["at_step"], f["live"]) == (0, 1, 42, True)
    f = book.add_live({"kind": "slow", "node": "abc123", "factor": 4}, 99, SPEC, True, ranks_on)
    assert (f["rank"], f["at_step"], f["factor"]) == (2, 99, 4.0)  # never past the end
    # Unfired live faults ride the next generation as live ones (fire at or after).
    assert [g.get("live") for g in _gen(book)] == [True, True]
    with pytest.raises(InjectRefused, match="no rank of this job runs on a node"):
        book.add_live({"kind": "kill_node", "node": "zzz"}, 1, SPEC, True, ranks_on)
    with pytest.raises(InjectRefused, match="rank: must be < workers"):
        book.add_live({"kind": "kill_worker", "rank": 7}, 1, SPEC, True, ranks_on)
    with pytest.raises(InjectRefused, match="not both"):
        book.add_live({"kind": "kill_node", "rank": 1, "node": "abc"}, 1, SPEC, True, ranks_on)
    with pytest.raises(InjectRefused, match="xid"):
        book.add_live({"kind": "gpu_xid", "rank": 1}, 1, SPEC, True, ranks_on)
    with pytest.raises(InjectRefused):
        book.add_live({"kind": "explode", "rank": 1}, 1, SPEC, True, ranks_on)


def test_live_faults_need_both_opt_ins_on_a_cluster_not_started_by_the_job():
    book = _book()
    ranks_on = {"abc": [0]}.get
    request = {"kind": "kill_worker", "rank": 1}
    with pytest.raises(InjectRefused, match="--allow-remote"):
        book.add_live(request, 1, _spec(enabled=True), False, ranks_on)
    fault = book.add_live(
        {**request, "allow_remote": True}, 1, _spec(enabled=True), False, ranks_on
    )
    assert fault["rank"] == 1
    assert FaultBook.refusal("j", True, False, {}) is None
    assert FaultBook.refusal("j", False, True, {"allow_remote": True}) is None
    both = FaultBook.refusal("j", False, False, {})
    assert "chaos.enabled: true" in both and "--allow-remote" in both
    assert "--allow-remote" not in FaultBook.refusal("j", False, False, {"allow_remote": True})
    assert "chaos.enabled" not in FaultBook.refusal("j", False, True, {})


def test_faults_an_agent_saw_are_recalled_once():
    book = _book(
        {"kind": "kill_supervisor", "rank": 0, "at_step": 10},
        {"kind": "kill_worker", "rank": 1, "at_step": 20},
    )
    book.record({"index": 1, "rank": 1, "kind": "kill_worker", "step": 20, "at": 1.0})
    events: list = []
    book.seen([0, 1], lambda etype, **kw: events.append((etype, kw)))
    book.seen([0], lambda etype, **kw: events.append((etype, kw)))
    assert [(k, kw["index"], kw["kind"]) for k, kw in events] == [
        ("fault_recalled", 0, "kill_supervisor")
    ]
    assert _gen(book) == []


def _failure(rank, at, step=None, kind=FailureKind.WORKER_DIED):
    return WorkerFailure(kind, rank, "n1", at, step=step)


def test_a_recovery_interrupted_by_another_failure_closes_with_the_next(monkeypatch):
    book = _book(
        {"kind": "kill_worker", "rank": 1, "at_step": 30},
        {"kind": "kill_worker", "rank": 2, "at_step": 30, "during": "restore"},
    )
    events: list = []
    ledger = Ledger(JobMetrics("j"), book, lambda etype, **kw: events.append((etype, kw)))
    book.record({"index": 0, "rank": 1, "kind": "kill_worker", "step": 30, "at": 100.0})
    first = ledger.record_failures([_failure(1, 100.1, 29)], 30, 100.2, reached=31)
    ledger.open(
        2, first, phases={}, decided_at=100.2, restore_step=30, replaced=[1], from_spares=[1]
    )
    book.record({"index": 1, "rank": 2, "kind": "kill_worker", "step": 30, "at": 101.0})
    # The second failure is seen before the first recovery's decision time (it joined it).
    second = ledger.record_failures([_failure(2, 101.1)], 30, 101.0, reached=0)
    ledger.open(
        3, second, phases={}, decided_at=101.0, restore_step=30, replaced=[2], from_spares=[]
    )
    beats = [{"timings": {"started": 102.0, "first_step_done": 103.0 + r * 0.1}} for r in range(4)]
    ledger.close_recovery(3, beats, 4, {"memory": 4}, {})
    f0, f1 = ledger.failures
    assert (f0["fault_index"], f1["fault_index"]) == (0, 1)
    assert f0["recovered_after_s"] == pytest.approx(3.3)
    assert f1["recovered_after_s"] == pytest.approx(2.3)
    assert f0["restore_tiers"] == f1["restore_tiers"] == {"memory": 4}
    assert f1["decided_after_s"] == 0.0  # never negative
    # Every rank replaced: no live rank remembers step 31, the failure's own step counts.
    assert f0["steps_redone"] == 1 and f1["steps_redone"] == 0
    [(_kind, rec)] = [e for e in events if e[0] == "recovered"]
    assert rec["recovered_after_s"] == [f0["recovered_after_s"], f1["recovered_after_s"]]


def test_a_node_faults_second_rank_seen_after_the_decision_is_explained_by_it():
    """kill_node takes a node's ranks one by one: the second one's death can be seen after
    the decision on the first (it joins that recovery) and is the same fault's, until the
    recovery closes; a later failure there is not."""
    book = _book({"kind": "kill_node", "rank": 0, "at_step": 30})
    ledger = Ledger(JobMetrics("j"), book, lambda etype, **kw: None)
    book.record(
        {"index": 0, "rank": 0, "kind": "kill_node", "step": 30, "node_id": "n1", "at": 100.0}
    )
    (first,) = ledger.record_failures([_failure(1, 100.1, 29)], 30, 100.2, reached=31)
    ledger.open(
        2, [first], phases={}, decided_at=100.2, restore_step=30, replaced=[1], from_spares=[]
    )
    (second,) = ledger.record_failures([_failure(0, 100.4, 29)], 30, 100.5, reached=31)
    assert first["fault_index"] == second["fault_index"] == 0
    other = WorkerFailure(FailureKind.WORKER_DIED, 2, "n2", 100.6, step=29)
    (third,) = ledger.record_failures([other], 30, 100.7, reached=31)
    assert third["fault_index"] is None  # another node's failure is not the fault's
    ledger.open(
        2,
        [second, third],
        phases={},
        decided_at=100.5,
        restore_step=30,
        replaced=[0, 2],
        from_spares=[],
    )
    beats = [{"timings": {"started": 101.0, "first_step_done": 102.0}} for _ in range(4)]
    ledger.close_recovery(2, beats, 4, {"memory": 4}, {})
    (later,) = ledger.record_failures([_failure(1, 200.0, 90)], 90, 200.1, reached=91)
    assert later["fault_index"] is None  # the recovery it caused is over


def test_fatal_and_from_scratch_failures_count_their_steps():
    book = _book()
    ledger = Ledger(JobMetrics("j"), book, lambda etype, **kw: None)
    (scratch,) = ledger.record_failures([_failure(1, 10.0, 45)], None, 10.1, reached=0)
    assert scratch["steps_redone"] == 45  # back to step 0: every step again
    (fatal,) = ledger.record_failures([_failure(2, 11.0, 50)], None, 11.1, 50, fatal=True)
    assert fatal["steps_redone"] is None  # nothing redone: the job ended


def test_a_divergence_every_rank_reported_is_one_failure_of_the_job():
    """Every rank's guard finds the same difference in one collective: however many of
    their reports reach the decision, the job has one failure (the first report's)."""
    ledger = Ledger(JobMetrics("j"), _book(), lambda etype, **kw: None)
    div = FailureKind.REPLICA_DIVERGENCE
    reports = [_failure(r, 10.0 + 0.01 * (3 - r), 15, kind=div) for r in range(4)]
    (only,) = ledger.record_failures(reports, None, 10.1, 15, fatal=True)
    assert (only["kind"], only["rank"]) == ("replica_divergence", 3)  # the earliest report
    # Beside another rank's own failure, both stay.
    died = _failure(1, 20.0, 15)
    kinds = ledger.record_failures([reports[0], died, reports[2]], None, 20.1, 15, fatal=True)
    assert sorted(f["kind"] for f in kinds) == ["replica_divergence", "worker_died"]


def test_a_fault_during_replace_is_the_supervisors_and_fires_once_when_due():
    book = _book(
        {"kind": "kill_worker", "rank": 1, "at_step": 30},
        {"kind": "kill_worker", "rank": 1, "at_step": 30, "during": "replace"},
    )
    # Never handed to a worker: the supervisor kills the replacement as it starts.
    assert [f["index"] for f in _gen(book, recovery=True, reached=40)] == [0]
    recorded: list = []
    assert not book.replacing(1, 29, "n1", recorded.append)  # not due yet
    assert not book.replacing(2, 40, "n1", recorded.append)  # another rank
    assert book.replacing(1, 31, "n1", recorded.append)
    assert not book.replacing(1, 35, "n1", recorded.append)  # once
    [fault] = recorded
    assert (fault["index"], fault["during"], fault["node_id"], fault["step"]) == (
        1,
        "replace",
        "n1",
        31,
    )


def test_a_successor_numbers_live_faults_past_those_its_predecessor_injected():
    # The spec has one fault; a predecessor injected live faults 1..3, of which the agents
    # saw 1 and 3 fire. The successor's next live fault takes index 4 and fires; 1..3 are
    # never carried (2 died unfired with the supervisor that held it).
    book = _book({"kind": "kill_supervisor", "rank": 0, "at_step": 10})
    book.seen([0, 1, 3], lambda etype, **kw: None)
    f = book.add_live({"kind": "kill_worker", "rank": 2}, 50, _spec(), True, {}.get)
    assert f["index"] == 4
    assert [(g["index"], g["kind"]) for g in _gen(book)] == [(4, "kill_worker")]
    book.seen([4], lambda etype, **kw: None)
    assert _gen(book) == []


def test_a_fault_on_a_ranks_replica_holder_goes_to_a_rank_on_that_node():
    book = _book(
        {"kind": "kill_node", "rank": 0, "at_step": 40},
        {"kind": "kill_node", "peer_of_rank": 0, "at_step": 40},
    )
    assert book.faults[1].rank == 0  # until a generation is handed it
    events: list = []
    emit = lambda etype, **kw: events.append((etype, kw))  # noqa: E731
    out = book.for_generation(lambda r: f"n{r // 2}", "head", emit, holder_of={0: 2}.get)
    assert [(f["index"], f["rank"], f["peer_of_rank"]) for f in out] == [
        (0, 0, None),
        (1, 2, 0),
    ]
    # No rank on a holder's node (one copy, or only spares there): refused, with the reason.
    book = _book({"kind": "drop_replicas", "peer_of_rank": 1, "at_step": 5})
    assert book.for_generation(lambda r: "n1", "head", emit, holder_of=lambda r: None) == []
    [(kind, refused)] = events
    assert kind == "fault_refused" and "copies of rank 1's shards" in refused["reason"]


def test_peer_of_rank_is_for_faults_that_hit_a_node():
    with pytest.raises(SpecError, match=r"chaos.faults.0.peer_of_rank: only for faults that hit"):
        _book({"kind": "kill_worker", "peer_of_rank": 1, "at_step": 5})


def test_a_job_that_is_not_running_takes_no_live_fault_yet():
    from stalwart.orchestrator.state import JobState

    book = _book()
    request = {"kind": "kill_worker", "rank": 1}
    with pytest.raises(InjectRefused, match="is RECOVERING, not RUNNING") as later:
        book.add_live(request, 5, _spec(), True, {}.get, JobState.RECOVERING)
    assert later.value.retry  # it takes faults again once it runs
    with pytest.raises(InjectRefused, match="is SUCCEEDED") as never:
        book.add_live(request, 5, _spec(), True, {}.get, JobState.SUCCEEDED)
    assert not never.value.retry
    assert book.faults == []


def test_a_kill_during_persist_goes_to_the_agent_writing_on_the_ranks_node():
    spec = validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "workers": 4,
            "steps": 100,
            "checkpoint": {"persist": {"uri": "/tmp/x"}},
            "chaos": {
                "faults": [{"kind": "kill_node", "rank": 2, "at_step": 40, "during": "persist"}]
            },
        }
    )
    book = FaultBook(spec.chaos.faults, "raylet")
    assert _gen(book) == []  # no worker carries it: the writing node's agent does
    recorded: list = []
    node_of = {0: "a", 1: "a", 2: "b", 3: "b"}.__getitem__
    assert book.persisting(20, ["a", "b"], node_of, recorded.append) == {}  # before at_step
    assert book.persisting(40, ["a"], node_of, recorded.append) == {}  # b writes nothing
    out = book.persisting(60, ["a", "b"], node_of, recorded.append)
    assert list(out) == ["b"]
    assert (out["b"]["index"], out["b"]["step"], out["b"]["scope"]) == (0, 60, "raylet")
    assert [r["node_id"] for r in recorded] == ["b"] and "at" in recorded[0]
    assert book.persisting(80, ["a", "b"], node_of, recorded.append) == {}  # once


def test_during_persist_is_a_kill_node_of_a_job_that_persists():
    fault = {"kind": "kill_worker", "rank": 1, "at_step": 5, "during": "persist"}
    with pytest.raises(SpecError, match=r"during: persist is for a kill_node .* no persist.uri"):
        _book(fault)


def test_a_kill_during_a_snapshot_rides_every_generation_until_it_fires():
    book = _book({"kind": "kill_worker", "rank": 1, "at_step": 30, "during": "snapshot"})
    assert [f["during"] for f in _gen(book)] == ["snapshot"]  # not only in a recovery
    book.record({"index": 0, "rank": 1, "kind": "kill_worker", "step": 31, "at": 1.0})
    assert _gen(book, recovery=True, reached=40) == []
    with pytest.raises(SpecError, match="during: snapshot is for a kill_worker, not hang"):
        _book({"kind": "hang", "rank": 1, "at_step": 30, "during": "snapshot"})

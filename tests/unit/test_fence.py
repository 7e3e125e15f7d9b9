"""orchestrator/agent/fence.py: what a node's record of its job's rollbacks makes stale."""

from __future__ import annotations

from stalwart.orchestrator.agent.fence import KEPT, Fence


def test_hand_overs_of_an_ended_generation_are_stale_whatever_their_step():
    fence = Fence()
    assert not fence.stale(1) and not fence.stale(None)
    fence.rolled_back(3, 40)
    assert fence.stale(1) and fence.stale(2) and not fence.stale(3) and not fence.stale(None)
    fence.rolled_back(2, 10)  # a late, older rollback lowers nothing
    assert fence.generation == 3


def test_a_copy_is_refused_only_above_the_restore_step_of_a_rollback_after_it():
    fence = Fence()
    fence.rolled_back(2, 40)  # generation 2 restarted from step 40
    assert fence.refuses(1, 40) is None  # the job's history: kept
    assert fence.refuses(1, 41) == (
        "step 41 written by generation 1, fenced off: generation 2 restarted from step 40"
    )
    assert fence.refuses(2, 41) is None and fence.refuses(None, 99) is None
    fence.rolled_back(3, 30)  # generation 3 went further back
    assert fence.refuses(2, 35) is not None and fence.refuses(2, 30) is None
    assert fence.refuses(1, 35) is not None  # by both
    fence.rolled_back(4, None)  # from scratch: every older copy
    assert "restarted from step -1" in fence.refuses(3, 0)


def test_it_remembers_a_bounded_number_of_rollbacks():
    fence = Fence()
    for g in range(1, 3 * KEPT):
        fence.rolled_back(g + 1, 1000)
    assert len(fence._rollbacks) == KEPT
    assert fence.refuses(3 * KEPT - 1, 1001) is not None


def test_refusals_are_told_once_per_path_and_generation():
    from stalwart.orchestrator.agent.fence import Refusals

    r = Refusals()
    for _ in range(3):  # a fenced generation's ranks try every step
        r.note("ring", 1, "rank 0's snapshot of step 41 refused")
    r.note("replicas", 1, "a peer's copy refused")
    r.note("ring", 2, "rank 0's snapshot of step 90 refused")
    notes = r.take()
    assert [(n["type"], n["path"], n["generation"]) for n in notes] == [
        ("fenced", "ring", 1),
        ("fenced", "replicas", 1),
        ("fenced", "ring", 2),
    ]
    r.note("ring", 1, "again")
    assert r.take() == []


def test_the_supervisor_refuses_a_replaced_process_and_says_so_once():
    from stalwart.orchestrator.supervisor.fencing import CallerFence

    events: list = []
    info = {1: {"pid": 200, "node_id": "n2"}}
    gen = [3]
    fence = CallerFence(lambda: info, lambda: gen[0], lambda t, **kw: events.append((t, kw)))
    old = {"rank": 1, "pid": 100, "generation": 2, "node_id": "n1"}
    assert fence.refuses(old, "an exactness warning")
    assert fence.refuses(old, "a storage outage")  # refused again, told once
    [(kind, event)] = events
    assert kind == "fenced" and event["path"] == "supervisor" and event["node"] == "n1"
    assert event["rank"] == 1 and event["generation"] == 2
    assert (
        "pid 100" in event["reason"]
        and "pid 200 holds the rank in generation 3" in (event["reason"])
    )
    # The rank's process now, whatever generation it names; a kept process; no caller.
    assert not fence.refuses({"rank": 1, "pid": 200, "generation": 2}, "x")
    assert not fence.refuses({"rank": 1, "pid": 100, "generation": 3}, "x")
    assert not fence.refuses(None, "x")

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

"""ckpt/commit.py: a step is committed only when every rank stored it."""

from __future__ import annotations

import pytest

from stalwart.ckpt.commit import CommitTracker


def test_nothing_committed_initially():
    ct = CommitTracker(world_size=3)
    assert ct.committed is None
    assert ct.retained == ()
    assert ct.droppable_below() is None


def test_keep_must_be_positive():
    with pytest.raises(AssertionError):
        CommitTracker(2, keep=0)


def test_committed_only_when_every_rank_stored():
    ct = CommitTracker(world_size=3)
    assert ct.observe({0: [0]}) is None
    assert ct.observe({1: [0]}) is None
    assert ct.committed is None
    assert ct.observe({2: [0]}) == 0
    assert ct.committed == 0


def test_observe_all_at_once():
    ct = CommitTracker(2)
    assert ct.observe({0: [0, 1, 2], 1: [0, 1, 2]}) == 2
    assert ct.retained == (1, 2)


def test_keeps_the_last_two():
    ct = CommitTracker(2)
    for step in range(5):
        ct.observe({0: [step], 1: [step]})
    assert ct.committed == 4
    assert ct.retained == (3, 4)


def test_keep_one_and_three():
    one = CommitTracker(1, keep=1)
    three = CommitTracker(1, keep=3)
    for step in range(5):
        one.observe({0: range(step + 1)})
        three.observe({0: range(step + 1)})
    assert one.retained == (4,)
    assert one.droppable_below() == 4
    assert three.retained == (2, 3, 4)
    assert three.droppable_below() == 2


def test_droppable_below_needs_keep_commits():
    ct = CommitTracker(2)
    ct.observe({0: [0], 1: [0]})
    assert ct.droppable_below() is None
    ct.observe({0: [0, 1], 1: [0, 1]})
    assert ct.droppable_below() == 0
    ct.observe({0: [0, 1, 2], 1: [0, 1, 2]})
    assert ct.droppable_below() == 1


def test_observe_replaces_a_ranks_steps():
    ct = CommitTracker(2)
    ct.observe({0: [0, 1], 1: [0, 1]})
    # Stores dropped step 0: the report is the full current set, not an addition.
    assert ct.observe({0: [1, 2], 1: [1]}) == 1
    assert ct.observe({1: [1, 2]}) == 2
    assert ct.retained == (1, 2)


def test_commit_never_goes_backwards():
    ct = CommitTracker(2)
    ct.observe({0: [4, 5], 1: [4, 5]})
    assert ct.committed == 5
    # A late report listing only older steps does not un-commit anything.
    assert ct.observe({0: [3], 1: [3]}) == 5
    assert ct.retained == (4, 5)


def test_lockstep_skew_of_one_step():
    # Rank 1 is one snapshot behind rank 0 at every observation.
    ct = CommitTracker(2)
    history = []
    for step in range(1, 6):
        history.append(ct.observe({0: [step - 1, step], 1: [step - 2, step - 1]}))
    assert history == [0, 1, 2, 3, 4]
    assert ct.retained == (3, 4)
    assert ct.droppable_below() == 3
    # Rank 1 catches up.
    assert ct.observe({1: [4, 5]}) == 5


def test_ranks_at_different_steps_commit_common_newest():
    ct = CommitTracker(4)
    ct.observe({0: [7, 8, 9], 1: [8, 9], 2: [6, 7, 8], 3: [8]})
    assert ct.committed == 8


def test_rollback_forgets_newer_commits_and_stores():
    ct = CommitTracker(2)
    ct.observe({0: [3, 4, 5], 1: [3, 4, 5]})
    assert ct.retained == (4, 5)
    ct.rollback(4)
    assert ct.committed == 4
    assert ct.retained == (4,)
    assert ct.droppable_below() is None
    # Step 5 is not committed again until every rank reports it again.
    assert ct.observe({0: [4, 5]}) == 4
    assert ct.observe({1: [4, 5]}) == 5


def test_rollback_to_current_is_noop():
    ct = CommitTracker(2)
    ct.observe({0: [1, 2], 1: [1, 2]})
    ct.rollback(2)
    assert ct.retained == (1, 2)


def test_rollback_then_replay_same_steps():
    ct = CommitTracker(2)
    for step in range(6):
        ct.observe({0: [step], 1: [step]})
    ct.rollback(5)
    ct.observe({0: [4, 5, 6], 1: [4, 5, 6]})
    assert ct.retained == (5, 6)


def test_rollback_below_everything():
    ct = CommitTracker(2)
    ct.observe({0: [4, 5], 1: [4, 5]})
    ct.rollback(2)
    assert ct.committed is None
    assert ct.retained == ()
    assert ct.observe({0: [2], 1: [2]}) == 2


# --- with_copies: the steps that count when shards are replicated ------------------------


def test_with_copies_one_copy_is_what_the_own_stores_hold():
    from stalwart.ckpt.commit import with_copies

    assert with_copies({0: [1, 2], 1: [2]}, [], copies=1) == {0: {1, 2}, 1: {2}}


def test_with_copies_counts_distinct_holdings():
    from stalwart.ckpt.commit import with_copies

    own_a, own_b = {0: [5, 6]}, {1: [5, 6]}  # node A holds rank 0, node B rank 1
    copies_a, copies_b = {1: [5]}, {0: [5, 6]}  # A keeps B's step 5, B keeps A's 5 and 6
    out = with_copies({0: [5, 6], 1: [5, 6]}, [own_a, own_b, copies_a, copies_b], copies=2)
    assert out == {0: {5, 6}, 1: {5}}
    tracker = CommitTracker(2)
    assert tracker.observe(out) == 5  # step 6 waits for rank 1's copy


def test_with_copies_a_lost_holding_uncommits_nothing_already_counted_elsewhere():
    from stalwart.ckpt.commit import with_copies

    # Three copies wanted; only two holdings left after a node was lost.
    out = with_copies({0: [3]}, [{0: [3]}, {0: [3]}], copies=3)
    assert out == {0: set()}

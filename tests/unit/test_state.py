"""orchestrator/state.py: the transition table, enumerated pair by pair, and the hooks."""

from __future__ import annotations

import itertools

import pytest

from stalwart.orchestrator.state import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    JobState,
    StateMachine,
    Transition,
)

S = JobState

# The intended table, written out independently of the module's.
LEGAL = {
    (S.PENDING, S.SCHEDULING),
    (S.PENDING, S.FAILED),
    (S.PENDING, S.CANCELLED),
    (S.SCHEDULING, S.RUNNING),
    (S.SCHEDULING, S.FAILED),
    (S.SCHEDULING, S.CANCELLED),
    (S.RUNNING, S.RECOVERING),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
    (S.RECOVERING, S.RUNNING),
    (S.RECOVERING, S.RECOVERING),  # a failure during recovery starts another one
    (S.RECOVERING, S.FAILED),
    (S.RECOVERING, S.CANCELLED),
}
ALL_PAIRS = list(itertools.product(JobState, JobState))
ILLEGAL = [p for p in ALL_PAIRS if p not in LEGAL]

# A legal route from PENDING to every state.
ROUTE = {
    S.PENDING: [],
    S.SCHEDULING: [S.SCHEDULING],
    S.RUNNING: [S.SCHEDULING, S.RUNNING],
    S.RECOVERING: [S.SCHEDULING, S.RUNNING, S.RECOVERING],
    S.SUCCEEDED: [S.SCHEDULING, S.RUNNING, S.SUCCEEDED],
    S.FAILED: [S.FAILED],
    S.CANCELLED: [S.CANCELLED],
}


def machine_in(state: JobState, clock=None) -> StateMachine:
    sm = StateMachine(clock) if clock is not None else StateMachine()
    for step in ROUTE[state]:
        sm.set(step, "setup")
    assert sm.state is state
    return sm


def _id(pair):
    return f"{pair[0].value}->{pair[1].value}"


def test_enumeration_is_complete():
    assert len(ALL_PAIRS) == 49
    assert len(LEGAL) + len(ILLEGAL) == 49


def test_table_matches_intent():
    assert set(TRANSITIONS) == set(JobState)
    table = {(old, new) for old, news in TRANSITIONS.items() for new in news}
    assert table == LEGAL


def test_starts_pending(clock):
    assert StateMachine(clock).state is S.PENDING


@pytest.mark.parametrize("pair", sorted(LEGAL, key=_id), ids=_id)
def test_legal_transition_succeeds(pair, clock):
    old, new = pair
    sm = machine_in(old, clock)
    t = sm.set(new, "because")
    assert sm.state is new
    assert t == Transition(old, new, "because", clock.now)


@pytest.mark.parametrize("pair", sorted(ILLEGAL, key=_id), ids=_id)
def test_illegal_transition_raises(pair, clock):
    old, new = pair
    sm = machine_in(old, clock)
    seen = []
    sm.add_hook(seen.append)
    with pytest.raises(IllegalTransition) as info:
        sm.set(new, "nope")
    assert sm.state is old  # unchanged
    assert seen == []  # no hook fired
    msg = str(info.value)
    assert f"{old.value} -> {new.value}" in msg
    assert "nope" in msg


def test_terminal_states():
    assert {S.SUCCEEDED, S.FAILED, S.CANCELLED} == TERMINAL
    for state in JobState:
        assert state.terminal is (state in TERMINAL)


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.value), ids=lambda s: s.value)
def test_terminal_states_have_no_exits(state):
    assert TRANSITIONS[state] == frozenset()
    sm = machine_in(state)
    for new in JobState:
        with pytest.raises(IllegalTransition):
            sm.set(new, "after the end")
        assert sm.state is state


def test_non_terminal_states_can_fail_and_cancel():
    for state in JobState:
        if not state.terminal:
            assert {S.FAILED, S.CANCELLED} <= TRANSITIONS[state]


def test_illegal_transition_is_runtime_error():
    assert issubclass(IllegalTransition, RuntimeError)


def test_hooks_get_transition_with_reason_and_fake_time(clock):
    sm = StateMachine(clock)
    seen: list[Transition] = []
    sm.add_hook(seen.append)

    clock.now = 10.0
    t1 = sm.set(S.SCHEDULING, "submitted")
    clock.advance(2.5)
    t2 = sm.set(S.RUNNING, "placed")
    clock.advance(1.0)
    t3 = sm.set(S.RECOVERING, "rank 1 died")

    assert seen == [t1, t2, t3]
    assert seen == [
        Transition(S.PENDING, S.SCHEDULING, "submitted", 10.0),
        Transition(S.SCHEDULING, S.RUNNING, "placed", 12.5),
        Transition(S.RUNNING, S.RECOVERING, "rank 1 died", 13.5),
    ]


def test_hooks_run_in_order_and_see_new_state(clock):
    sm = StateMachine(clock)
    calls = []
    sm.add_hook(lambda t: calls.append(("a", t.new, sm.state)))
    sm.add_hook(lambda t: calls.append(("b", t.new, sm.state)))
    sm.set(S.SCHEDULING, "go")
    assert calls == [("a", S.SCHEDULING, S.SCHEDULING), ("b", S.SCHEDULING, S.SCHEDULING)]


def test_transition_is_frozen(clock):
    t = StateMachine(clock).set(S.FAILED, "x")
    with pytest.raises(AttributeError):
        t.reason = "y"


def test_full_lifecycle_with_repeated_recovery(clock):
    sm = StateMachine(clock)
    path = [S.SCHEDULING, S.RUNNING, S.RECOVERING, S.RECOVERING, S.RUNNING, S.SUCCEEDED]
    for state in path:
        sm.set(state, f"to {state.value}")
    assert sm.state is S.SUCCEEDED
    assert sm.state.terminal

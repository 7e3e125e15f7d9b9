"""The supervisor's job state machine: one enum, one transition table, one setter."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    PENDING = "PENDING"
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.SCHEDULING, _S.FAILED, _S.CANCELLED}),
    _S.SCHEDULING: frozenset({_S.RUNNING, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RECOVERING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.RECOVERING: frozenset({_S.RUNNING, _S.RECOVERING, _S.FAILED, _S.CANCELLED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class Transition:
    old: JobState
    new: JobState
    reason: str
    at: float
    # What the new state works on (RECOVERING: the decision and its failures), so the loop
    # keeps no side fields for it.
    context: Any = None


class StateMachine:
    """Holds the current state; every change goes through ``set`` and its hooks."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._state = JobState.PENDING
        self._context: Any = None
        self._clock = clock
        self._hooks: list[Callable[[Transition], None]] = []

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def context(self) -> Any:
        """What the current state works on (see Transition.context)."""
        return self._context

    def add_hook(self, hook: Callable[[Transition], None]) -> None:
        self._hooks.append(hook)

    def set(self, new: JobState, reason: str, context: Any = None) -> Transition:
        old = self._state
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"{old.value} -> {new.value} is not allowed ({reason})")
        self._state, self._context = new, context
        t = Transition(old, new, reason, self._clock(), context)
        log.info("job state %s -> %s: %s", old.value, new.value, reason)
        for hook in self._hooks:
            hook(t)
        return t

"""Shared fixtures for the unit tests: no Ray, no sleeping, a clock the test drives."""

from __future__ import annotations

import pytest


class FakeClock:
    """A callable clock that only moves when the test says so."""

    def __init__(self, start: float = 1_000.0):
        self.now = start
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()

"""orchestrator/agent/raylet_watch.py: an agent whose raylet died is told at once (its parent
process changes), once."""

from __future__ import annotations

import threading

import pytest

from stalwart.orchestrator.agent.raylet_watch import RayletWatch

pytestmark = pytest.mark.timeout(30)


def test_the_agent_is_told_once_when_its_parent_changes():
    parent = [4242]
    told = threading.Event()
    calls: list[int] = []

    def gone():
        calls.append(parent[0])
        told.set()

    watch = RayletWatch(gone, every_s=0.01, parent=lambda: parent[0]).start()
    assert watch.raylet == 4242
    assert not told.wait(0.1)  # the raylet lives: nothing said
    parent[0] = 1  # the raylet died: the kernel gave this process another parent
    assert told.wait(10)
    parent[0] = 7
    watch.close()
    assert calls == [1]


def test_a_closed_watch_says_nothing():
    parent = [10]
    told = threading.Event()
    watch = RayletWatch(told.set, every_s=0.01, parent=lambda: parent[0]).start()
    watch.close()
    parent[0] = 1
    assert not told.wait(0.1)

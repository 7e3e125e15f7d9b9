"""supervisor/slots.py room_for: the nodes where one more worker's slot fits beside the
job's own slots, from Ray's node totals (a standby on a full node cannot take a lost rank:
the pool does not wait for a slot there)."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.supervisor import slots as slots_mod
from stalwart.orchestrator.supervisor.slots import Slots

pytestmark = pytest.mark.timeout(30)

NODES = [
    {"NodeID": "full", "Alive": True, "Resources": {"CPU": 2.0}},
    {"NodeID": "half", "Alive": True, "Resources": {"CPU": 2.0}},
    {"NodeID": "empty", "Alive": True, "Resources": {"CPU": 2.0, "GPU": 0.0}},
    {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 8.0}},
]


@pytest.fixture
def slots(monkeypatch):
    monkeypatch.setattr(slots_mod.ray, "nodes", lambda: NODES)
    s = Slots("t")
    s._node = {0: "full", 1: "full", 2: "half"}  # what reserve()/add() record
    return s


def test_nodes_with_room_beside_the_jobs_slots(slots):
    every = {"full", "half", "empty", "dead", "unknown"}
    assert slots.room_for({"CPU": 1.0}, every) == {"half", "empty"}
    assert slots.room_for({"CPU": 2.0}, every) == {"empty"}
    assert slots.room_for({"CPU": 1.0}, {"full"}) == set()


def test_every_resource_of_the_bundle_must_fit(slots):
    assert slots.room_for({"CPU": 1.0, "GPU": 1.0}, {"half", "empty"}) == set()
    assert slots.room_for({"CPU": 0.5, "GPU": 0.0}, {"half", "empty"}) == {"half", "empty"}


def test_a_released_slot_gives_its_room_back(slots, monkeypatch):
    monkeypatch.setattr(slots_mod, "remove_placement_group", lambda g: None)
    slots._groups = {0: object()}
    slots.release(0)
    assert slots.room_for({"CPU": 1.0}, {"full"}) == {"full"}

"""Slots on a real Ray: one single-bundle placement group per slot, pinned where the job's
strategy put it, given back one at a time."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.component, pytest.mark.timeout(120)]


@pytest.fixture
def connected(ray_address):
    import ray

    ray.init(address=ray_address, namespace="stalwart-slots-test", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _states(prefix: str) -> dict[str, str]:
    from ray.util.placement_group import placement_group_table

    return {
        g["name"]: g["state"]
        for g in placement_group_table().values()
        if g["name"].startswith(prefix)
    }


def test_reserve_pins_each_slot_and_releases_one_at_a_time(connected):
    from stalwart.orchestrator.supervisor.slots import Slots

    head = connected.get_runtime_context().get_node_id()
    slots = Slots("t-pin")
    try:
        placed = slots.reserve(3, {"CPU": 1.0}, "PACK", timeout_s=30)
        assert placed == {0: head, 1: head, 2: head}
        states = _states("t-pin")
        assert {n: s for n, s in states.items() if n.startswith("t-pin-slot")} == {
            "t-pin-slot0": "CREATED",
            "t-pin-slot1": "CREATED",
            "t-pin-slot2": "CREATED",
        }
        assert states["t-pin-place"] == "REMOVED"  # the search group holds nothing
        # An actor placed in a slot runs on the slot's node.
        where = connected.remote(lambda: connected.get_runtime_context().get_node_id())
        assert connected.get(where.options(scheduling_strategy=slots.strategy(1)).remote()) == head
        slots.release(1)
        assert slots.held() == [0, 2] and slots.node_of(1) is None
        assert _states("t-pin-slot1") == {"t-pin-slot1": "REMOVED"}
        assert slots.release_on({head}, keep={2}) == [0]
        assert slots.held() == [2]
    finally:
        slots.close()
    assert set(_states("t-pin-slot").values()) == {"REMOVED"}


def test_more_than_the_cluster_holds_is_refused_in_time(connected):
    from stalwart.orchestrator.supervisor.slots import Slots, SlotsUnavailable

    slots = Slots("t-big")
    with pytest.raises(SlotsUnavailable, match=r"could not place 2 bundles of \{'CPU': 1000"):
        slots.reserve(2, {"CPU": 1000.0}, "SPREAD", timeout_s=2)
    assert slots.held() == []
    assert set(_states("t-big").values()) == {"REMOVED"}


def test_a_successor_removes_the_slots_a_dead_supervisor_left(connected):
    from stalwart.orchestrator.supervisor.slots import Slots

    old = Slots("t-left")
    old.reserve(2, {"CPU": 1.0}, "PACK", timeout_s=30)  # its owner "dies": never closed
    new = Slots("t-left")
    assert new.remove_leftovers() == 2
    assert set(_states("t-left-slot").values()) == {"REMOVED"}
    new.reserve(2, {"CPU": 1.0}, "PACK", timeout_s=30)  # the room is back
    try:
        assert new.remove_leftovers() == 0  # its own slots are not leftovers
    finally:
        new.close()


def test_add_places_one_more_slot_on_a_named_node_or_says_none_had_room(connected):
    from stalwart.orchestrator.supervisor.slots import Slots

    head = connected.get_runtime_context().get_node_id()
    slots = Slots("t-add")
    try:
        slots.reserve(2, {"CPU": 1.0}, "PACK", timeout_s=30)
        # A new index after the reserved ones, on the node named.
        assert slots.add({"CPU": 1.0}, {head}, timeout_s=30) == 2
        assert slots.node_of(2) == head and slots.held() == [0, 1, 2]
        assert _states("t-add-slot2") == {"t-add-slot2": "CREATED"}
        # No node named, or no room on the nodes named: None, and nothing is left behind.
        assert slots.add({"CPU": 1.0}, set(), timeout_s=1) is None
        assert slots.add({"CPU": 1000.0}, {head}, timeout_s=1) is None
        assert slots.held() == [0, 1, 2]
        assert _states("t-add-slot3") == {"t-add-slot3": "REMOVED"}
    finally:
        slots.close()

"""Slots: the room reserved for a job's ranks and spares, one placement group per slot.

A job needs its workers placed together (all or nothing, PACK or SPREAD across nodes), and
it needs to give back the room of a single lost node. One placement group for the whole job
does the first but not the second: Ray cannot drop one bundle of a group, and it keeps
trying to re-place a lost node's bundle. With no free room anywhere (a packed cluster that
lost a node, the usual case) Ray 2.60's GCS retries that bundle without backing off, which
keeps its single thread busy and slows every other call in the cluster (ray-project/ray
PR #65007). So the placement is found once, with a group of all the slots and the job's
strategy, and then held by one single-bundle placement group per slot pinned to the node
the group chose (label `ray.io/node-id`). The slots of a lost or cordoned node are
removed one by one; no group is ever left re-placing a bundle.
"""

from __future__ import annotations

import time
from collections import Counter

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NODE_LABEL = "ray.io/node-id"


class SlotsUnavailable(Exception):
    """The cluster could not hold the requested slots in time."""


class Slots:
    """Slot index -> a single-bundle placement group on a known node."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._groups: dict[int, PlacementGroup] = {}
        self._node: dict[int, str] = {}
        self._next = 0  # the index of the next slot added

    def reserve(
        self, count: int, bundle: dict[str, float], strategy: str, timeout_s: float
    ) -> dict[int, str]:
        """Reserve slots 0..count-1 placed together with `strategy`; returns slot -> node.
        Raises SlotsUnavailable when Ray cannot place them within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        finder = placement_group(
            [dict(bundle) for _ in range(count)], strategy=strategy, name=f"{self.name}-place"
        )
        try:
            ray.get(finder.ready(), timeout=timeout_s)
            chosen = placement_group_table(finder)["bundles_to_node_id"]
        except GetTimeoutError:
            raise SlotsUnavailable(
                f"Ray could not place {count} bundles of {bundle} ({strategy})"
            ) from None
        finally:
            remove_placement_group(finder)
        for index in range(count):
            node = chosen[index]
            self._groups[index] = placement_group(
                [dict(bundle)],
                name=f"{self.name}-slot{index}",
                bundle_label_selector=[{NODE_LABEL: node}],
            )
            self._node[index] = node
        self._next = count
        ready = [g.ready() for g in self._groups.values()]
        try:
            ray.get(ready, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            # Room the search found was taken before the slots held it (another job).
            self.close()
            raise SlotsUnavailable(
                f"the room Ray found for {count} bundles of {bundle} was taken before "
                "the job could hold it"
            ) from None
        return dict(self._node)

    def add(self, bundle: dict[str, float], nodes: set[str], timeout_s: float) -> int | None:
        """One more slot, on one of `nodes` (Ray picks one with room); returns its index,
        or None when none of them had room within `timeout_s`."""
        if not nodes:
            return None
        index, self._next = self._next, self._next + 1
        group = placement_group(
            [dict(bundle)],
            name=f"{self.name}-slot{index}",
            bundle_label_selector=[{NODE_LABEL: f"in({','.join(sorted(nodes))})"}],
        )
        try:
            ray.get(group.ready(), timeout=timeout_s)
            node = placement_group_table(group)["bundles_to_node_id"][0]
        except GetTimeoutError:
            remove_placement_group(group)
            return None
        self._groups[index] = group
        self._node[index] = node
        return index

    def remove_leftovers(self) -> int:
        """Remove the slots a dead predecessor of this job's supervisor held (Ray keeps a
        placement group until its job ends, not when the actor that made it dies)."""
        from ray._raylet import PlacementGroupID

        gone = 0
        mine = {g.id.hex() for g in self._groups.values()}
        for pg_id, info in placement_group_table().items():
            if (
                info["name"].startswith(f"{self.name}-")
                and info["state"] != "REMOVED"
                and pg_id not in mine
            ):
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
                gone += 1
        return gone

    def room_for(self, bundle: dict[str, float], nodes: set[str]) -> set[str]:
        """Those of `nodes` whose resources (Ray's totals) hold one more `bundle` beside
        this job's slots there. Other jobs' use is not known here: a node this names may
        still turn out full (add() then times out); one it leaves out is certainly full."""
        slots = Counter(self._node.values())  # every slot holds one such bundle
        totals = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        return {
            node
            for node in nodes
            if node in totals
            and all(
                totals[node].get(key, 0.0) >= (slots[node] + 1) * amount
                for key, amount in bundle.items()
            )
        }

    def strategy(self, slot: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self._groups[slot], placement_group_bundle_index=0)

    def node_of(self, slot: int) -> str | None:
        """The node holding `slot`; None once it was released."""
        return self._node.get(slot)

    def held(self) -> list[int]:
        return sorted(self._groups)

    def nodes(self) -> set[str]:
        return set(self._node.values())

    def release(self, slot: int) -> None:
        """Give back `slot`'s room (an actor still in it is killed by Ray)."""
        group = self._groups.pop(slot, None)
        self._node.pop(slot, None)
        if group is not None:
            remove_placement_group(group)

    def release_on(self, nodes: set[str], keep: set[int] = frozenset()) -> list[int]:
        """Release every slot on `nodes` except those in `keep`; returns the released."""
        gone = [s for s, n in self._node.items() if n in nodes and s not in keep]
        for slot in gone:
            self.release(slot)
        return gone

    def close(self) -> None:
        for slot in list(self._groups):
            self.release(slot)

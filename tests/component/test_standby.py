"""failure.standby on a real multi-node local Ray: a killed worker and a lost node's ranks
move into pre-started processes (supervisor/standby.py) instead of starting new ones, and
the model is the failure-free run's, bit for bit."""

from __future__ import annotations

import pytest

from tests.component.conftest import SMALL, events_of, small_spec

pytestmark = [pytest.mark.component, pytest.mark.timeout(420)]


def test_standbys_take_a_killed_worker_and_a_lost_nodes_ranks_exactly(mrun, mbaseline):
    spec = small_spec(
        entrypoint="tests.component.loops:waits_for_standbys_loop",
        steps=60,
        placement="SPREAD",  # 4 ranks on 3+ nodes of 2 CPUs: room left beside every rank
        failure={"max_restarts": 3, "spares": 0, "standby": True},
        # Rank 0 waits at steps 10 and 35 for a standby on every node holding ranks (at 35:
        # the one the kill used, started again).
        config={**SMALL["config"], "standbys_at": [10, 35]},
        health__hang_timeout_s=300,  # rank 0's waits are idle on purpose: not a hang
        chaos__faults=[
            {"kind": "kill_worker", "rank": 0, "at_step": 15},
            {"kind": "kill_node", "rank": 1, "at_step": 40, "after_commit": True},
        ],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    killed, lost = events_of(result, "replaced")
    # The killed worker's rank moved into its node's standby, in its own slot.
    assert killed["ranks"] == {"0": {"node": killed["ranks"]["0"]["node"], "via": "standby"}}
    # Each of the lost node's ranks moved into a standby on another node, in a new slot.
    [node_lost] = events_of(result, "node_lost")
    assert lost["ranks"] and all(r["via"] == "standby" for r in lost["ranks"].values()), lost
    assert all(r["node"] != node_lost["node"] for r in lost["ranks"].values())
    assert len(result["failures"]) == 1 + len(lost["ranks"])
    assert result["model_digest"] == mbaseline(spec)["model_digest"]

"""supervisor/standby.py choose: how many standbys a job keeps per node, from
failure.standby, failure.standbys_per_node, its GPUs and what its nodes have left beside
their checkpoints; the reason is the line the job's events show."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.memory_check import checkpoint_need
from stalwart.orchestrator.supervisor.standby import GIB, HEADROOM_BYTES, STANDBY_BYTES, choose

pytestmark = pytest.mark.timeout(30)

ROOMY = {"aaaa1111": {"mem_available": 20 * GIB}, "bbbb2222": {"mem_available": 9 * GIB}}


def test_unset_on_a_cpu_job_with_memory_to_spare_keeps_them_and_says_so():
    count, why = choose(None, 2, False, ROOMY, {"aaaa1111": 0, "bbbb2222": 0})
    assert count == 2
    assert why.startswith("on: 2 idle worker processes per node holding ranks")
    assert "9.0 GiB or more left" in why and "failure.standby: false" in why


def test_a_node_short_of_memory_beside_its_checkpoints_turns_them_off_naming_it():
    need = {"aaaa1111": 0, "bbbb2222": 9 * GIB - (STANDBY_BYTES + HEADROOM_BYTES) + 1}
    count, why = choose(None, 2, False, ROOMY, need)
    assert count == 0
    assert why.startswith("off: node bbbb2222 has 1.5 GiB left beside its checkpoints")
    assert "failure.standby: true starts them anyway" in why
    # Exactly enough for one is one, and the line says why not the setting's two.
    need["bbbb2222"] -= 1
    count, why = choose(None, 2, False, ROOMY, need)
    assert count == 1
    assert why.startswith("on: 1 idle worker process per node holding ranks")
    assert "not failure.standbys_per_node=2: memory for 1 only" in why
    # Room for two more standbys is two.
    need["bbbb2222"] -= STANDBY_BYTES
    assert choose(None, 2, False, ROOMY, need)[0] == 2
    assert choose(None, 3, False, ROOMY, need)[0] == 2


def test_what_the_spec_says_wins_on_a_cpu_job():
    tight = {"aaaa1111": {"mem_available": GIB // 4}}
    assert choose(True, 2, False, tight, {"aaaa1111": 0}) == (
        2,
        "on: 2 idle worker processes per node holding ranks (failure.standby: true)",
    )
    assert choose(True, 1, False, tight, {"aaaa1111": 0})[0] == 1
    assert choose(False, 2, False, ROOMY, {}) == (0, "off (failure.standby: false)")


@pytest.mark.parametrize("setting", [None, True])
def test_gpu_jobs_never_have_them_and_are_told_to_use_spares(setting):
    count, why = choose(setting, 2, True, ROOMY, {})
    assert count == 0 and "failure.spares are the warm processes of a GPU job" in why
    assert ("although failure.standby is true" in why) == bool(setting)


def test_nodes_that_did_not_answer_do_not_turn_them_off():
    count, why = choose(None, 2, False, {}, {})
    assert count == 2 and "or more left" not in why


def test_the_checkpoints_need_is_the_footprint_sum_for_the_ranks_on_the_node():
    spec = JobSpec.model_validate(
        {
            "name": "j",
            "steps": 10,
            "entrypoint": "m:f",
            "workers": 4,
            "checkpoint": {"state_size_per_rank": "1Gi", "replicas": 2},
        }
    )
    # 2 ranks x 1 GiB x 6 versions, own and one copy each.
    assert checkpoint_need(spec, 2) == 2 * GIB * 6 * 2
    unsized = JobSpec.model_validate({"name": "j", "steps": 10, "entrypoint": "m:f", "workers": 4})
    assert checkpoint_need(unsized, 2) == 0


def _on(host: str, cores: float, gib: int = 20) -> dict:
    return {"mem_available": gib * GIB, "cores": cores, "host": host}


def test_ranks_that_fill_their_machines_cores_turn_them_off_naming_it():
    """Three nodes of a local cluster on one 2-core machine, 4 ranks: a standby's start
    would be taken from training. The same ranks on machines of their own with a core to
    spare keep them; a node that does not say its cores does not decide."""
    one_machine = {n: _on("m1", 2) for n in ("aaaa1111", "bbbb2222", "cccc3333")}
    busy = {"aaaa1111": 2.0, "bbbb2222": 1.0, "cccc3333": 1.0}
    count, why = choose(None, 2, False, one_machine, {}, busy)
    assert count == 0
    assert why.startswith("off: 3 nodes on one machine share 2 cores and the ranks keep 4 busy")
    assert "failure.standby: true starts them anyway" in why
    apart = {"aaaa1111": _on("m1", 4), "bbbb2222": _on("m2", 2), "cccc3333": _on("m3", 2)}
    assert choose(None, 2, False, apart, {}, busy)[0] == 2
    apart["aaaa1111"]["cores"] = 2.5  # half a core idle is not room for a start
    count, why = choose(None, 2, False, apart, {}, busy)
    assert (count, why.split(":")[0]) == (0, "off")
    assert "node aaaa1111 has 2.5 cores and the ranks keep 2 busy" in why
    assert choose(None, 2, False, {"aaaa1111": {"mem_available": 20 * GIB}}, {}, busy)[0] == 2
    # What the spec says still wins.
    assert choose(True, 2, False, one_machine, {}, busy)[0] == 2

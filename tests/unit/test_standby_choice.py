"""supervisor/standby.py choose: whether a job keeps standbys, from failure.standby, its
GPUs and what its nodes have left beside their checkpoints; the reason is the line the
job's events show."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.memory_check import checkpoint_need
from stalwart.orchestrator.supervisor.standby import GIB, HEADROOM_BYTES, STANDBY_BYTES, choose

pytestmark = pytest.mark.timeout(30)

ROOMY = {"aaaa1111": {"mem_available": 20 * GIB}, "bbbb2222": {"mem_available": 9 * GIB}}


def test_unset_on_a_cpu_job_with_memory_to_spare_keeps_them_and_says_so():
    on, why = choose(None, False, ROOMY, {"aaaa1111": 0, "bbbb2222": 0})
    assert on
    assert why.startswith("on: one idle worker process per node holding ranks")
    assert "9.0 GiB or more left" in why and "failure.standby: false" in why


def test_a_node_short_of_memory_beside_its_checkpoints_turns_them_off_naming_it():
    need = {"aaaa1111": 0, "bbbb2222": 9 * GIB - (STANDBY_BYTES + HEADROOM_BYTES) + 1}
    on, why = choose(None, False, ROOMY, need)
    assert not on
    assert why.startswith("off: node bbbb2222 has 1.5 GiB left beside its checkpoints")
    assert "failure.standby: true starts them anyway" in why
    # Exactly enough is enough.
    need["bbbb2222"] -= 1
    assert choose(None, False, ROOMY, need)[0]


def test_what_the_spec_says_wins_on_a_cpu_job():
    tight = {"aaaa1111": {"mem_available": GIB // 4}}
    assert choose(True, False, tight, {"aaaa1111": 0}) == (
        True,
        "on: one idle worker process per node holding ranks (failure.standby: true)",
    )
    assert choose(False, False, ROOMY, {}) == (False, "off (failure.standby: false)")


@pytest.mark.parametrize("setting", [None, True])
def test_gpu_jobs_never_have_them_and_are_told_to_use_spares(setting):
    on, why = choose(setting, True, ROOMY, {})
    assert not on and "failure.spares are the warm processes of a GPU job" in why
    assert ("although failure.standby is true" in why) == bool(setting)


def test_nodes_that_did_not_answer_do_not_turn_them_off():
    on, why = choose(None, False, {}, {})
    assert on and "or more left" not in why


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

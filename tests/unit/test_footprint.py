"""The host memory a job's in-memory checkpoints take (ckpt/footprint.py): one sum for the
memory preflight on the nodes, `stalwart validate` on this machine and the Helm chart's sizing
of /dev/shm, which must agree (the chart is rendered here with Helm's own engine)."""

from __future__ import annotations

import re

import pytest
import yaml

from stalwart.ckpt import footprint
from stalwart.ckpt.footprint import GIB, NodeNeed, free_bytes, judge, parse_quantity
from stalwart.orchestrator.capacity import this_machine
from stalwart.orchestrator.spec import SpecError, validate
from tests.unit.chart_check import CHART, render_error

pytestmark = pytest.mark.timeout(60)

SUM = re.compile(
    r"(\d+) ranks x (\S+) \((\S+)\) x (\d+) versions = ([\d.]+) GiB of own shards, "
    r"([\d.]+) GiB of copies of peers' shards \(checkpoint.replicas (\d+)\)"
)


def test_quantities_are_read_as_kubernetes_and_the_chart_read_them():
    assert parse_quantity("12Gi") == 12 * GIB
    assert parse_quantity("1.5Gi") == 3 * GIB // 2
    assert parse_quantity("512M") == 512 * 10**6
    assert parse_quantity(4096) == 4096
    for bad in ("12GB", "-1", "", "1 Gi"):
        with pytest.raises(ValueError, match="is not a memory quantity"):
            parse_quantity(bad, "x")


def _spec(state):
    return validate(
        {
            "name": "j",
            "entrypoint": "m:f",
            "steps": 10,
            "workers": 2,
            "checkpoint": {"state_size_per_rank": state},
        }
    )


def test_the_spec_takes_a_quantity_and_names_the_field_when_it_is_not_one():
    assert _spec("2Gi").checkpoint.state_size_per_rank == 2 * GIB
    with pytest.raises(SpecError, match=r"checkpoint.state_size_per_rank: '2GB' is not a"):
        _spec("2GB")


def test_a_node_is_judged_on_its_shared_memory_and_its_memory():
    need = NodeNeed(ranks=2, state_bytes=GIB, replicas=2)
    assert (need.own, need.copies) == (12 * GIB, 12 * GIB)
    assert judge(need, mem_available=30 * GIB, shm_free=20 * GIB) is None
    assert judge(need, mem_available=None, shm_free=None) is None  # nothing known: not judged
    shm = judge(need, mem_available=30 * GIB, shm_free=10 * GIB)
    assert "/dev/shm has 10.0 GiB free" in shm and "memory available" not in shm
    both = judge(need, mem_available=20 * GIB, shm_free=10 * GIB)
    assert "24.0 GiB" in both and "20.0 GiB of memory available" in both
    assert NodeNeed(2, GIB, 1).copies == 0  # no replicas: no copies


def test_the_free_room_of_a_folder_not_made_yet_is_its_file_systems():
    assert free_bytes("/dev/shm/stalwart-not-made-yet/x") == free_bytes("/dev/shm")
    assert free_bytes("/dev/shm") > 0


def test_validate_refuses_on_this_machine_a_state_it_cannot_hold():
    spec = _spec("1Pi")
    [problem] = this_machine(spec, cores=64, memory=64 * GIB)
    assert "do not fit this machine" in problem
    assert NodeNeed(2, 2**50, 2).sum_text("checkpoint.state_size_per_rank") in problem


CHART_CASES = {
    "2 ranks a pod, 2 copies": ("3Gi", 2, 2, None),
    "1 rank a pod, 3 copies": ("1.5Gi", 1, 3, None),
    "no copies": ("5Gi", 2, 1, None),
    "a lean budget": ("12Gi", 2, 2, 4),
    "a roomy budget": ("12Gi", 2, 2, 12),
}


@pytest.mark.parametrize(
    "state,per_pod,replicas,budget", CHART_CASES.values(), ids=CHART_CASES.keys()
)
def test_the_chart_and_the_preflight_give_the_same_sum(state, per_pod, replicas, budget):
    ckpt = {"replicas": replicas, "state_size_per_rank": state}
    if budget is not None:
        ckpt["memory_budget"] = budget
    values = {
        "job": {"workers": 4, "resources": {"cpu": 1}, "checkpoint": ckpt},
        "workerGroups": {
            "workers": {
                "replicas": 4 // per_pod,
                "minReplicas": 4 // per_pod,
                "maxReplicas": 4 // per_pod,
                "ranksPerPod": per_pod,
                "resources": {"cpu": str(per_pod), "memory": "1Gi"},
            }
        },
    }
    message = render_error(values)
    m = SUM.search(message)
    assert m, message
    spec = validate({"name": "j", "entrypoint": "m:f", "steps": 10, **values["job"]})
    versions = footprint.versions_for(budget, replicas)
    need = NodeNeed(per_pod, spec.checkpoint.state_size_per_rank, replicas, versions)
    # The preflight's sum, word for word (the chart names where the size came from).
    assert m.group(0) == need.sum_text("job.checkpoint.state_size_per_rank")
    why = judge(need, mem_available=GIB, shm_free=None)
    assert need.sum_text("checkpoint.state_size_per_rank") in why


def test_the_chart_counts_the_versions_the_nodes_keep():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["checkpointMemory"]["versions"] == footprint.VERSIONS
    assert footprint.VERSIONS == (
        footprint.COMMITS_KEPT + footprint.NEWEST_KEPT + footprint.IN_FLIGHT
    )

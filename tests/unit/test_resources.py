"""orchestrator/supervisor/resources.py: capacity check against ray.nodes()-shaped dicts."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.supervisor.resources import (
    SchedulingError,
    check_capacity,
    worker_bundle,
)


def spec(workers: int = 4, **resources):
    return validate(
        {
            "name": "job",
            "entrypoint": "pkg.mod:train",
            "workers": workers,
            "steps": 10,
            "resources": resources,
        }
    )


def node(cpu: float = 8, gpu: float = 0, alive: bool = True, **custom) -> dict:
    res = {"CPU": float(cpu), "memory": 1e10, "object_store_memory": 1e9, "node:10.0.0.1": 1.0}
    if gpu:
        res["GPU"] = float(gpu)
    res.update({k: float(v) for k, v in custom.items()})
    return {"NodeID": "abc", "Alive": alive, "NodeManagerAddress": "10.0.0.1", "Resources": res}


def test_worker_bundle_drops_zeros():
    assert worker_bundle(spec()) == {"CPU": 1.0}
    assert worker_bundle(spec(cpu=2, gpu=1, custom={"TPU": 4, "none": 0})) == {
        "CPU": 2.0,
        "GPU": 1.0,
        "TPU": 4.0,
    }
    assert worker_bundle(spec(cpu=0, gpu=1)) == {"GPU": 1.0}


def test_fits():
    check_capacity(spec(4, cpu=2, gpu=1), [node(cpu=4, gpu=2), node(cpu=4, gpu=2)])


def test_exact_fit():
    check_capacity(spec(4, cpu=1, gpu=1), [node(cpu=2, gpu=2), node(cpu=2, gpu=2)])


def test_too_many_gpus():
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(4, gpu=2), [node(gpu=4), node(gpu=2)])
    msg = str(info.value)
    assert msg.startswith("resources.gpu: ")
    assert "8" in msg  # needed: 4 workers x 2
    assert "6" in msg  # the cluster has
    assert msg == "resources.gpu: the job needs 8 GPU (4 workers x 2), the cluster has 6"


def test_gpus_on_a_cpu_only_cluster():
    with pytest.raises(SchedulingError, match=r"^resources\.gpu: .*needs 1 GPU.* has 0$"):
        check_capacity(spec(1, gpu=1), [node(cpu=64)])


def test_too_many_cpus():
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(10, cpu=1.5), [node(cpu=8)])
    assert str(info.value) == (
        "resources.cpu: the job needs 15 CPU (10 workers x 1.5), the cluster has 8"
    )


def test_custom_resources():
    check_capacity(spec(2, custom={"accel": 1}), [node(accel=1), node(accel=1)])
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(3, custom={"accel": 1}), [node(accel=1), node(accel=1)])
    assert str(info.value) == (
        "resources.custom.accel: the job needs 3 accel (3 workers x 1), the cluster has 2"
    )


def test_custom_resource_missing_everywhere():
    with pytest.raises(SchedulingError, match=r"^resources\.custom\.tpu_v5: .*has 0$"):
        check_capacity(spec(1, custom={"tpu_v5": 1}), [node(), node()])


def test_dead_nodes_ignored():
    nodes = [node(gpu=8, alive=False), node(gpu=2)]
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(4, gpu=1), nodes)
    assert "the cluster has 2" in str(info.value)
    check_capacity(spec(2, gpu=1), nodes)


def test_missing_alive_key_means_not_alive():
    nodes = [{"Resources": {"CPU": 64.0}}, node(cpu=1)]
    with pytest.raises(SchedulingError, match="the cluster has 1"):
        check_capacity(spec(2), nodes)


def test_no_alive_nodes():
    with pytest.raises(SchedulingError, match=r"^resources\.cpu: .*has 0$"):
        check_capacity(spec(1), [node(alive=False)])
    with pytest.raises(SchedulingError):
        check_capacity(spec(1), [])


def test_per_worker_larger_than_largest_node():
    # Enough GPUs in total, but no single node can host one worker.
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(2, gpu=4), [node(gpu=2), node(gpu=2), node(gpu=3), node(gpu=3)])
    assert str(info.value) == "resources.gpu: one worker needs 4 GPU, the largest node has 3"


def test_per_worker_cpu_larger_than_largest_node():
    with pytest.raises(SchedulingError) as info:
        check_capacity(spec(1, cpu=16), [node(cpu=8), node(cpu=8), node(cpu=8)])
    assert str(info.value) == "resources.cpu: one worker needs 16 CPU, the largest node has 8"


def test_per_worker_larger_than_largest_node_ignores_dead_nodes():
    with pytest.raises(SchedulingError, match="largest node has 2"):
        check_capacity(spec(1, gpu=4), [node(gpu=8, alive=False), node(gpu=2), node(gpu=2)])


def test_fractional_gpus():
    check_capacity(spec(4, gpu=0.5), [node(gpu=1), node(gpu=1)])
    with pytest.raises(SchedulingError, match=r"needs 2\.5 GPU \(5 workers x 0\.5\)"):
        check_capacity(spec(5, gpu=0.5), [node(gpu=1), node(gpu=1)])

"""orchestrator/capacity.py: whether this machine (an embedded Ray) or a cluster holds a job,
asked before anything starts."""

from __future__ import annotations

from stalwart.orchestrator import capacity
from stalwart.orchestrator.spec import validate

GIB = 2**30


def _spec(**extra):
    return validate({"name": "job", "entrypoint": "a.b:c", "workers": 4, "steps": 10, **extra})


def test_a_small_job_fits_a_small_machine():
    assert capacity.this_machine(_spec(), cores=2, memory=4 * GIB) == []


def test_ranks_and_spares_beyond_a_multiple_of_the_cores():
    spec = _spec(workers=16, failure={"spares": 1})
    (line,) = capacity.this_machine(spec, cores=2, memory=64 * GIB)
    assert line == (
        "workers: 16 workers + 1 spare are 17 processes, more than this machine's 2 CPU cores "
        "hold (8 per core: 16); run it on a cluster (--address)"
    )
    assert capacity.this_machine(_spec(workers=16), cores=2, memory=64 * GIB) == []


def test_more_processes_than_the_memory_holds():
    (line,) = capacity.this_machine(_spec(workers=10), cores=64, memory=2 * GIB)
    assert line.startswith("workers: 10 workers need at least 2.9 GiB of memory (300 MB per")
    assert "this machine has 2.0 GiB" in line


def test_gpus_custom_resources_and_num_cpus():
    spec = _spec(resources={"cpu": 2, "gpu": 1, "custom": {"tpu": 1}})
    lines = capacity.this_machine(spec, num_cpus=4, cores=64, memory=64 * GIB, gpus=2)
    assert lines == [
        "resources.cpu: the job needs 8 CPU (4 workers x 2), --num-cpus gives the embedded Ray 4",
        "resources.gpu: the job needs 4 GPU (4 workers x 1), this machine has 2; run it on a "
        "cluster (--address)",
        "resources.custom.tpu: an embedded Ray has no custom resources; run it on a cluster "
        "whose nodes declare tpu (--address)",
    ]


def test_a_cluster_is_asked_what_the_supervisor_checks():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    assert capacity.cluster(_spec(), nodes) == []
    (line,) = capacity.cluster(_spec(resources={"gpu": 1}), nodes)
    assert line == "resources.gpu: the job needs 4 GPU (4 workers x 1), the cluster has 1"

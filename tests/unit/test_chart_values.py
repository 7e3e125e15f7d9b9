"""The Helm chart refuses bad values before anything is created: values.schema.json (the
JobSpec's JSON Schema inside) through Helm's own validator, and the templates' checks of what a
schema cannot say. And what the chart derives: /dev/shm sizes, disruption budgets."""

from __future__ import annotations

import pytest

from tests.unit.chart_check import by_kind, cluster_spec, lint, one, render, render_error

pytestmark = pytest.mark.timeout(60)

SCHEMA_REFUSES = {
    "job workers not a count": ({"job": {"workers": "four"}}, "/job/workers"),
    "job field unknown": ({"job": {"stepz": 3}}, "additional properties 'stepz'"),
    "job name": ({"job": {"name": "Bad_Name"}}, "/job/name"),
    "job steps": ({"job": {"steps": 0}}, "/job/steps"),
    "job fault kind": (
        {"job": {"chaos": {"faults": [{"kind": "explode", "rank": 0, "at_step": 1}]}}},
        "/job/chaos/faults/0",
    ),
    "job metrics port": ({"job": {"metrics": {"port": -1}}}, "/job/metrics/port"),
    "unknown mode": ({"mode": "rayservice"}, "/mode"),
    "negative replicas": ({"workerGroups": {"workers": {"replicas": -1}}}, "/replicas"),
    "group name": ({"workerGroups": {"GPU_big": {"replicas": 1}}}, "GPU_big"),
    "group field unknown": ({"workerGroups": {"workers": {"replica": 2}}}, "'replica'"),
    "memory": ({"head": {"resources": {"memory": "lots"}}}, "/head/resources/memory"),
    "cpu": ({"head": {"resources": {"cpu": "two"}}}, "/head/resources/cpu"),
    "gpu": ({"workerGroups": {"workers": {"resources": {"gpu": 0.5}}}}, "/resources/gpu"),
    "top-level unknown": ({"heads": {}}, "additional properties 'heads'"),
    "submission mode": ({"rayJob": {"submissionMode": "Batch"}}, "/rayJob/submissionMode"),
    "exporter port": ({"exporter": {"port": 70000}}, "/exporter/port"),
    "gcs without redis": (
        {"gcsFaultTolerance": {"enabled": True}},
        "/gcsFaultTolerance/redisAddress",
    ),
    "scrape job name": ({"monitoring": {"podMonitor": {"jobName": "ray"}}}, "/jobName"),
    "rayjob without job": ({"job": None}, "missing property 'job'"),
    "a quote in runArgs": ({"rayJob": {"runArgs": ["it's"]}}, "/rayJob/runArgs/0"),
}


@pytest.mark.parametrize("values,where", SCHEMA_REFUSES.values(), ids=SCHEMA_REFUSES.keys())
def test_the_schema_refuses(values, where):
    message = render_error(values)
    assert message.startswith("values don't meet the specifications of the schema"), message
    assert where in message
    assert len(message.splitlines()) < 25  # one screen


def test_lint_reports_a_bad_job_spec():
    found = lint({"job": {"workers": "four"}})
    assert any("/job/workers" in line for line in found), found


TEMPLATES_REFUSE = {
    "min above replicas": (
        {"workerGroups": {"workers": {"minReplicas": 3}}},
        "workerGroups.workers: needs minReplicas <= replicas <= maxReplicas, got 3, 2, 2",
    ),
    "another metrics port": (
        {"job": {"metrics": {"port": 9000}}},
        "job.metrics.port (9000) differs from exporter.port (9400)",
    ),
    "too few ranks": ({"job": {"workers": 8}}, "the cluster holds 2 ranks"),
    "memory too small": (
        {"checkpointMemory": {"stateSizePerRank": "2Gi"}},
        "workerGroups.workers: resources.memory 4Gi is too small for the in-memory checkpoints",
    ),
    "custom resources": (
        {
            "job": {"resources": {"cpu": 0, "custom": {"tpu": 1}}},
            "checkpointMemory": {"stateSizePerRank": "1Gi"},
        },
        "head: set ranksPerPod",  # the head first, then each group
    ),
    "the chart's volume": (
        {"head": {"volumes": [{"name": "shm", "emptyDir": {}}]}},
        'head.volumes.0: "shm" is the chart\'s own volume',
    ),
    "the chart's mount": (
        {"workerGroups": {"workers": {"volumeMounts": [{"name": "d", "mountPath": "/dev/shm"}]}}},
        "workerGroups.workers.volumeMounts.0: the chart mounts its own volume at /dev/shm",
    ),
}


@pytest.mark.parametrize("values,message", TEMPLATES_REFUSE.values(), ids=TEMPLATES_REFUSE.keys())
def test_the_templates_refuse(values, message):
    got = render_error(values)
    assert message in got, got
    assert "\n" not in got.strip()


def _shm(values: dict, group: str = "workers") -> dict:
    spec = cluster_spec(one(render(values)["objects"], "RayJob"))
    if group == "head":
        pod = spec["headGroupSpec"]["template"]["spec"]
    else:
        (g,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == group]
        pod = g["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    return volume["emptyDir"]


def test_shm_defaults_to_the_memory_limit_as_kuberay_does():
    assert _shm({}) == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert _shm({}, "head") == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert _shm({"workerGroups": {"workers": {"resources": {"memory": None}}}}) == {
        "medium": "Memory"
    }


def test_shm_is_sized_from_the_state_the_ranks_and_the_versions():
    values = {
        "job": {"workers": 4, "resources": {"cpu": 2}},
        "checkpointMemory": {"stateSizePerRank": "1Gi", "versions": 3},
        "workerGroups": {
            "workers": {
                "replicas": 2,
                "resources": {"cpu": "4", "memory": "64Gi"},
                "rayStartParams": {"object-store-memory": 8 * 2**30},
            }
        },
    }
    # 2 ranks a pod (4 CPUs over 2) x 1 GiB x 3 versions + 8 GiB object store + 1 GiB.
    assert _shm(values)["sizeLimit"] == f"{(6 + 8 + 1) * 1024}Mi"
    # The head holds no ranks (num-cpus 0): its object store (30% of 8 GiB) and 1 GiB.
    assert _shm(values, "head")["sizeLimit"] == f"{-(-8 * 1024 * 3 // 10) + 1024}Mi"
    group = values["workerGroups"]["workers"]
    explicit = {**values, "workerGroups": {"workers": {**group, "shm": {"sizeLimit": "20Gi"}}}}
    assert _shm(explicit)["sizeLimit"] == "20Gi"
    per_pod = {**group, "ranksPerPod": 1, "replicas": 4, "maxReplicas": 4}
    assert _shm({**values, "workerGroups": {"workers": per_pod}})["sizeLimit"] == (
        f"{(3 + 8 + 1) * 1024}Mi"
    )


def _budgets(values: dict) -> dict[str, dict]:
    objects = render(values)["objects"]
    return {o["metadata"]["name"]: o["spec"] for o in by_kind(objects, "PodDisruptionBudget")}


def test_worker_disruptions_are_bounded_by_the_checkpoint_copies():
    assert _budgets({})["demo-stalwart-workers"]["maxUnavailable"] == 1
    three = {"job": {"workers": 3, "checkpoint": {"replicas": 3}}}
    three["workerGroups"] = {"workers": {"replicas": 3, "maxReplicas": 3}}
    assert _budgets(three)["demo-stalwart-workers"]["maxUnavailable"] == 2
    percent = _budgets({"podDisruptionBudget": {"maxUnavailable": "25%"}})
    assert percent["demo-stalwart-workers"]["maxUnavailable"] == "25%"
    head = _budgets({})["demo-stalwart-head"]
    assert head["minAvailable"] == 1
    assert head["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    assert _budgets({"podDisruptionBudget": {"head": False}}).keys() == {"demo-stalwart-workers"}
    assert _budgets({"podDisruptionBudget": {"enabled": False}}) == {}


def test_raycluster_mode_needs_no_job():
    objects = render({"mode": "raycluster", "job": None})["objects"]
    assert one(objects, "RayCluster")["metadata"]["name"] == "demo-stalwart"

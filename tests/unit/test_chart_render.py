"""The Helm chart (helm/stalwart) rendered by Helm's engine with several value sets: helm lint
is clean, every object passes the real schemas (kubernetes-validate, the KubeRay and
prometheus-operator CRDs), the job spec in the ConfigMap is one `stalwart validate` accepts,
and the monitoring objects carry the dashboards and rules of dashboards/."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from stalwart.orchestrator.spec import load_spec, validate
from tests.unit.chart_check import (
    by_kind,
    cluster_spec,
    lint,
    one,
    pod_templates,
    problems,
    render,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
GPU_JOB = {
    "name": "llm",
    "entrypoint": "train.gpt:main",
    "workers": 16,
    "steps": 100_000,
    "backend": "nccl",
    "resources": {"cpu": 8, "gpu": 1},
    "checkpoint": {"every_steps": 10, "replicas": 2, "persist": {"uri": "/mnt/ckpt"}},
    "failure": {"max_restarts": 20, "spares": 0},
    "config": {"lr": 0.00003, "eps": 1e-8, "betas": [0.9, 0.95], "tokens": 10**12},
}
VALUE_SETS = {
    "defaults": {},
    "gpu-workers": {
        "job": GPU_JOB,
        "checkpointMemory": {"stateSizePerRank": "6Gi"},
        "workerGroups": {
            "workers": None,  # Helm's null: the default group is gone
            "h100": {
                "replicas": 2,
                "resources": {"cpu": "96", "memory": "1000Gi", "gpu": 8},
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                ],
                "priorityClassName": "training-high",
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "labelSelector": {
                                    "matchLabels": {"app.kubernetes.io/component": "worker"}
                                },
                                "topologyKey": "kubernetes.io/hostname",
                            }
                        ]
                    }
                },
            },
        },
    },
    "rayjob": {
        "mode": "rayjob",
        "rayJob": {
            "submissionMode": "HTTPMode",
            "backoffLimit": 2,
            "activeDeadlineSeconds": 86_400,
            "ttlSecondsAfterFinished": 3600,
            "runArgs": ["--resume", "never"],
        },
        "image": {"repository": "registry.example.com/ml/stalwart", "tag": "0.1.0-cu128"},
    },
    "raycluster": {
        "mode": "raycluster",
        "job": None,
        "autoscaling": {"enabled": True},
        "workerGroups": {"workers": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8}},
    },
    "monitoring-off": {
        "monitoring": {"enabled": False},
        "exporter": {"service": {"enabled": False}},
    },
    "gcs-ft": {
        "gcsFaultTolerance": {
            "enabled": True,
            "redisAddress": "redis://redis.ml.svc:6379",
            "redisPassword": {"secretName": "ray-redis", "secretKey": "password"},
        },
        "podDisruptionBudget": {"maxUnavailable": 2},
    },
}
SETS = pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


@SETS
def test_helm_lint_is_clean(values):
    assert lint(values) == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_passes_the_real_schemas(rendered, name):
    objects = rendered[name]["objects"]
    assert [p for obj in objects for p in problems(obj)] == []
    kinds = {o["kind"] for o in objects}
    mode = VALUE_SETS[name].get("mode", "rayjob")
    assert ("RayJob" if mode == "rayjob" else "RayCluster") in kinds
    assert ("RayCluster" if mode == "rayjob" else "RayJob") not in kinds


def test_the_checks_refuse_what_the_api_server_would(rendered):
    """The checker itself: an unknown field anywhere in a RayJob, a pod template or a core
    object is reported, with its path."""
    objects = rendered["defaults"]["objects"]
    rayjob = copy.deepcopy(one(objects, "RayJob"))
    cluster_spec(rayjob)["headGroupSpec"]["rayStartParam"] = {}
    head = cluster_spec(rayjob)["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["resource"] = {}
    found = problems(rayjob)
    assert any("headGroupSpec: Additional properties" in p and "rayStartParam" in p for p in found)
    assert any("headGroupSpec.template: " in p and "'resource'" in p for p in found)
    service = copy.deepcopy(one(objects, "Service"))
    service["spec"]["ports"][0]["port"] = "http"
    assert problems(service)
    monitor = copy.deepcopy(one(objects, "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    assert problems(monitor)
    monitor["metadata"]["labels"]["release"] = "kube prometheus"
    assert any("metadata.labels.release" in p for p in problems(monitor))


def _job_spec(objects: list[dict], tmp_path: Path):
    (cm,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-job")]
    path = tmp_path / "job.yaml"
    path.write_text(cm["data"]["job.yaml"])
    return load_spec(path)  # what `stalwart validate` and `stalwart run` read it with


@pytest.mark.parametrize("name", [n for n, v in VALUE_SETS.items() if v.get("job", {}) is not None])
def test_the_job_spec_configmap_passes_stalwart_validate(rendered, name, tmp_path):
    values = VALUE_SETS[name]
    given = (
        values.get("job")
        or yaml.safe_load((REPO / "helm" / "stalwart" / "values.yaml").read_text())["job"]
    )
    spec = _job_spec(rendered[name]["objects"], tmp_path)
    # The values' job, with the exporter where the Service and the PodMonitor look for it.
    want = validate({**given, "metrics": {"host": "0.0.0.0", "port": 9400}})
    assert spec.model_dump() == want.model_dump()


def test_the_job_spec_keeps_numbers_and_strings_as_given(tmp_path):
    """Helm holds numbers as floats and its toYaml writes 3e-05, which YAML 1.1 (PyYAML,
    what stalwart reads) takes for a string: the chart writes its own YAML."""
    config = {
        "lr": 0.00003,
        "eps": 1e-8,
        "half": 0.5,
        "tokens": 10**12,
        "negative": -3,
        "huge": 1.5e300,
        "text": 'a "quoted" <b> & \\ \u00e9\n line',
        "looks_like_a_bool": "yes",
        "on": True,
        "nothing": None,
        "empty": {},
        "nested": {"list": [1, 2.5, "x", {"k": [True, None]}], "deeper": {"n": 7}},
    }
    job = {"name": "numbers", "entrypoint": "m:f", "workers": 2, "steps": 10**9, "config": config}
    spec = _job_spec(render({"job": job})["objects"], tmp_path)
    assert spec.steps == 10**9
    assert spec.config == config


def test_the_exporter_is_where_the_service_and_the_podmonitor_look(rendered, tmp_path):
    objects = rendered["defaults"]["objects"]
    port = _job_spec(objects, tmp_path).metrics
    assert (port.host, port.port) == ("0.0.0.0", 9400)
    head = cluster_spec(one(objects, "RayJob"))["headGroupSpec"]["template"]
    (container,) = head["spec"]["containers"]
    exporter = {p["name"]: p["containerPort"] for p in container["ports"]}["exporter"]
    assert exporter == 9400
    labels = head["metadata"]["labels"]
    service = one(objects, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [
        {"name": "exporter", "port": 9400, "targetPort": "exporter", "protocol": "TCP"}
    ]
    monitor = one(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "exporter" and endpoint["path"] == "/metrics"
    # The rules select the scrape job by name: job=~"stalwart.*".
    assert {"action": "replace", "targetLabel": "job", "replacement": "stalwart"} in endpoint[
        "relabelings"
    ]
    # The worker pods are not scraped: they run no exporter.
    for group in cluster_spec(one(objects, "RayJob"))["workerGroupSpecs"]:
        worker = group["template"]["metadata"]["labels"]
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= worker.items()


def test_the_podmonitor_and_rule_take_the_selector_labels():
    labels = {"release": "kube-prometheus-stack"}
    objects = render(
        {"monitoring": {"podMonitor": {"labels": labels}, "prometheusRule": {"labels": labels}}}
    )["objects"]
    for kind in ("PodMonitor", "PrometheusRule"):
        assert one(objects, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_prometheus_rule_is_the_rules_file(rendered):
    source = yaml.safe_load((REPO / "dashboards" / "rules" / "stalwart.rules.yml").read_text())
    rule = one(rendered["defaults"]["objects"], "PrometheusRule")
    assert rule["spec"] == {"groups": source["groups"]}


def test_one_configmap_per_dashboard_with_the_sidecar_label(rendered):
    sources = sorted((REPO / "dashboards" / "grafana").glob("*.json"))
    maps = [
        o
        for o in by_kind(rendered["defaults"]["objects"], "ConfigMap")
        if "-dashboard-" in o["metadata"]["name"]
    ]
    assert len(maps) == len(sources) == 4
    by_file = {name: cm for cm in maps for name in cm["data"]}
    for path in sources:
        cm = by_file[path.name]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["data"][path.name] == path.read_text()
        json.loads(cm["data"][path.name])


def test_monitoring_off_leaves_out_the_monitoring_objects(rendered):
    objects = rendered["monitoring-off"]["objects"]
    kinds = [o["kind"] for o in objects]
    assert "PodMonitor" not in kinds and "PrometheusRule" not in kinds and "Service" not in kinds
    assert [o["metadata"]["name"] for o in by_kind(objects, "ConfigMap")] == ["demo-stalwart-job"]
    assert "PodMonitor" not in rendered["monitoring-off"]["notes"]


def test_rayjob_runs_stalwart_on_the_mounted_spec(rendered):
    rayjob = one(rendered["rayjob"]["objects"], "RayJob")
    spec = rayjob["spec"]
    assert spec["entrypoint"].startswith("stalwart run /etc/stalwart/job.yaml ")
    assert spec["entrypoint"].endswith(" --resume never")
    assert spec["metadata"] == {
        "stalwart": "1",
        "stalwart_name": "quickstart",
        "stalwart_run_dir": "~/stalwart-runs/quickstart",
    }
    assert (spec["submissionMode"], spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (
        "HTTPMode",
        2,
        86_400,
    )
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 3600
    assert "submitterPodTemplate" not in spec  # HTTPMode has no submitter Job
    head = cluster_spec(rayjob)["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == "job-spec"]
    assert mount == {"name": "job-spec", "mountPath": "/etc/stalwart", "readOnly": True}
    (volume,) = [v for v in head["volumes"] if v["name"] == "job-spec"]
    assert volume["configMap"]["name"] == "demo-stalwart-job"
    assert head["containers"][0]["image"] == "registry.example.com/ml/stalwart:0.1.0-cu128"
    default = one(rendered["defaults"]["objects"], "RayJob")["spec"]
    assert default["submissionMode"] == "K8sJobMode"
    assert default["submitterPodTemplate"]["spec"]["restartPolicy"] == "Never"


def test_raycluster_mode_makes_a_cluster_to_submit_to(rendered):
    out = rendered["raycluster"]
    cluster = one(out["objects"], "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 2, 8)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert "job-spec" not in [v["name"] for v in head["volumes"]]  # job: null
    names = [o["metadata"]["name"] for o in by_kind(out["objects"], "ConfigMap")]
    assert "demo-stalwart-job" not in names
    assert "stalwart submit --address http://localhost:8265" in out["notes"]
    assert "svc/demo-stalwart-head-svc" in out["notes"]


def test_gcs_fault_tolerance_takes_the_password_from_the_secret(rendered):
    spec = cluster_spec(one(rendered["gcs-ft"]["objects"], "RayJob"))
    assert spec["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis://redis.ml.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "ray-redis", "key": "password"}}},
    }
    assert "gcsFaultToleranceOptions" not in cluster_spec(
        one(rendered["defaults"]["objects"], "RayJob")
    )


def test_gpu_workers_get_gpus_placement_and_a_sized_shm(rendered):
    spec = cluster_spec(one(rendered["gpu-workers"]["objects"], "RayJob"))
    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"] == "h100"
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert pod["priorityClassName"] == "training-high"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "podAntiAffinity" in pod["affinity"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    # 8 ranks x 6 GiB x 6 ring slots of own shards, 30% of 1000 GiB for Ray's object store,
    # 1 GiB for NCCL and Ray's own files.
    gib = 1024
    assert shm["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": f"{8 * 6 * 6 * gib + -(-1000 * gib * 3 // 10) + gib}Mi",
    }


def test_every_pod_runs_as_non_root_without_privileges(rendered):
    for name, out in rendered.items():
        for obj in out["objects"]:
            for where, template in pod_templates(obj):
                pod = template["spec"]
                assert pod["securityContext"]["runAsNonRoot"] is True, (name, where)
                assert pod["securityContext"]["runAsUser"] != 0, (name, where)
                assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
                assert pod["automountServiceAccountToken"] is False
                assert pod["serviceAccountName"] == "demo-stalwart"
                for c in pod["containers"]:
                    assert c["securityContext"]["allowPrivilegeEscalation"] is False
                    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
                if where != "submitterPodTemplate":
                    assert pod["terminationGracePeriodSeconds"] == 60
                    mounts = pod["containers"][0]["volumeMounts"]
                    assert {"name": "shm", "mountPath": "/dev/shm"} in mounts
                    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
                    assert shm["emptyDir"]["medium"] == "Memory"


def test_every_object_has_the_standard_labels(rendered):
    for out in rendered.values():
        for obj in out["objects"]:
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == "stalwart"
            assert labels["app.kubernetes.io/instance"] == "demo"
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["app.kubernetes.io/version"] == "0.1.0"
            assert labels["helm.sh/chart"] == "stalwart-0.1.0"
            assert obj["metadata"]["namespace"] == "ml"
            for _, template in pod_templates(obj):
                assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"


def test_notes_say_how_to_watch_the_job(rendered):
    notes = rendered["defaults"]["notes"]
    assert "kubectl get rayjob demo-stalwart -n ml -w" in notes
    assert "kubectl logs -n ml -f job/demo-stalwart" in notes
    assert "stalwart status quickstart --address http://localhost:8265 --watch" in notes
    assert "PodMonitor demo-stalwart" in notes
    assert "kubectl logs" not in rendered["rayjob"]["notes"]  # HTTPMode: no submitter Job

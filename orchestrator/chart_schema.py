"""The JSON Schema of the Helm chart's values (helm/stalwart/values.schema.json), less the job
spec, which orchestrator/chart.py embeds from the JobSpec's own schema. Helm checks it on every
install, upgrade, template and lint: a misspelt key, an unknown mode or a negative count is
refused before anything is created. The patterns of quantities are the ones the chart's
templates parse (templates/_helpers.tpl)."""

from __future__ import annotations

from typing import Any

from stalwart.ckpt.footprint import QUANTITY_PATTERN

# Names under $defs, prefixed so that they cannot collide with the JobSpec's.
DEF = "chart."

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_MEMORY = {
    "anyOf": [
        {
            "type": "string",
            "pattern": QUANTITY_PATTERN,
        },
        {"type": "integer", "minimum": 0},
    ],
    "description": "a memory quantity: 16Gi, 512Mi, or bytes",
}
_CPU = {
    "anyOf": [
        {"type": "string", "pattern": r"^([0-9]+m|[0-9]+(\.[0-9]+)?)$"},
        {"type": "number", "minimum": 0},
    ],
    "description": "a CPU quantity: 4, 0.5, 500m",
}
_DURATION = {"type": "string", "pattern": r"^(|0|([0-9]+(ms|s|m|h|d|w|y))+)$"}
_COUNT = {"type": "integer", "minimum": 0}
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


def _items(required: list[str], **properties: Any) -> dict[str, Any]:
    """A list of Kubernetes objects (env, volumes, ...), checked where the chart relies on it."""
    return {
        "type": "array",
        "items": {"type": "object", "required": required, "properties": properties},
    }


def _group(kind: str) -> dict[str, Any]:
    """The head's or a worker group's values (templates/_pod.tpl)."""
    props: dict[str, Any] = {
        "ranksPerPod": {
            "type": ["integer", "null"],
            "minimum": 0,
            "description": "ranks one pod holds; default: its GPUs (or CPUs) over a rank's",
        },
        "rayStartParams": {
            "type": "object",
            "additionalProperties": {"type": ["string", "number", "boolean"]},
            "description": "`ray start` options (KubeRay's rayStartParams)",
        },
        "resources": _obj(
            {"cpu": _CPU, "memory": _MEMORY, "gpu": _COUNT},
            description="one pod's requests and limits (GPUs: limits)",
        ),
        "shm": _obj(
            {"sizeLimit": {"anyOf": [_MEMORY, {"const": ""}]}},
            description="the memory-backed /dev/shm; sizeLimit '' derives it",
        ),
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
        "nodeSelector": _STR_MAP,
        "tolerations": {"type": "array", "items": {"type": "object"}},
        "affinity": {"type": "object"},
        "priorityClassName": {"type": "string"},
        "terminationGracePeriodSeconds": _COUNT,
        "env": _items(["name"], name={"type": "string", "minLength": 1}),
        "envFrom": {"type": "array", "items": {"type": "object"}},
        # The chart's own volumes (shm, ray-logs, job-spec) are refused by the templates,
        # with a message: a JSON Schema `not` would only say "'not' failed".
        "volumes": _items(["name"], name={"type": "string", "minLength": 1}),
        "volumeMounts": _items(
            ["name", "mountPath"],
            name={"type": "string", "minLength": 1},
            mountPath={"type": "string", "minLength": 1},
        ),
    }
    if kind == "head":
        props["serviceType"] = {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
    else:
        props |= {
            "disabled": {"type": "boolean"},
            "replicas": _COUNT,
            "minReplicas": _COUNT,
            "maxReplicas": _COUNT,
        }
    return _obj(dict(sorted(props.items())))


def chart_defs() -> dict[str, Any]:
    return {f"{DEF}head": _group("head"), f"{DEF}workerGroup": _group("worker")}


def chart_properties(job_ref: str) -> dict[str, Any]:
    """The top-level values; `job_ref` is the JobSpec's $ref."""
    return {
        "global": {"type": "object"},  # Helm's own, present when the chart is a subchart
        "mode": {
            "enum": ["rayjob", "raycluster"],
            "description": "rayjob: a RayJob runs the job; raycluster: a RayCluster to submit to",
        },
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string"},
        "image": _obj(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string"},
                "digest": {"type": "string", "pattern": r"^(|sha256:[a-f0-9]{64})$"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            required=["repository"],
        ),
        "imagePullSecrets": _items(["name"], name={"type": "string"}),
        "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
        "serviceAccount": _obj(
            {
                "create": {"type": "boolean"},
                "name": {"type": "string"},
                "annotations": _STR_MAP,
                "automountServiceAccountToken": {"type": "boolean"},
            }
        ),
        "podSecurityContext": {"type": "object"},
        "securityContext": {"type": "object"},
        "job": {"$ref": job_ref},
        "rayJob": _obj(
            {
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "SidecarMode"]},
                "backoffLimit": _COUNT,
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": _COUNT,
                "activeDeadlineSeconds": {"type": ["integer", "null"], "minimum": 1},
                "runDir": {"type": "string"},
                "runArgs": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[^']*$"},
                    "description": "more `stalwart run` options (no single quotes)",
                },
                "submitterResources": {"type": "object"},
            }
        ),
        "exporter": _obj(
            {
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "service": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "annotations": _STR_MAP,
                    }
                ),
            }
        ),
        "monitoring": _obj(
            {
                "enabled": {"type": "boolean"},
                "podMonitor": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "labels": _STR_MAP,
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "jobName": {"type": "string", "pattern": "^stalwart"},
                        "relabelings": {"type": "array", "items": {"type": "object"}},
                    }
                ),
                "prometheusRule": _obj({"enabled": {"type": "boolean"}, "labels": _STR_MAP}),
                "dashboards": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "label": {"type": "string", "minLength": 1},
                        "labelValue": {"type": "string"},
                        "annotations": _STR_MAP,
                        "namespace": {"type": "string"},
                    }
                ),
            }
        ),
        "checkpointMemory": _obj(
            {
                "stateSizePerRank": {"anyOf": [_MEMORY, {"type": "null"}]},
                "versions": {"type": "integer", "minimum": 1},
            }
        ),
        "gcsFaultTolerance": _obj(
            {
                "enabled": {"type": "boolean"},
                "redisAddress": {"type": "string"},
                "redisPassword": _obj(
                    {"secretName": {"type": "string"}, "secretKey": {"type": "string"}}
                ),
                "externalStorageNamespace": {"type": "string"},
            },
            # Enabled without an address: refused here, with the field's name.
            **{
                "if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
                "then": {
                    "properties": {"redisAddress": {"minLength": 1}},
                    "required": ["redisAddress"],
                },
            },
        ),
        "autoscaling": _obj(
            {
                "enabled": {"type": "boolean"},
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "idleTimeoutSeconds": _COUNT,
                "resources": {"type": "object"},
            }
        ),
        "gpuResourceName": {"type": "string", "minLength": 1},
        "head": {"$ref": f"#/$defs/{DEF}head"},
        "workerGroups": {
            "type": "object",
            "propertyNames": {"pattern": _DNS_LABEL},
            "additionalProperties": {"$ref": f"#/$defs/{DEF}workerGroup"},
            "description": "worker groups by name (a DNS label: it names their pods)",
        },
        "podDisruptionBudget": _obj(
            {
                "enabled": {"type": "boolean"},
                "maxUnavailable": {
                    "anyOf": [_COUNT, {"type": "string", "pattern": r"^[0-9]+%$"}, {"type": "null"}]
                },
                "head": {"type": "boolean"},
            }
        ),
    }

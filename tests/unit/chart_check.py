"""Rendering the Helm chart (helm/stalwart) with Helm's own engine (helm-python-sdk, no helm
binary) and checking what comes out against the real schemas: core objects with
kubernetes-validate, custom resources with the upstream CRDs' openAPIV3Schema
(tests/data/crds/), the pod templates inside RayJobs and RayClusters as core PodTemplates.

The CRD schemas are made strict first: an object schema that lists its properties refuses
others, as the API server does with strict field validation (kubectl's default), where the
CRD alone would prune them silently."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "stalwart"
CRDS = REPO / "tests" / "data" / "crds"
KUBE_VERSION = "1.37.0"
_MONITORING = "prometheus-operator/monitoring.coreos.com"
CUSTOM = {
    ("ray.io/v1", "RayJob"): "kuberay/ray.io_rayjobs.yaml",
    ("ray.io/v1", "RayCluster"): "kuberay/ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): f"{_MONITORING}_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): f"{_MONITORING}_prometheusrules.yaml",
}
# Kubernetes' label syntax (apimachinery's validation): an optional DNS prefix, a name of at
# most 63 characters; values the same or empty.
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}?$")


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


def render(values: dict[str, Any] | None = None, name: str = "demo") -> dict[str, Any]:
    """{"objects": [...], "notes": str}: the chart rendered as `helm template` would."""
    out = chart().render(values=values or {}, name=name, namespace="ml")
    objects, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return {"objects": objects, "notes": notes}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objects, kind)
    return found


def lint(values: dict[str, Any] | None = None) -> list[str]:
    """helm lint's findings above INFO (warnings and errors), one line each."""
    report = helm_python.lint(str(CHART), values=values, namespace="ml", strict=True)
    found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return found + list(report["errors"])


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (v if k in ("enum", "default", "example", "properties") else _strict(v))
        for k, v in schema.items()
    }
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Validator:
    crd = yaml.load((CRDS / CUSTOM[(api_version, kind)]).read_text(), Loader=yaml.CSafeLoader)
    version = api_version.split("/")[1]
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(entry["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top)"


def problems(obj: dict[str, Any]) -> list[str]:
    """What is wrong with one rendered object, one line per problem; [] when nothing is."""
    name = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    found = []
    meta = obj.get("metadata", {})
    for field in ("labels", "annotations"):
        for key, value in (meta.get(field) or {}).items():
            if not LABEL_KEY.match(key):
                found.append(f"{name}: metadata.{field}: bad key {key!r}")
            if field == "labels" and not (isinstance(value, str) and LABEL_VALUE.match(value)):
                found.append(f"{name}: metadata.labels.{key}: bad value {value!r}")
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CUSTOM:
        validator = crd_validator(*key)
        found += [f"{name}: {_where(e)}: {e.message}" for e in validator.iter_errors(obj)]
        for where, template in pod_templates(obj):
            found += [f"{name}: {where}: {p}" for p in core_problems(_pod_template(template))]
    else:
        found += [f"{name}: {p}" for p in core_problems(obj)]
    return found


def core_problems(obj: dict[str, Any]) -> list[str]:
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}"]
    return []


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "check"},
        "template": template,
    }


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """A RayCluster's spec, or a RayJob's rayClusterSpec."""
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a RayJob's or RayCluster's head, workers and submitter."""
    if obj["kind"] not in ("RayJob", "RayCluster"):
        return []
    spec = cluster_spec(obj)
    out = [("headGroupSpec.template", spec["headGroupSpec"]["template"])]
    out += [
        (f"workerGroupSpecs.{g['groupName']}.template", g["template"])
        for g in spec.get("workerGroupSpecs", [])
    ]
    if obj["kind"] == "RayJob" and "submitterPodTemplate" in obj["spec"]:
        out.append(("submitterPodTemplate", obj["spec"]["submitterPodTemplate"]))
    return out


def render_error(values: dict[str, Any]) -> str:
    """The message Helm refuses `values` with (schema or template); fails if it renders."""
    try:
        chart().render(values=values, name="demo", namespace="ml")
    except helm_python.HelmError as e:
        return str(e)
    raise AssertionError(f"rendered, but should have been refused: {values}")

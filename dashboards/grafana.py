"""A small builder for Grafana dashboard JSON (schema of Grafana 10/11): panels laid out
on the 24-column grid in order, a `datasource` and a `train_job` variable on every
dashboard, Prometheus targets that use them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GRID_WIDTH = 24
JOB = 'train_job="$train_job"'  # the selector every query carries


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries, stat, heatmap, bargauge
    targets: tuple[Target, ...]
    unit: str
    description: str = ""
    w: int = 8
    h: int = 8
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str


def build(uid: str, title: str, description: str, items: list[Panel | Row]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = row_h = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            if x:
                x, y = 0, y + row_h
            panels.append(
                {
                    "id": pid,
                    "type": "row",
                    "title": item.title,
                    "collapsed": False,
                    "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                    "panels": [],
                }
            )
            y, row_h = y + 1, 0
            continue
        if x + item.w > GRID_WIDTH:
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel(pid, item, {"x": x, "y": y, "w": item.w, "h": item.h}))
        x += item.w
        row_h = max(row_h, item.h)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["stalwart"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "panels": panels,
    }


def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": "${datasource}"}


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        },
        {
            "name": "train_job",
            "label": "Training job",
            "type": "query",
            "datasource": _datasource(),
            "query": {"query": "label_values(stalwart_job_state, train_job)", "refId": "jobs"},
            "definition": "label_values(stalwart_job_state, train_job)",
            "current": {},
            "hide": 0,
            "refresh": 2,
            "sort": 1,
            "multi": False,
            "includeAll": False,
        },
    ]


def _panel(pid: int, p: Panel, pos: dict[str, int]) -> dict[str, Any]:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": _datasource(),
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "instant": t.instant,
            "range": not t.instant,
        }
        for i, t in enumerate(p.targets)
    ]
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": _datasource(),
        "gridPos": pos,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": dict(p.options),
    }

"""dashboards/: the committed Grafana JSON is what the Python definitions generate, and
every dashboard follows the rules: datasource and train_job variables, a unit on every
panel, $__rate_interval in rates, no overlapping panels, unique ids, stable uids, only
metrics the exporter defines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from stalwart.dashboards.__main__ import render
from stalwart.dashboards.definitions import ALL
from stalwart.orchestrator.observe.metric_defs import DEFINITIONS

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "dashboards" / "grafana"
RULES = REPO / "dashboards" / "rules" / "stalwart.rules.yml"
UIDS = {
    "job-overview": "stalwart-job-overview",
    "workers": "stalwart-workers",
    "checkpoints": "stalwart-checkpoints",
    "nodes": "stalwart-nodes",
}


def test_committed_json_is_generated_from_the_definitions():
    rendered = render()
    committed = {p.name: p.read_text() for p in GRAFANA.glob("*.json")}
    assert committed == rendered, "dashboards/grafana/ drifted: run `python -m stalwart.dashboards`"


def test_four_dashboards_with_stable_uids():
    assert {name: make()["uid"] for name, make in ALL.items()} == UIDS


@pytest.fixture(params=sorted(ALL), ids=str)
def board(request):
    return ALL[request.param]()


def _panels(board):
    return [p for p in board["panels"] if p["type"] != "row"]


def test_variables(board):
    names = {v["name"]: v for v in board["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource"
    assert names["datasource"]["query"] == "prometheus"
    assert names["train_job"]["datasource"]["uid"] == "${datasource}"
    assert "stalwart_job_state" in names["train_job"]["definition"]


def test_ids_unique_and_grid_without_overlaps(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_panel_has_a_unit_a_title_and_job_scoped_queries(board):
    for p in _panels(board):
        assert p["fieldConfig"]["defaults"]["unit"], f"{p['title']}: no unit"
        assert p["title"] and p["description"], p
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert 'train_job="$train_job"' in t["expr"], (p["title"], t["expr"])
            assert t["datasource"]["uid"] == "${datasource}"


def test_rates_use_the_rate_interval(board):
    for p in _panels(board):
        for t in p["targets"]:
            for window in re.findall(r"\b(?:i?rate)\([^()\[]*\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", (p["title"], t["expr"])


def test_queries_use_only_defined_metrics_and_recording_rules(board):
    defined = {d.name for d in DEFINITIONS}
    records = {
        r["record"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    for p in _panels(board):
        for t in p["targets"]:
            for name in re.findall(r"\bstalwart[_:][a-z0-9_:]+", t["expr"]):
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert base in defined or name in records, (p["title"], name)


def test_the_generator_writes_where_it_is_told_and_help_is_help(tmp_path, capsys):
    from stalwart.dashboards.__main__ import main

    assert main([str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(render())
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage: python -m stalwart.dashboards" in capsys.readouterr().out
    assert not Path("--help").exists()

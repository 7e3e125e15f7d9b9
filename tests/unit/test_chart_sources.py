"""The Helm chart's generated files match their single sources (orchestrator/chart.py):
values.schema.json embeds the JobSpec's JSON Schema, files/dashboards/ holds
dashboards/grafana/*.json, files/stalwart.rules.yml is dashboards/rules/stalwart.rules.yml."""

from __future__ import annotations

import json
import shutil

import pytest

from stalwart.orchestrator import chart
from stalwart.orchestrator.spec import json_schema
from tests.unit.chart_check import CHART
from tests.unit.chart_check import chart as loaded_chart

pytestmark = pytest.mark.timeout(60)


def test_the_generated_files_are_current():
    assert chart.stale() == [], (
        f"helm/stalwart is stale ({', '.join(chart.stale())}): run `{chart.COMMAND}`"
    )


def test_the_values_schema_embeds_the_job_spec_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    job = json_schema()
    assert schema["properties"]["job"] == {"$ref": "#/$defs/JobSpec"}
    embedded = dict(schema["$defs"]["JobSpec"])
    assert embedded == {k: v for k, v in job.items() if k not in ("$defs", "$schema")}
    for name, definition in job["$defs"].items():
        assert schema["$defs"][name] == definition
    # Helm loads the same schema the generator wrote.
    assert loaded_chart().schema == schema


def test_the_chart_carries_every_dashboard_and_the_rules_unchanged():
    sources = chart.SOURCES
    dashboards = sorted(p.name for p in (CHART / "files" / "dashboards").glob("*.json"))
    assert dashboards == sorted(p.name for p in (sources / "grafana").glob("*.json"))
    for name in dashboards:
        copy = (CHART / "files" / "dashboards" / name).read_text()
        assert copy == (sources / "grafana" / name).read_text(), name
    rules = (CHART / "files" / "stalwart.rules.yml").read_text()
    assert rules == (sources / "rules" / "stalwart.rules.yml").read_text()


def test_check_names_each_drifted_file_and_the_command(tmp_path, capsys):
    copy = tmp_path / "stalwart"
    shutil.copytree(CHART, copy)
    (copy / "files" / "dashboards" / "nodes.json").write_text("{}\n")
    (copy / "files" / "dashboards" / "gone.json").write_text("{}\n")
    (copy / "files" / "stalwart.rules.yml").unlink()
    assert chart.main(["--check", "--chart", str(copy)]) == 1
    err = capsys.readouterr().err
    for name in ("files/dashboards/nodes.json", "files/dashboards/gone.json", "stalwart.rules.yml"):
        assert name in err
    assert chart.COMMAND in err
    # Writing brings it back in line, the dashboard without a source removed.
    assert chart.main(["--chart", str(copy)]) == 0
    assert chart.stale(copy) == []
    assert not (copy / "files" / "dashboards" / "gone.json").exists()


def test_a_missing_chart_is_one_line(tmp_path, capsys):
    assert chart.main(["--check", "--chart", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no chart at ") and err.count("\n") == 1

"""dashboards/rules: Prometheus accepts the rules, promtool's unit tests pass, every alert
has a test and a runbook entry, and the rules use only metrics the exporter defines."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stalwart.orchestrator.observe.metric_defs import DEFINITIONS

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "rules" / "stalwart.rules.yml"
TESTS = REPO / "dashboards" / "rules" / "tests" / "alerts.test.yml"
RUNBOOK = REPO / "docs" / "operations.md"

pytestmark = pytest.mark.timeout(120)


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (scripts/test.sh does)"
    return path


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_accepts_the_rules():
    out = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_rule_unit_tests_pass():
    out = subprocess.run(
        [_promtool(), "test", "rules", TESTS.name],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_test_and_a_runbook_entry():
    tests = {t["name"]: t for t in yaml.safe_load(TESTS.read_text())["tests"]}
    runbook = RUNBOOK.read_text()
    names = [a["alert"] for a in _alerts()]
    assert len(names) >= 8 and len(set(names)) == len(names)
    for alert in _alerts():
        name = alert["alert"]
        assert name in tests, f"{name}: no test group of that name in {TESTS.name}"
        cases = [c for c in tests[name].get("alert_rule_test", []) if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in cases), f"{name}: no test where it fires"
        assert any(not c.get("exp_alerts") for c in cases), f"{name}: no test where it is quiet"
        assert alert["annotations"]["runbook_url"] == f"docs/operations.md#{name.lower()}"
        assert f"\n## {name}\n" in runbook, f"{name}: no section in docs/operations.md"
        assert alert["labels"]["severity"] in ("page", "ticket")


def test_rules_use_only_metrics_the_exporter_defines():
    defined = {d.name for d in DEFINITIONS}
    text = RULES.read_text()
    used = {
        re.sub(r"_(bucket|count|sum)$", "", m) for m in re.findall(r"\bstalwart_[a-z0-9_]+", text)
    }
    assert used, "no stalwart_ metric in the rules"
    assert used <= defined, f"rules use metrics not in docs/metrics.md: {sorted(used - defined)}"

"""dashboards/prometheus/scrape.yml: Prometheus accepts it (with stalwart's rules loaded), its
Ray job reads the service discovery file Ray writes, and its stalwart job is the one the
rules and docs expect."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SCRAPE = REPO / "dashboards" / "prometheus" / "scrape.yml"
RULES = REPO / "dashboards" / "rules" / "stalwart.rules.yml"
OPERATIONS = REPO / "docs" / "operations.md"


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (scripts/test.sh does)"
    return path


def _jobs() -> dict[str, dict]:
    snippet = yaml.safe_load(SCRAPE.read_text())
    assert set(snippet) == {"scrape_configs"}, "the snippet holds scrape jobs only"
    return {job["job_name"]: job for job in snippet["scrape_configs"]}


def _check_config(config: dict, tmp_path: Path) -> str:
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    done = subprocess.run(
        [_promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"SUCCESS: {path} is valid prometheus config file syntax" in output
    return output


def test_promtool_accepts_a_prometheus_yml_made_from_the_snippet(tmp_path):
    """The snippet under a global section with the rules loaded, its discovery files moved
    into tmp_path (so that they exist): valid, no warnings, the rules found."""
    jobs = _jobs()
    ray_sd = tmp_path / "prom_metrics_service_discovery.json"
    ray_sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ["10.0.0.1:8080"]}]))
    stalwart_sd = tmp_path / "stalwart.d"
    stalwart_sd.mkdir()
    (stalwart_sd / "job-a.json").write_text(json.dumps([{"targets": ["10.0.0.1:9401"]}]))
    (stalwart_sd / "job-b.yml").write_text(yaml.safe_dump([{"targets": ["10.0.0.1:9402"]}]))
    jobs["ray"]["file_sd_configs"][0]["files"] = [str(ray_sd)]
    jobs["stalwart"]["file_sd_configs"][0]["files"] = [
        str(stalwart_sd / Path(pattern).name)
        for pattern in jobs["stalwart"]["file_sd_configs"][0]["files"]
    ]
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [str(RULES)],
        "scrape_configs": list(jobs.values()),
    }
    output = _check_config(config, tmp_path)
    assert "WARNING" not in output
    assert "SUCCESS: 1 rule files found" in output


def test_the_snippet_as_shipped_is_valid(tmp_path):
    """Pasted unchanged under a global section whose scrape timeout exceeds the stalwart
    job's interval: still valid (missing discovery files are only warnings)."""
    snippet = yaml.safe_load(SCRAPE.read_text())
    _check_config(
        {"global": {"scrape_interval": "1m", "scrape_timeout": "30s"}, **snippet}, tmp_path
    )


def test_the_ray_job_reads_rays_service_discovery_file():
    from ray._private import ray_constants

    [sd] = _jobs()["ray"]["file_sd_configs"]
    assert sd["files"] == [f"/tmp/ray/{ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE}"]


def test_the_stalwart_job_is_what_the_rules_and_docs_expect():
    job = _jobs()["stalwart"]
    absent = re.search(r'up\{job=~"([^"]+)"\}', RULES.read_text())
    assert absent, "StalwartExporterAbsent selects the scrape job by name"
    assert re.fullmatch(absent.group(1), job["job_name"])
    assert job["scrape_interval"] == "5s"
    assert int(job["scrape_timeout"].removesuffix("s")) <= 5
    # Targets come and go with the jobs (file discovery): a fixed target would be down
    # between jobs and StalwartExporterAbsent would fire.
    assert "static_configs" not in job
    [sd] = job["file_sd_configs"]
    assert all(f.startswith("/etc/prometheus/stalwart.d/") for f in sd["files"])
    # ... written by the jobs themselves (metrics.file_sd_dir), into the folder read here.
    assert "metrics: {file_sd_dir: /etc/prometheus/stalwart.d}" in SCRAPE.read_text()
    assert "file_sd_dir" in OPERATIONS.read_text()

"""`stalwart run -o json`: stdout carries result.json alone, whatever Ray prints meanwhile."""

from __future__ import annotations

import json

from click.testing import CliRunner

from stalwart.orchestrator import driver
from stalwart.orchestrator.cli import main


def test_run_json_keeps_stdout_for_the_result(monkeypatch, tmp_path):
    def run_job(spec, opts, on_progress=None, **_kw):
        # What Ray's error thread prints to stdout when a worker dies.
        print("(raylet) A worker died or was killed while executing a task")
        return {"name": spec.name, "status": "succeeded", "output": str(opts.output)}

    monkeypatch.setattr(driver, "run_job", run_job)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["run", "examples/quickstart.yaml", "-o", "json", "--run-dir", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "name": "quickstart",
        "status": "succeeded",
        "output": str(out),
    }
    assert "(raylet) A worker died" in result.stderr

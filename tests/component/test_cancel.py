"""Ctrl-C on `stalwart run` cancels the job cleanly and still writes the run directory."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import yaml

from tests.component.conftest import CLI, REPO, cli_env, small_spec

pytestmark = [pytest.mark.component, pytest.mark.timeout(240)]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)  # polling interval of a deadline-bounded wait


def test_ctrl_c_cancels_and_reports(tmp_path, ray_address):
    spec_path = tmp_path / "long.yaml"
    spec_path.write_text(yaml.safe_dump(small_spec(workers=2, steps=100000)))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*CLI, "run", str(spec_path), "--run-dir", str(out)],
        cwd=REPO,
        env=cli_env(ray_address),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        # Ctrl-C as in a terminal, even under a runner that ignores SIGINT (a shell's
        # background job does: the CLI would then inherit the ignore).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        events = out / "events.jsonl"

        def training() -> bool:
            return events.exists() and '"new": "RUNNING"' in events.read_text()

        wait_for(training, 120, "the job to reach RUNNING")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "cancelled"
    states = [json.loads(x) for x in events.read_text().splitlines()]
    assert states[-1]["type"] == "state" and states[-1]["new"] == "CANCELLED"

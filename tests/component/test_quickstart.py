"""The README's quickstart as a user runs it (embedded Ray, the CLI, the example), cut from
200 steps to 120 here (`--set steps=120`, the kill at step 60 and the recovery unchanged):
the two runs, with the kill and without it, are the suite's slowest jobs on two cores."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.component.conftest import stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(600)]


def stalwart(*args: str) -> subprocess.CompletedProcess:
    return stalwart_cli(*args, timeout=540)


STEPS = "steps=120"


def test_quickstart_kill_recovers_to_the_failure_free_model(tmp_path):
    with_kill = stalwart(
        "run", "examples/quickstart.yaml", "--set", STEPS, "--run-dir", str(tmp_path / "kill")
    )
    assert with_kill.returncode == 0, with_kill.stdout + with_kill.stderr
    out = with_kill.stdout
    # Live progress and the summary.
    for text in (
        "SCHEDULING -> RUNNING",
        "chaos: kill_worker rank 1 at step 60",
        "RUNNING -> RECOVERING",
        "recovered generation 2",
        "RUNNING -> SUCCEEDED",
        "120/120",
        "steps/s",
        "final loss",
        "steps redone",
        "worker_died",
        # What rank 0's loop prints, live, before and after the recovery.
        "[rank 0 gen 1] step 50: loss",
        "[rank 0 gen 2] step 100: loss",
    ):
        assert text in out, f"{text!r} not in output:\n{out}"
    # Ray's paragraph about the killed worker is kept out of the terminal, in logs/ray.log.
    assert "A worker died" not in out + with_kill.stderr
    assert "[rank 1 gen" not in out  # the other ranks' lines: in the logs only
    rank1 = stalwart("logs", str(tmp_path / "kill"), "--rank", "1")
    assert rank1.returncode == 0, rank1.stderr
    assert rank1.stdout.startswith("[rank 1 gen 1] step 0: loss"), rank1.stdout
    assert "[rank 1 gen 2] step 100: loss" in rank1.stdout
    killed = json.loads((tmp_path / "kill" / "result.json").read_text())

    clean = stalwart(
        "run",
        "examples/quickstart.yaml",
        "--set",
        STEPS,
        "--set",
        "chaos.faults=[]",
        "--run-dir",
        str(tmp_path / "clean"),
        "-o",
        "json",
    )
    assert clean.returncode == 0, clean.stderr
    printed = json.loads(clean.stdout)
    assert printed == json.loads((tmp_path / "clean" / "result.json").read_text())

    assert killed["status"] == printed["status"] == "succeeded"
    assert killed["model_digest"] == printed["model_digest"]
    assert killed["final_loss"] == printed["final_loss"]
    [failure] = killed["failures"]
    assert (failure["rank"], failure["step"]) == (1, 60)
    assert failure["steps_redone"] <= 1
    assert killed["lost_steps_total"] == failure["steps_redone"]
    # The loss visibly falls on the synthetic data.
    assert printed["final_loss"] < 3.0
    events = [json.loads(x) for x in (tmp_path / "kill" / "events.jsonl").read_text().splitlines()]
    recovered = [e for e in events if e["type"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["restore_step"] >= 59

"""docs/migrating.md's examples, run as the guide says: the torchrun script before the
migration under real torchrun, and the converted torchrun and Ray Train scripts through
`stalwart run` on an embedded Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from stalwart.ckpt.snapshot import state_digest
from stalwart.examples.ddp.torchrun_original import Net
from tests.component.conftest import REPO, stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(out) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]


def test_the_original_torchrun_script_runs_under_torchrun(tmp_path):
    out = tmp_path / "m.pt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "examples/ddp/torchrun_original.py",
            *("--steps", "6", "--out", str(out)),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = torch.load(out, weights_only=True)
    Net().load_state_dict(state)  # rank 0's model, the bare module's keys


def test_the_converted_torchrun_script_runs_from_its_job_spec_and_exports(tmp_path):
    """examples/ddp/job.yaml as docs/migrating.md launches it (shorter, without its kill),
    with a durable tier, whose last checkpoint `stalwart checkpoint export` turns into the
    file the original's rank 0 saved: the bare Net's state dict."""
    run_dir = tmp_path / "ddp"
    done = stalwart_cli(
        "run",
        "examples/ddp/job.yaml",
        *("--set", "steps=30", "--set", "chaos.faults=[]"),
        *("--set", f"checkpoint.persist.uri={tmp_path / 'durable'}"),
        *("--set", "checkpoint.persist.every_steps=10"),
        *("--run-dir", str(run_dir), "-o", "json"),
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["status"] == "succeeded", result["error"]
    assert result["steps_completed"] == 30
    assert result["failures"] == []
    assert result["final_loss"] < 1.2  # it learns: log(4) = 1.39 at the start

    exported = stalwart_cli(
        "checkpoint", "export", str(run_dir), str(tmp_path / "export"), "--format", "torch",
        "-o", "json",
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    manifest = json.loads(exported.stdout)
    assert manifest["step"] == 30
    model = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    Net().load_state_dict(model)
    assert state_digest(model) == result["model_digest"]


def test_the_converted_ray_train_script_recovers_from_its_kill(tmp_path):
    """examples/raytrain/job.yaml as written: rank 1 killed at step 20, one recovery."""
    run_dir = tmp_path / "rt"
    done = stalwart_cli(
        "run", "examples/raytrain/job.yaml", "--run-dir", str(run_dir), "-o", "json",
        timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["status"] == "succeeded", result["error"]
    assert result["steps_completed"] == 60
    [failure] = result["failures"]
    assert (failure["kind"], failure["rank"], failure["step"]) == ("worker_died", 1, 20)
    recovered = [e for e in _events(run_dir) if e["type"] == "recovered"]
    assert len(recovered) == 1, recovered
    assert result["final_loss"] < 1.2

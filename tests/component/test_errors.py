"""Bad input and user errors end with a clear message and a non-zero exit, losing nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.component.conftest import REPO, SMALL, small_spec, stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]


def stalwart(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return stalwart_cli(*args, timeout=timeout)


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def test_user_error_fails_fast_with_rank_and_traceback(run):
    spec = small_spec(
        workers=2,  # here and below: what is tested does not depend on the world's size
        entrypoint="tests/component/loops.py:raising_loop",
        config__raise_at=6,
        config__raise_rank=1,
    )
    result = run(spec)
    assert result["status"] == "failed"
    err = result["error"]
    assert err["rank"] == 1
    assert err["kind"] == "user_error"
    assert err["error_type"] == "DataCorrupted"
    assert "bad record in shard 1 at step 6" in err["message"]
    assert "failure.user_error_retries=0" in err["message"]
    assert "raising_loop" in err["traceback"] or "report" in err["traceback"]
    assert "DataCorrupted" in err["traceback"]
    assert result["restarts"] == 0  # not retried
    # What the rank printed last, beside its traceback (the loop prints at step 0).
    [line] = err["output_tail"]
    assert line.startswith("step 0: loss "), line


def test_user_error_retried_within_budget_then_fails(run):
    spec = small_spec(
        workers=2,
        entrypoint="tests/component/loops.py:raising_loop",
        config__raise_at=6,
        config__raise_rank=0,
        failure__user_error_retries=1,
    )
    result = run(spec)
    assert result["status"] == "failed"
    assert result["restarts"] == 1  # one deterministic replay, then it gives up
    assert [f["kind"] for f in result["failures"]] == ["user_error", "user_error"]


def test_a_loss_that_is_nan_again_after_the_roll_back_fails_the_job(run):
    spec = small_spec(
        workers=2,
        entrypoint="tests/component/loops.py:nan_loss_loop",
        config__nan_rank=1,
        config__nan_step=12,
    )
    result = run(spec)
    assert result["status"] == "failed"
    err = result["error"]
    assert (err["rank"], err["kind"]) == (1, "loss_not_finite")
    assert "rank 1: the loss at step 12 was nan again after rolling back" in err["message"]
    assert "the replay is bit-exact" in err["message"]
    assert result["restarts"] == 1  # one roll back, then it gives up
    assert [(f["kind"], f["step"]) for f in result["failures"]] == [("loss_not_finite", 12)] * 2
    # The roll back kept every worker (nothing was lost) and went back before step 12.
    assert [e for e in result["events"] if e["type"] == "replaced"] == []
    gen2 = [e for e in result["events"] if e["type"] == "generation"][1]
    assert gen2["restore_step"] is not None and gen2["restore_step"] <= 12


def test_a_state_no_checkpoint_can_keep_fails_at_the_first_capture(run):
    # Refused when the initial state (step 0) is captured, not at the first restore after a
    # failure, hours into the run.
    result = run(
        small_spec(workers=2, entrypoint="tests/component/loops.py:unsafe_state_loop", steps=5)
    )
    assert result["status"] == "failed"
    err = result["error"]
    assert (err["kind"], err["error_type"]) == ("user_error", "CheckpointStateError")
    assert (
        "ctx.register(sampler=...): sampler.state_dict()['lock'] is a _thread.lock"
        in (err["message"])
    ), err["message"]
    assert "cannot be pickled" in err["message"]
    assert result["steps_completed"] == 0 and result["restarts"] == 0


def test_more_gpus_than_the_cluster_has(run):
    result = run(small_spec(resources={"cpu": 1, "gpu": 2}))
    assert result["status"] == "failed"
    assert result["error"]["message"] == (
        "resources.gpu: the job needs 8 GPU (4 workers x 2), the cluster has 0"
    )


def test_validate_reports_every_error_with_its_path(tmp_path):
    bad = dict(SMALL, workers=0, bogus=1)
    bad["checkpoint"] = {"every_steps": 0}
    bad["failure"] = {"max_restarts": "many"}
    proc = stalwart("validate", str(write_spec(tmp_path / "bad.yaml", bad)))
    assert proc.returncode == 2
    err = proc.stderr
    assert "workers: must be >= 1, got 0" in err
    assert "checkpoint.every_steps: must be >= 1, got 0" in err
    assert "failure.max_restarts: " in err
    assert "bogus: unknown field" in err


def test_validate_ok_and_set_overrides(tmp_path):
    path = write_spec(tmp_path / "ok.yaml", SMALL)
    proc = stalwart(
        "validate",
        str(path),
        "--set",
        "steps=77",
        "--set",
        "chaos.faults=[{kind: kill_worker, rank: 2, at_step: 30}]",
        "-o",
        "json",
    )
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["steps"] == 77
    assert spec["chaos"]["faults"] == [
        {
            "kind": "kill_worker",
            "rank": 2,
            "at_step": 30,
            "after_commit": False,
            "after_persist": False,
            "during": None,
            "in_collective": None,
            "peer_of_rank": None,
        }
    ]
    proc = stalwart("validate", str(path), "--set", "checkpoint.every_steps=0")
    assert proc.returncode == 2
    assert "checkpoint.every_steps: must be >= 1, got 0" in proc.stderr


def test_run_validates_before_touching_ray(tmp_path):
    path = write_spec(tmp_path / "bad.yaml", dict(SMALL, steps=-1))
    t0 = time.monotonic()
    proc = stalwart("run", str(path))
    assert proc.returncode == 2
    assert "steps: must be >= 1, got -1" in proc.stderr
    assert time.monotonic() - t0 < 30  # no Ray was started


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        ("no_such_pkg.train:loop", "cannot import no_such_pkg.train: ModuleNotFoundError"),
        ("loops.py:missing", "has no attribute 'missing'"),
        ("loops.py:not_callable", "not_callable is a int, not callable"),
        ("nope.py:loop", "does not exist"),
    ],
)
def test_bad_entrypoint(tmp_path, entrypoint, expected):
    spec = dict(SMALL, entrypoint=entrypoint)
    # Relative file entrypoints resolve against the spec's directory, here this one's.
    path = write_spec(REPO / "tests" / "component" / f".tmp-{tmp_path.name}.yaml", spec)
    try:
        proc = stalwart("run", str(path))
    finally:
        path.unlink()
    assert proc.returncode == 2
    assert expected in proc.stderr


def test_unreachable_address(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    path = write_spec(tmp_path / "ok.yaml", SMALL)
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        proc = stalwart("run", str(path), "--address", address, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"cannot reach the Ray cluster at {address}" in proc.stderr


def test_schema_command():
    proc = stalwart("schema")
    assert proc.returncode == 0
    schema = json.loads(proc.stdout)
    assert {"name", "entrypoint", "workers", "chaos", "checkpoint"} <= set(schema["properties"])


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text(
        textwrap.dedent("""
        name: !!python/object/apply:os.system ["echo pwned"]
        entrypoint: a.b:c
        workers: 1
        steps: 1
    """)
    )
    proc = stalwart("validate", str(path))
    assert proc.returncode == 2
    assert "not valid YAML" in proc.stderr
    assert "pwned" not in proc.stdout


def test_entrypoint_missing_on_the_cluster_is_reported_by_the_workers(run):
    # On a cluster the driver does not check the entrypoint (the code may live in the
    # cluster's image); the workers' import error ends the job with a clear message.
    result = run(small_spec(workers=2, entrypoint="no_such_pkg.train:loop"))
    assert result["status"] == "failed"
    message = result["error"]["message"]
    assert "a worker failed to start" in message
    assert "cannot import no_such_pkg.train: ModuleNotFoundError" in message


def test_checkpoints_that_do_not_fit_the_nodes_are_refused_before_the_workers_start(run):
    """checkpoint.state_size_per_rank: the nodes' memory and /dev/shm are asked before any
    worker starts (supervisor/memory_check.py), and the refusal gives the chart's sum."""
    result = run(small_spec(checkpoint__state_size_per_rank="1Pi"))
    assert result["status"] == "failed"
    message = result["error"]["message"]
    assert message.startswith("the in-memory checkpoints do not fit: node "), message
    assert "x 1048576Gi (checkpoint.state_size_per_rank) x 6 versions" in message
    assert "GiB of memory available" in message and "/dev/shm has" in message
    types = {e["type"] for e in result["events"]}
    assert "generation" not in types and "startup" not in types  # no worker was started

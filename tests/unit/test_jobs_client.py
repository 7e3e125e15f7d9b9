"""The Jobs API side of the CLI that needs no cluster: headers and tokens, the status records
read from a job's log, the run-directory archive, the upload size check, the local registry,
and `status` of a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from stalwart.orchestrator import registry
from stalwart.orchestrator.cli import main
from stalwart.orchestrator.cli_jobs import exit_code
from stalwart.orchestrator.jobs import (
    RESULT_PREFIX,
    STATUS_PREFIX,
    Job,
    JobsError,
    archive_lines,
    check_upload_size,
    parse_headers,
    parse_status,
    read_secret,
    unpack_archive,
    user_lines,
)

pytestmark = pytest.mark.timeout(60)


def test_headers_come_from_flags_over_ray_job_headers_and_bad_ones_are_named():
    env = {"RAY_JOB_HEADERS": '{"X-Team": "ml", "X-Env": "dev"}'}
    assert parse_headers(("X-Env: prod",), env) == {"X-Team": "ml", "X-Env": "prod"}
    with pytest.raises(JobsError, match="expected 'Name: value'"):
        parse_headers(("no colon",), {})
    with pytest.raises(JobsError, match="RAY_JOB_HEADERS: expected a JSON object"):
        parse_headers((), {"RAY_JOB_HEADERS": "[1]"})


def test_a_token_never_shows_itself(tmp_path):
    f = tmp_path / "token"
    f.write_text("s3cr3t-value\n")
    secret = read_secret(str(f), {})
    assert secret.reveal() == "s3cr3t-value"
    assert "s3cr3t" not in repr(secret) + str(secret) and str(f) in repr(secret)
    assert read_secret(None, {"STALWART_RAY_TOKEN": "abc"}).reveal() == "abc"
    assert read_secret(None, {}) is None
    with pytest.raises(JobsError, match="cannot read it"):
        read_secret(str(tmp_path / "missing"), {})
    f.write_text("two words")
    with pytest.raises(JobsError, match="expected one token"):
        read_secret(str(f), {})


def test_status_records_are_read_from_the_log_and_left_out_of_its_lines():
    log = "\n".join(
        [
            "[rank 0 gen 1] step 0: loss 4.1",
            STATUS_PREFIX + json.dumps({"state": "RUNNING", "step": 3}),
            "[rank 1 gen 2] step 50: loss 3.6",
            STATUS_PREFIX + "{torn",  # a record cut short: the one before stands
            RESULT_PREFIX + json.dumps({"status": "succeeded"}),
        ]
    )
    progress, result = parse_status(log)
    assert progress == {"state": "RUNNING", "step": 3} and result == {"status": "succeeded"}
    assert list(user_lines(log.splitlines())) == [
        "[rank 0 gen 1] step 0: loss 4.1",
        "[rank 1 gen 2] step 50: loss 3.6",
    ]
    assert list(user_lines(log.splitlines(), rank=1)) == ["[rank 1 gen 2] step 50: loss 3.6"]


def test_a_run_directory_comes_back_whole_and_nothing_outside_it(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "result.json").write_text('{"status": "succeeded"}')
    (run / "logs" / "rank-0.log").write_text("x" * 100_000)
    (run / "escape").symlink_to("/etc/passwd")
    text = "noise\n" + "\n".join(archive_lines(run)) + "\nmore noise\n"
    files = unpack_archive(text, tmp_path / "back")
    back = tmp_path / "back"
    assert (back / "result.json").read_text() == '{"status": "succeeded"}'
    assert (back / "logs" / "rank-0.log").stat().st_size == 100_000
    assert {p.name for p in files} == {"result.json", "rank-0.log"}
    assert not (back / "escape").exists()  # a link is not carried
    with pytest.raises(JobsError, match="over the 0 MiB"):
        list(archive_lines(run, max_bytes=10))
    with pytest.raises(JobsError, match="printed no archive"):
        unpack_archive("nothing here", tmp_path / "none")


def test_an_upload_over_rays_limit_is_refused_before_any_upload(tmp_path, monkeypatch):
    from ray._private.runtime_env import packaging

    (tmp_path / "big.bin").write_bytes(os.urandom(300_000))
    (tmp_path / ".gitignore").write_text("ignored.bin\n")
    (tmp_path / "ignored.bin").write_bytes(os.urandom(3_000_000))
    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 1_000_000)
    check_upload_size(tmp_path, [])  # .gitignore'd: 0.3 MB of 1 MB
    (tmp_path / "big2.bin").write_bytes(os.urandom(800_000))
    with pytest.raises(JobsError, match=r"zipped, over Ray's 1.0 MiB upload limit"):
        check_upload_size(tmp_path, [])
    check_upload_size(tmp_path, ["big2.bin"])  # --exclude


def test_exit_codes_follow_stalwarts_result_then_rays_state():
    def job(status):
        return Job("id", "n", status, None, None, None, None)

    assert exit_code(job("RUNNING"), None) == 0
    assert exit_code(job("SUCCEEDED"), {"status": "succeeded"}) == 0
    assert exit_code(job("SUCCEEDED"), {"status": "failed"}) == 1  # the driver's own verdict
    assert exit_code(job("FAILED"), None) == 1
    assert exit_code(job("STOPPED"), {"status": "cancelled"}) == 130
    assert exit_code(job("STOPPED"), None) == 130


def test_the_registry_names_only_jobs_whose_driver_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    registry.record("job/a", "127.0.0.1:6379", "runs/a")
    assert registry.lookup("job/a")["address"] == "127.0.0.1:6379"
    registry.forget("job/a")
    assert registry.lookup("job/a") is None
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        timeout=30,
    ).stdout.strip()
    path = next(iter((tmp_path / "stalwart").glob("jobs"))) / "b.json"
    path.write_text(json.dumps({"name": "b", "address": "x", "pid": int(dead)}))
    assert registry.lookup("b") is None and not path.exists()


def test_status_of_a_run_directory_says_what_is_wrong_and_exits_by_its_result(tmp_path):
    runner = CliRunner()
    (tmp_path / "result.json").write_text("{}")
    got = runner.invoke(main, ["status", str(tmp_path)])
    assert got.exit_code == 2 and "not the result of a stalwart run" in got.output
    assert "missing: name, status, steps_completed" in got.output
    result = {
        "name": "j",
        "steps_completed": 3,
        "total_steps": 10,
        "final_loss": None,
        "wall_seconds": 1.0,
        "goodput": None,
        "status": "failed",
        "failures": [],
        "lost_steps_total": 0,
        "error": {"message": "rank 0 raised ValueError"},
    }
    (tmp_path / "result.json").write_text(json.dumps(result))
    got = runner.invoke(main, ["status", str(tmp_path)])
    assert got.exit_code == 1 and "rank 0 raised ValueError" in got.output, got.output
    (tmp_path / "result.json").write_text("[1, 2]")
    got = runner.invoke(main, ["status", str(tmp_path)])
    assert got.exit_code == 2 and "Traceback" not in got.output

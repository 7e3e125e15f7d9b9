"""`stalwart submit`, `status`, `logs`, `stop`, `list` against a real Ray head started by the
test (`ray start --head`, its dashboard's Jobs API on 127.0.0.1) with a worker raylet beside
it, with Ray's token authentication on. The CLI runs as a user runs it: a subprocess."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.component.prometheus import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
START_S = 120  # `ray start` of a head on a busy 2-core machine
QUICKSTART = "examples/quickstart.yaml"


class RayHead:
    """A head (`ray start --head --block`) and one worker raylet, each in its own process
    group, stopped by signalling those groups (never `ray stop`: it stops every Ray here)."""

    def __init__(self, tmp: Path):
        self.token = secrets.token_hex(32)
        self.home = tmp / "home"
        self.home.mkdir()
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "HOME": str(self.home),  # the jobs' run directories land in here
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.gcs_port, dash = free_port(), free_port()
        self.address = f"http://127.0.0.1:{dash}"
        self.temp = Path(f"/tmp/stw-{secrets.token_hex(3)}")
        common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        self.procs = [
            self._start(
                "--head",
                f"--port={self.gcs_port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dash}",
                f"--ray-client-server-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                "--num-cpus=2",
                f"--temp-dir={self.temp}",
                *common,
            )
        ]
        self._wait_for_dashboard()
        self.procs.append(
            self._start(
                f"--address=127.0.0.1:{self.gcs_port}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                "--num-cpus=2",
                *common,
            )
        )
        self._wait_for_nodes(2)

    def _start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN / "ray"), "start", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _get(self, path: str) -> object:
        import requests

        r = requests.get(
            self.address + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=5
        )
        r.raise_for_status()
        return r.json()

    def _wait_for_dashboard(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                self._get("/api/version")
                return
            except Exception:
                assert self.procs[0].poll() is None, "ray start --head exited"
                assert time.monotonic() < deadline, "the Ray head did not come up"
                time.sleep(0.5)

    def _wait_for_nodes(self, n: int) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                nodes = self._get("/nodes?view=summary")["data"]["summary"]
                if sum(1 for x in nodes if x["raylet"]["state"] == "ALIVE") >= n:
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, f"{n} raylets did not come up"
            time.sleep(0.5)

    def stop(self) -> None:
        # SIGKILL to the groups: `ray start --block` stops its processes gracefully on a
        # SIGTERM, which takes ~30 s; nothing of this cluster needs to outlive the test.
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    h = RayHead(tmp_path_factory.mktemp("rayhead"))
    yield h
    h.stop()


def cli(head: RayHead | None, *args: str, token: str | None = None, timeout: float = 120):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    if head is not None:
        env["STALWART_RAY_TOKEN"] = token or head.token
    return subprocess.run(
        [str(BIN / "stalwart"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def submit(head: RayHead, *sets: str) -> str:
    args = ["submit", "examples/quickstart.yaml", "--address", head.address, "--allow-remote"]
    for s in sets:
        args += ["--set", s]
    done = cli(head, *args)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.startswith("stalwart-"), done.stdout
    return job_id


def status(head: RayHead, job: str) -> dict:
    done = cli(head, "status", job, "--address", head.address, "-o", "json")
    assert done.returncode in (0, 1, 130), done.stderr
    return json.loads(done.stdout)


def wait_for(head: RayHead, job: str, ok, what: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(head, job)
        if ok(s):
            return s
        assert s["job"]["status"] not in ("FAILED", "STOPPED"), s
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s: {s}"
        time.sleep(1.0)  # polling the Jobs API, bounded by the deadline


SMALL = [
    "workers=2",
    "failure.spares=0",
    "config.model.d_model=32",
    "config.model.n_layers=1",
    "config.model.seq_len=16",
    "config.batch_size=8",
]


@pytest.mark.timeout(600)
def test_a_submitted_job_trains_on_after_its_follower_is_killed_and_is_seen_to_the_end(
    head, tmp_path
):
    # The quickstart as a user submits it: rank 1 killed at step 60, chaos opted in. Its
    # ranks wait before step 12 until the test has seen it running (a few status calls of
    # a busy machine outlast the whole run otherwise).
    release = tmp_path / "release"
    job = submit(
        head,
        *SMALL,
        "steps=140",
        "chaos.enabled=true",
        "entrypoint=tests.component.loops:held_loop",
        "config.hold_at=12",
        f"config.release={release}",
        "health.hang_timeout_s=300",  # the hold is idle on purpose: not a hang
    )
    # A follower on the laptop (logs -f), killed mid-run: the job does not depend on it.
    follower = subprocess.Popen(
        [str(BIN / "stalwart"), "logs", job, "-f", "--address", head.address],
        cwd=REPO,
        env={**os.environ, "STALWART_RAY_TOKEN": head.token},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    running = wait_for(
        head,
        job,
        lambda s: (s["progress"] or {}).get("step", 0) >= 10,
        "stalwart's own progress while it runs",
    )
    assert running["progress"]["state"] in ("RUNNING", "RECOVERING"), running
    assert running["job"]["name"] == "quickstart"
    follower.send_signal(signal.SIGKILL)
    follower.wait(timeout=10)
    release.touch()

    # By name, as well as by id, until the end.
    ended = wait_for(head, "quickstart", lambda s: s["result"] is not None, "the result")
    result = ended["result"]
    assert ended["job"]["submission_id"] == job
    assert result["status"] == "succeeded", result
    assert result["steps_completed"] == 140
    assert [f["kind"] for f in result["failures"]] == ["worker_died"]  # the chaos kill

    text = cli(head, "status", job, "--address", head.address)
    assert text.returncode == 0 and "succeeded" in text.stdout, text.stdout + text.stderr

    listed = cli(head, "list", "--address", head.address, "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = {j["submission_id"]: j for j in json.loads(listed.stdout)}
    assert rows[job]["status"] == "SUCCEEDED" and rows[job]["name"] == "quickstart"

    logs = cli(head, "logs", job, "--address", head.address, "--rank", "1")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert lines and all(ln.startswith("[rank 1 gen ") for ln in lines), lines[:5]
    everything = cli(head, "logs", job, "--address", head.address).stdout
    assert "STALWART_STATUS" not in everything and "[rank 0 gen 1] step 0" in everything

    fetched = cli(head, "status", job, "--address", head.address, "--fetch", str(tmp_path / "r"))
    assert fetched.returncode == 0, fetched.stderr
    local = json.loads((tmp_path / "r" / "result.json").read_text())
    assert local["model_digest"] == result["model_digest"]
    assert (tmp_path / "r" / "events.jsonl").stat().st_size > 0


@pytest.mark.timeout(400)
def test_stop_cancels_a_running_job_cleanly_and_its_result_is_written(head, tmp_path):
    job = submit(head, *SMALL, "name=long", "steps=100000", "chaos.faults=[]")
    wait_for(head, job, lambda s: (s["progress"] or {}).get("step", 0) >= 5, "training")
    stopped = cli(head, "stop", "long", "--address", head.address)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped {job} at step" in stopped.stdout, stopped.stdout

    final = cli(head, "status", job, "--address", head.address, "--fetch", str(tmp_path / "r"))
    assert final.returncode == 130, final.stdout + final.stderr  # cancelled
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert result["status"] == "cancelled", result
    assert 5 <= result["steps_completed"] < 100000


class _NotRay(http.server.BaseHTTPRequestHandler):
    version = None  # a server claiming this Ray version on /api/version

    def do_GET(self):
        if self.version and self.path == "/api/version":
            body = json.dumps({"ray_version": self.version}).encode()
        else:
            body = b"<html>not Ray</html>"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(version: str | None) -> http.server.HTTPServer:
    handler = type("H", (_NotRay,), {"version": version})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.timeout(120)
def test_bad_addresses_and_credentials_are_one_clear_line_each(head):
    other, old = _serve(None), _serve("2.9.3")
    try:
        cases = {
            f"http://127.0.0.1:{free_port()}": "cannot reach the Ray dashboard",
            f"http://127.0.0.1:{other.server_port}": "is not a Ray dashboard",
            f"http://127.0.0.1:{old.server_port}": "runs Ray 2.9.3; stalwart needs Ray >= 2.55",
            f"ray://127.0.0.1:{head.gcs_port}": "expected the Jobs API of a Ray head",
        }
        for address, expected in cases.items():
            for args in (
                ["list"],
                ["status", "x"],
                ["submit", QUICKSTART, "--set", "chaos.faults=[]"],
            ):
                if address.startswith("ray://") and args[0] == "status":
                    continue  # status attaches to a supervisor through ray:// (test_status)
                done = cli(head, *args, "--address", address)
                assert done.returncode == 2, (args, address, done.stderr)
                assert expected in done.stderr, (args, address, done.stderr)
                assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) < 6
    finally:
        other.shutdown()
        old.shutdown()
    refused = cli(head, "list", "--address", head.address, token="0" * 64)
    assert refused.returncode == 2 and "refused the credentials" in refused.stderr
    assert "0" * 64 not in refused.stderr + refused.stdout  # a token is never printed
    missing = cli(head, "status", "no-such-job", "--address", head.address)
    assert missing.returncode == 2 and "no stalwart job with the id or name" in missing.stderr


@pytest.mark.timeout(400)
def test_a_chaos_scenario_runs_on_the_cluster_through_its_jobs_api(head, tmp_path):
    scenario = "examples/chaos/kill-worker.yaml"
    job = '["chaos.enabled=true", "steps=50", "workers=2", "failure.spares=0"]'
    base = ["chaos", "run", scenario, "--address", head.address, "--set", f"job.set={job}"]
    refused = cli(head, *base)  # faults on a cluster this command did not start: opt in
    assert refused.returncode == 2 and "need --allow-remote" in refused.stderr
    junit = tmp_path / "junit.xml"
    done = cli(head, *base, "--allow-remote", "--junit", str(junit), timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "PASS  kill-worker" in done.stdout and "identical model" in done.stdout
    assert 'failures="0"' in junit.read_text()

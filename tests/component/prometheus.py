"""A real Prometheus server (Debian's package) for tests: loopback only, a temporary config
and data directory, stopped and removed afterwards."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        rule_files: list[Path],
        file_sd: Path | None = None,
    ):
        """Scrapes `targets`, or the targets in file_sd's *.json files (file_sd_configs)."""
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: install Debian's prometheus package"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = workdir
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": "stalwart",
                    "scrape_timeout": "1s",
                    **(
                        {"file_sd_configs": [{"files": [str(file_sd / "*.json")]}]}
                        if file_sd is not None
                        else {"static_configs": [{"targets": targets}]}
                    ),
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self._wait_ready(60)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)  # polling a server that is starting, bounded by the deadline
        raise AssertionError(f"prometheus not ready in {timeout_s} s: {self.log_tail()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a query error)."""
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float) -> list[dict[str, Any]]:
        """The query's result once it is not empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                return result
            time.sleep(0.5)  # Prometheus scrapes and evaluates every second
        raise AssertionError(f"no data for {promql!r} within {timeout_s} s")

    def log_tail(self) -> str:
        self._log.flush()
        return (self.dir / "prometheus.log").read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.dir / "data", ignore_errors=True)

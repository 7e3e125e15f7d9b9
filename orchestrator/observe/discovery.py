"""Prometheus file-based discovery of a job's exporter (metrics.file_sd_dir): the supervisor
writes DIR/stalwart-NAME.json in Prometheus's file_sd format once its exporter listens, and
removes it metrics.linger_s after the job ended (the last scrapes see the end state), or when
its process exits. Prometheus picks files up and drops them without a reload
(dashboards/prometheus/scrape.yml's `stalwart` job reads DIR/*.json)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

WILDCARD = ("0.0.0.0", "::", "")


class TargetFile:
    """One job's target file."""

    def __init__(self, folder: str, name: str, host: str, port: int, node_ip: str):
        self.path = (
            Path(folder).expanduser() / f"stalwart-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"
        )
        # An exporter on every interface is scraped at the node's address.
        address = node_ip if host in WILDCARD else host
        self.target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        self.labels = {"stalwart_name": name}
        self._removed = threading.Event()

    @classmethod
    def publish(cls, m: Any, name: str, port: int, emit: Callable[..., Any]) -> TargetFile | None:
        """The target file of job `name`'s exporter on `port`, written, where the spec's
        metrics section (`m`) names a file_sd_dir; a folder that cannot be written costs
        the discovery, not the job: an event says why."""
        if not m.file_sd_dir:
            return None
        import ray

        target = cls(m.file_sd_dir, name, m.host, port, ray.util.get_node_ip_address())
        try:
            target.write()
        except OSError as e:
            emit(
                "metrics_unavailable",
                reason=f"cannot write the Prometheus target file {target.path} "
                f"(metrics.file_sd_dir): {e.strerror or e}",
            )
            return None
        return target

    def write(self) -> None:
        """Atomically (Prometheus never reads half a file); OSError when the folder cannot
        be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([{"targets": [self.target], "labels": self.labels}]) + "\n")
        tmp.replace(self.path)
        atexit.register(self.remove)

    @staticmethod
    def retire(target: TargetFile | None, seconds: float) -> None:
        """Remove `target` (if any) `seconds` from now: the last scrapes see the end state."""
        if target is None:
            return
        if seconds <= 0:
            target.remove()
            return
        timer = threading.Timer(seconds, target.remove)
        timer.daemon = True
        timer.start()

    def remove(self) -> None:
        """Remove the file if it is still this exporter's (a later job of the same name may
        have written its own)."""
        if self._removed.is_set():
            return
        self._removed.set()
        with contextlib.suppress(OSError, ValueError):
            current = json.loads(self.path.read_text())
            if current and current[0].get("targets") == [self.target]:
                self.path.unlink()

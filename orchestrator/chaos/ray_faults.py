"""Faults of Ray itself in a chaos scenario: `restart_gcs`, the head's GCS killed and started
again under a running job, carried out by `stalwart chaos run` on the local cluster it
started (like the faults of the network, orchestrator/chaos/network.py, they are done to
the job from outside, so they live in the scenario, not in the job spec).

    cluster: {worker_nodes: 3, gcs_ft: true}
    faults:
      - {kind: restart_gcs, at_step: 40, down_s: 5}

With `cluster.gcs_ft` the head keeps the GCS's tables in a Redis (Debian's redis-server,
started on a loopback port for the scenario and stopped after it: what the Helm chart's
`gcsFaultTolerance` does with KubeRay): the GCS comes back with the cluster's nodes, actors
and jobs, raylets and workers reconnect, the job trains through. Without it the restarted
GCS is another cluster: every process of the old one is lost with it (Ray aborts them:
"WrongClusterID"), and the job is resubmitted on a new cluster, where it resumes from the
newest durable step (orchestrator/chaos/runner.py).

The raylet of a worker node killed alone is a job fault (`kill_raylet`,
orchestrator/spec_faults.py): a node loss to the job.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stalwart.orchestrator.chaos.network import JobWatch

REDIS_START_S = 10.0  # redis-server answering PING on its port, at most


class RestartGcs(BaseModel):
    """Kill the head's GCS server and start it again `down_s` later."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["restart_gcs"]
    at_step: int | None = Field(None, ge=0, description="fire once the job reached this step")
    after_seconds: float | None = Field(
        None, ge=0, description="instead of at_step: fire this long after training started"
    )
    down_s: float = Field(5.0, gt=0, le=300, description="how long the GCS stays down")

    @model_validator(mode="after")
    def _one_trigger(self) -> RestartGcs:
        if (self.at_step is None) == (self.after_seconds is None):
            raise ValueError("name one of `at_step` or `after_seconds`")
        return self


def is_ray_fault(fault: dict[str, Any]) -> bool:
    return isinstance(fault, dict) and fault.get("kind") == "restart_gcs"


def parse(data: dict[str, Any]) -> RestartGcs:
    """A scenario's fault of Ray, checked (pydantic's ValidationError names the field)."""
    return RestartGcs.model_validate(data)


class RedisMissing(RuntimeError):
    """cluster.gcs_ft: no redis-server on this machine."""


@contextlib.contextmanager
def redis_store() -> Iterator[str]:
    """A Redis for the GCS's tables on a free loopback port, nothing persisted to disk,
    stopped (and its directory removed) on the way out. Yields its address, host:port."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisMissing(
            "cluster.gcs_ft needs redis-server (Debian's redis-server package; the README's "
            "test command installs it)"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = tempfile.mkdtemp(prefix="stalwart-gcs-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", where]
    proc = subprocess.Popen([*args, "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        _wait_for_redis(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)


def _wait_for_redis(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + REDIS_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RedisMissing(f"redis-server exited at start (status {proc.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as c:
            c.sendall(b"PING\r\n")
            if c.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)  # bounded by the deadline
    raise RedisMissing(f"redis-server did not answer on 127.0.0.1:{port} in {REDIS_START_S:g} s")


class RayFaultInjector:
    """Carries out a scenario's faults of Ray on the local cluster (ray.cluster_utils'
    Cluster) while the chaos run trains. A GCS it restarted lives as long as the thread
    that started it (Ray's fate sharing): until `finish()`, which the caller calls once
    the run is over, just before it stops the cluster. `applied`: one record per fault,
    for the verdict (shaped as the network faults' are: no node named, so a failure of
    any node while it lasted is its)."""

    def __init__(self, faults: list[RestartGcs], cluster: Any, events: Path):
        self.faults, self.cluster = faults, cluster
        self.watch = JobWatch(events)
        self.applied: list[dict[str, Any]] = [
            {**f.model_dump(mode="json"), "outcome": "not fired"} for f in faults
        ]
        self._done = threading.Event()
        self._lock = threading.Lock()  # the GCS's state: down or up
        self._down = False
        self._threads = [
            threading.Thread(target=self._one, args=(i,), name=f"chaos-ray-{i}", daemon=True)
            for i in range(len(faults))
        ]
        for t in self._threads:
            t.start()

    def over(self) -> bool:
        """Every fault is done with: healed, or not to be carried out."""
        return all(
            r.get("healed_at") or r["outcome"] not in ("not fired", "injected")
            for r in self.applied
        )

    def _one(self, i: int) -> None:
        f, rec = self.faults[i], self.applied[i]
        if not self.watch.wait_until_due(f.at_step, f.after_seconds, self._done):
            return
        with self._lock:
            if self._down:
                rec["outcome"] = "refused: the GCS is down already"
                return
            start = time.time()
            try:
                self.cluster.head_node.kill_gcs_server()
            except Exception as e:  # the verdict says what failed
                rec["outcome"] = f"failed: {e}"
                return
            self._down = True
        rec.update(outcome="injected", target="head (GCS)", node_ids=None, step=self.watch.step)
        rec.update(at=start, windows=[])
        self._done.wait(f.down_s)
        try:
            self._start_again()
        except Exception as e:
            rec["outcome"] = f"failed: the GCS did not start again: {e}"
            return
        rec["healed_at"] = time.time()
        rec["windows"].append([round(start, 3), round(rec["healed_at"], 3)])
        # Ray ties the GCS process to the thread that started it (PR_SET_PDEATHSIG: the
        # kernel kills it when that thread ends): this one lives until the run is over.
        self._done.wait()

    def _start_again(self) -> None:
        with self._lock:
            if self._down:
                self.cluster.head_node.start_gcs_server()
                self._down = False

    def finish(self) -> list[dict[str, Any]]:
        """Stop waiting, return what was done (a GCS still down is started, for the
        cluster's orderly stop)."""
        self._done.set()
        for t in self._threads:
            t.join(timeout=60)
        with contextlib.suppress(Exception):  # a fault's thread said why already
            self._start_again()
        return self.applied

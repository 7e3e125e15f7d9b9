"""Component tests run real jobs on a real local Ray (one cluster per session) with real gloo."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.orchestrator.chaos.runner import QUIET_HEAD, computes
from stalwart.orchestrator.chaos.scenario import lean_baseline
from stalwart.orchestrator.driver import RunOptions, run_job
from stalwart.orchestrator.spec import set_path, validate

REPO = Path(__file__).resolve().parents[2]

# A smaller model than the quickstart's, so each job takes seconds on two cores.
SMALL = {
    "name": "ct",
    "entrypoint": "stalwart.examples.gpt.train:train_loop",
    "workers": 4,
    "resources": {"cpu": 1},
    "steps": 40,
    "seed": 7,
    "checkpoint": {"every_steps": 1},
    # Standbys (on by default where memory allows) are off in these jobs, which test
    # other things: their placements stay as written. test_standby.py and the chaos
    # scenarios (examples/chaos/job.yaml) run with them.
    "failure": {"max_restarts": 3, "standby": False},
    "config": {
        "batch_size": 8,
        "lr": 0.003,
        "model": {
            "vocab": 32,
            "seq_len": 16,
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "dropout": 0.1,
        },
    },
    "chaos": {"faults": []},
}


# Steps of about 0.1 s, so that "within 10 steps" measures a detector, not the heartbeat's
# transport (a few hundred milliseconds), and compute, not a busy machine's scheduling,
# dominates a step.
HEAVIER = {
    "batch_size": 16,
    "model": {**SMALL["config"]["model"], "d_model": 192, "n_layers": 2, "seq_len": 64},
}


def small_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SMALL)
    for dotted, value in changes.items():
        set_path(spec, dotted.split("__"), value)
    return spec


# The `stalwart` command as the tests start it: this Python, the repository's package.
CLI = (sys.executable, "-m", "stalwart.orchestrator.cli")


def cli_env(address: str | None = None) -> dict[str, str]:
    """The environment the CLI runs in, as a user's: RAY_ADDRESS set to `address` (unset by
    default)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env["RAY_ADDRESS"] = address
    return env


def stalwart_cli(
    *args: str, timeout: float = 240, address: str | None = None
) -> subprocess.CompletedProcess:
    """Run the `stalwart` CLI as a user would, in the repository, with RAY_ADDRESS set to
    `address` (unset by default)."""
    return subprocess.run(
        [*CLI, *args],
        cwd=REPO,
        env=cli_env(address),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def ray_address():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 8, **QUIET_HEAD},
    )
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def _baselines() -> dict[str, dict[str, Any]]:
    return {}


def make_runner(address: str, tmp_path: Path):
    """Run a job spec dict on the cluster at `address`; returns result.json's content with
    the event log under "events"."""
    counter = iter(range(1000))

    def _run(spec: dict[str, Any]) -> dict[str, Any]:
        out = tmp_path / f"run{next(counter)}"
        result = run_job(
            validate(spec),
            # The tests started these clusters: a kill_node may kill a raylet there.
            RunOptions(address=address, output=out, base_dir=str(REPO), owns_cluster=True),
        )
        on_disk = json.loads((out / "result.json").read_text())
        assert on_disk["status"] == result["status"]
        result["events"] = [
            json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
        ]
        return result

    return _run


@pytest.fixture
def run(ray_address, tmp_path):
    """Run a job spec dict on the session's cluster; returns result.json's content."""
    return make_runner(ray_address, tmp_path)


def make_baseline(run, cache: dict[str, dict[str, Any]]):
    """The failure-free run of a spec through `run`, cached in `cache` by what decides its
    model: specs that differ only in how the job is kept alive (its name and the sections
    `stalwart chaos run` leaves out of its baseline key) share one run, which is lean as
    `stalwart chaos run`'s is (orchestrator/chaos/scenario.py lean_baseline): no spares,
    standbys, copies or durable checkpoints (a later run of the spec would resume from
    them), one snapshot at the end."""

    def _baseline(spec: dict[str, Any]) -> dict[str, Any]:
        clean = copy.deepcopy(spec)
        clean["chaos"] = {"faults": []}
        normal = validate(clean)
        key = json.dumps(computes(normal), sort_keys=True)
        if key not in cache:
            result = run(lean_baseline(normal, normal.name).model_dump(mode="json"))
            assert result["status"] == "succeeded", result["error"]
            assert result["failures"] == []
            cache[key] = result
        return cache[key]

    return _baseline


@pytest.fixture
def baseline(run, _baselines):
    """The failure-free run of the same spec (cached for the session, see make_baseline)."""
    return make_baseline(run, _baselines)


def events_of(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in result["events"] if e["type"] == kind]


# --- the session's multi-node cluster (tests/conftest.py, tests/component/multinode.py) -------


@pytest.fixture
def mrun(multinode, tmp_path):
    """Run a job spec dict on the session's multi-node cluster (3 worker nodes at least)."""
    multinode.ensure_worker_nodes(3)
    return make_runner(multinode.address, tmp_path)


@pytest.fixture
def mbaseline(mrun, _baselines):
    """The failure-free run of a spec, on the multi-node cluster unless the session has it
    already (a model does not depend on the cluster it was trained on)."""
    return make_baseline(mrun, _baselines)

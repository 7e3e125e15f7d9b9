"""Health detection on a real multi-node local Ray (several raylets on this machine).

The head node runs the driver and the supervisor and takes no workers (no CPUs); workers
go to worker nodes, which the tests kill, slow down or give GPU faults. The oracle for
exactness is the model digest of the failure-free run of the same spec.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import pytest

from tests.component.conftest import HEAVIER, events_of, make_runner, small_spec, stalwart_cli
from tests.component.multinode import WORKER_NODE_CPUS

pytestmark = [pytest.mark.component, pytest.mark.timeout(420)]


def _rates(result, generation, before_step=None):
    return [
        e["steps_per_s"]
        for e in events_of(result, "throughput")
        if e["generation"] == generation and (before_step is None or e["step"] <= before_step)
    ]


def test_slow_rank_replaced_by_a_spare_on_another_node(mrun):
    # Two ranks, one core each: on this two-core machine four ranks share the cores, and a
    # slow rank that sleeps gives its core to the others, hiding the slowdown in the step
    # time (a slow GPU would not). The detector sees it either way; throughput needs this.
    onset = 40
    spec = small_spec(
        workers=2,
        steps=140,
        # Compute, not the per-step snapshot, should dominate a step here.
        checkpoint__every_steps=5,
        config__batch_size=HEAVIER["batch_size"],
        config__model=HEAVIER["model"],
        failure__spares=1,
        health__straggler={"policy": "replace"},
        chaos__faults=[{"kind": "slow", "rank": 1, "at_step": onset, "factor": 3}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    [flag] = result["stragglers"]
    assert flag["rank"] == 1 and flag["action"] == "replace"
    # The verdict rests on data through 10 steps after onset at most; the flag itself comes
    # when that data reaches the supervisor (a heartbeat and a poll later).
    assert flag["through_step"] - onset <= 10, flag
    [failure] = result["failures"]
    assert failure["kind"] == "straggler"
    assert [c["node"] for c in result["cordoned"]] == [flag["node"]]
    [replaced] = events_of(result, "replaced")
    assert replaced["ranks"]["1"]["via"] == "spare"
    assert replaced["ranks"]["1"]["node"] != flag["node"]
    # Throughput: before the onset (after the first second's warm-up), while rank 1 was
    # slow (up to the flag), and after its replacement (after the restart's first second).
    before = statistics.median(_rates(result, 1, before_step=onset)[1:])
    slow = flag["steps_per_s"]
    # After: once the used spare's successor has started (on two cores its start-up
    # competes with training for a few seconds).
    refilled = [e["ts"] for e in events_of(result, "spare_ready") if e["ts"] > flag["at"]]
    after = statistics.median(
        [
            e["steps_per_s"]
            for e in events_of(result, "throughput")
            if e["generation"] == 2 and (not refilled or e["ts"] > refilled[0])
        ][1:]
    )
    assert slow < 0.6 * before, (before, slow, after)
    assert after > 1.5 * slow and after > 0.7 * before, (before, slow, after)


def test_slow_rank_with_policy_alert_is_flagged_not_replaced(mrun):
    spec = small_spec(
        steps=80,
        # Compute, not a busy two-core machine's scheduling, should dominate a step here.
        config__batch_size=HEAVIER["batch_size"],
        config__model=HEAVIER["model"],
        health__straggler={"policy": "alert"},
        chaos__faults=[{"kind": "slow", "rank": 3, "at_step": 20, "factor": 3}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    flags = result["stragglers"]
    assert flags and {(f["rank"], f["action"]) for f in flags} == {(3, "noop")}, flags
    assert result["failures"] == [] and result["generations"] == 1
    assert result["cordoned"] == []


@pytest.fixture(scope="module")
def healthy_500(multinode, tmp_path_factory):
    """A healthy 500-step run, snapshots and copies as usual (not a lean baseline): the
    subject of the test below, and the loss reference of the elastic test (one run for
    both)."""
    multinode.ensure_worker_nodes(3)
    run = make_runner(multinode.address, tmp_path_factory.mktemp("healthy"))
    return run(small_spec(steps=500))


def test_healthy_500_step_run_has_no_straggler_flags(healthy_500):
    result = healthy_500
    assert result["status"] == "succeeded", result["error"]
    assert result["stragglers"] == []
    assert events_of(result, "straggler") == []


def test_application_xid_restarts_the_rank_on_the_same_node(mrun, mbaseline):
    spec = small_spec(
        steps=40, chaos__faults=[{"kind": "gpu_xid", "rank": 2, "xid": 13, "at_step": 15}]
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    [err] = events_of(result, "gpu_error")
    assert err["ranks"] == [2]
    [failure] = result["failures"]
    assert failure["kind"] == "gpu_error" and failure["rank"] == 2
    assert result["cordoned"] == []
    [replaced] = events_of(result, "replaced")
    assert replaced["ranks"]["2"]["node"] == err["node"]
    assert result["model_digest"] == mbaseline(spec)["model_digest"]


def test_preflight_cordons_a_slow_node_before_training_starts(mrun, mbaseline):
    spec = small_spec(
        steps=30, chaos__faults=[{"kind": "slow", "rank": 0, "at_step": 0, "factor": 8}]
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    checks = events_of(result, "preflight")
    assert len(checks) == 2  # all nodes, then the node the ranks moved to
    [slow_node] = checks[0]["failed"]
    assert checks[1]["failed"] == {}
    [cordon] = result["cordoned"]
    assert cordon["node"] == slow_node and "preflight" in cordon["reason"]
    [moved] = events_of(result, "preflight_moved")
    assert all(node != slow_node for node in moved["ranks"].values())
    types = [e["type"] for e in result["events"]]
    # Before training: the cordon and the move come before the first generation starts.
    assert types.index("preflight_moved") < types.index("generation")
    assert checks[0]["seconds"] < 10
    assert result["failures"] == [] and result["generations"] == 1
    assert result["model_digest"] == mbaseline(spec)["model_digest"]


def _wait_for_event(out: Path, kind: str, timeout_s: float, since: int = 0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = out / "events.jsonl"
        if path.exists():
            events = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            found = [e for e in events[since:] if e["type"] == kind]
            if found:
                return found[0]
        time.sleep(0.2)  # polling a file another thread writes; bounded by the deadline
    raise AssertionError(f"no {kind!r} event within {timeout_s} s")


def test_elastic_shrink_when_no_capacity_and_grow_back(multinode, tmp_path, healthy_500):
    """4 ranks, one per node (2 CPUs each); a node dies and no node has room: the job goes on
    with 3 ranks after failure.replacement_timeout_s, and grows back to 4 when a node joins.
    Exactness cannot hold across world sizes: the loss must stay on course."""
    multinode.ensure_worker_nodes(4, exactly=True)
    spec = small_spec(
        workers={"min": 3, "max": 4},
        resources={"cpu": WORKER_NODE_CPUS},
        steps=500,
        failure__replacement_timeout_s=4,
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 20}],
    )
    out = tmp_path / "elastic"
    runner, box = _start(multinode, spec, out)
    shrunk = _wait_for_event(out, "resized", timeout_s=120)
    assert (shrunk["old"], shrunk["new"]) == (4, 3)
    # The lost node's slot was given back: no placement group is left for Ray to re-place
    # (which, with no room anywhere, keeps Ray's GCS busy; see orchestrator/supervisor/slots.py).
    from ray.util.placement_group import placement_group_table

    stuck = [
        g["name"]
        for g in placement_group_table().values()
        if g["name"].startswith(f"stalwart-{spec['name']}") and g["state"] == "RESCHEDULING"
    ]
    assert stuck == []
    multinode.cluster.add_node(num_cpus=WORKER_NODE_CPUS)  # capacity returns
    runner.join(timeout=300)
    assert not runner.is_alive()
    result = box["result"]
    assert result["status"] == "succeeded", result["error"]
    assert [(r["from"], r["to"]) for r in result["resizes"]] == [(4, 3), (3, 4)]
    assert result["workers"] == 4
    # The loss reference: the same model at a fixed world size of 4 (one torch thread per
    # rank instead of two sums a little differently: the loss check allows far more).
    clean = healthy_500
    assert result["steps_completed"] == 500
    assert abs(result["final_loss"] - clean["final_loss"]) < 0.15 * clean["final_loss"], (
        result["final_loss"],
        clean["final_loss"],
    )


_STARTED: list[tuple[object, str]] = []  # (thread, job name) of jobs run in a thread


@pytest.fixture(autouse=True)
def _stop_jobs_left_running():
    """A test that fails while its job runs in a thread stops that job, so the next test
    gets the cluster (and this process's Ray connection) to itself."""
    yield
    import ray

    while _STARTED:
        thread, name = _STARTED.pop()
        if not thread.is_alive():
            continue
        with contextlib.suppress(ValueError, ray.exceptions.RaySystemError):  # gone meanwhile
            ray.get_actor(f"stalwart-{name}", namespace="stalwart").cancel.remote()
        thread.join(timeout=60)
        assert not thread.is_alive(), f"job {name} did not stop within 60 s of a cancel"


def _start(multinode, spec, out):
    """Run `spec` in a thread (the test acts on the job meanwhile); join it to get the result."""
    import threading

    from stalwart.orchestrator.driver import RunOptions, run_job
    from stalwart.orchestrator.spec import validate
    from tests.component.conftest import REPO

    box: dict = {}
    job = validate(spec)

    def target():
        opts = RunOptions(
            address=multinode.address, output=out, base_dir=str(REPO), owns_cluster=True
        )
        box["result"] = run_job(job, opts)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    _STARTED.append((thread, job.name))
    return thread, box


def test_uncordon_from_the_cli_while_the_job_runs(multinode, tmp_path):

    multinode.ensure_worker_nodes(3)
    spec = small_spec(
        name="uncordon-me",
        steps=300,
        chaos__faults=[{"kind": "gpu_xid", "rank": 0, "xid": 79, "at_step": 5}],
    )
    out = tmp_path / "job"
    thread, box = _start(multinode, spec, out)
    cordoned = _wait_for_event(out, "cordoned", timeout_s=120)

    def cli(*args):
        return stalwart_cli(*args, timeout=120, address=multinode.address)

    wrong = cli("uncordon", "ffffffff", "--job", "uncordon-me")
    assert wrong.returncode == 2 and "is not cordoned" in wrong.stderr, wrong.stderr
    missing = cli("uncordon", cordoned["node"][:12], "--job", "no-such-job")
    assert missing.returncode == 2 and "no running stalwart job" in missing.stderr
    ok = cli("uncordon", cordoned["node"][:12], "--job", "uncordon-me")
    assert ok.returncode == 0, ok.stderr
    assert cordoned["node"] in ok.stdout
    event = _wait_for_event(out, "uncordoned", timeout_s=30)
    assert event["node"] == cordoned["node"] and event["reason"] == "by the user"
    thread.join(timeout=300)
    assert box["result"]["status"] == "succeeded", box["result"]["error"]


def _agent_beside(worker_pid: int) -> int:
    """The pid of the node agent on `worker_pid`'s node: the child of the worker's raylet
    whose process title names the agent's class (a worker forked from its node's zygote
    names the raylet in the environment it inherited)."""
    from stalwart.orchestrator.chaos.actions import _parent

    environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
    named = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"RAY_RAYLET_PID=")]
    raylet = int(named[0]) if named else _parent(worker_pid)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            title = (entry / "cmdline").read_bytes().decode(errors="replace")
            if "NodeAgent" in title and _parent(int(entry.name)) == raylet:
                found.append(int(entry.name))
    [agent] = found
    return agent


def test_an_agent_starved_of_cpu_on_a_live_node_does_not_lose_the_node(multinode, tmp_path):
    # An agent that cannot run (stopped here, starved of CPU in the storm scenario: a node
    # was declared lost, its healthy ranks replaced, the node cordoned) while its node's
    # raylet still accepts connections: the node is up. It is told starved, not lost, and
    # the job goes on when the agent runs again.
    import os
    import signal

    multinode.ensure_worker_nodes(3)
    spec = small_spec(name="starved-agent", steps=120)
    out = tmp_path / "job"
    thread, box = _start(multinode, spec, out)
    scheduled = _wait_for_event(out, "scheduled", timeout_s=120)
    rank0 = scheduled["workers"]["0"]
    agent = _agent_beside(rank0["pid"])
    _wait_for_event(out, "throughput", timeout_s=120)
    os.kill(agent, signal.SIGSTOP)
    try:
        starved = _wait_for_event(out, "agent_starved", timeout_s=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # lost with its node, without the fix
            os.kill(agent, signal.SIGCONT)
    assert starved["node"] == rank0["node_id"] and starved["seconds"] >= 3.0, starved
    assert "raylet accepts connections" in starved["reason"]
    thread.join(timeout=300)
    result = box["result"]
    assert result["status"] == "succeeded", result["error"]
    assert result["failures"] == [] and result["lost_nodes"] == [] and result["cordoned"] == []
    assert result["steps_completed"] == 120

"""Checkpoint tiers on a real multi-node local Ray: peer replicas in memory, the restore
chain. The oracle is the model digest of the failure-free run of the same spec."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from stalwart.ckpt.durable import DurableStore
from stalwart.ckpt.footprint import COMMITS_KEPT, VERSIONS
from stalwart.ckpt.snapshot import restore
from stalwart.orchestrator.spec import validate
from tests.component.conftest import CLI, REPO, cli_env, events_of, small_spec, stalwart_cli
from tests.component.multinode import WORKER_NODE_CPUS

pytestmark = [pytest.mark.component, pytest.mark.timeout(420)]


def test_one_replica_loses_the_node_shards_and_starts_over_exactly(mrun, mbaseline):
    spec = small_spec(
        steps=40,
        checkpoint={"every_steps": 1, "replicas": 1},
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 15}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert events_of(result, "replica_plan")[0]["copies"] == 1
    [scratch] = events_of(result, "restart_from_scratch")
    assert "checkpoint.replicas=1" in scratch["reason"]
    assert result["replication"]["sent_bytes"] == 0
    assert result["model_digest"] == mbaseline(spec)["model_digest"]


def test_commit_waits_for_the_copies_and_memory_stays_bounded(mrun):
    """Per-step snapshots with replicas=2: the committed step follows training closely, and
    no node keeps more than the retained commits plus a few newest steps per rank."""
    spec = small_spec(steps=80, checkpoint={"every_steps": 1, "replicas": 2})
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["committed_step"] is not None and result["committed_step"] >= 70
    lags = [e["commit_lag_steps"] for e in events_of(result, "throughput")]
    assert lags and all(lag is not None for lag in lags[1:])
    assert result["replication"]["sent_bytes"] > 0 and result["replication"]["errors"] == 0
    # Each node holds its own ranks' shards and copies of its group's other ranks: per rank
    # its ring (ckpt/footprint.py: 2 commits, 3 newest, 1 being written), the 2 retained
    # commits' copies, a step being aligned and one being sent, and the copies newer than
    # the commit of the supervisor's last prune: it prunes once per report, and the final
    # counts are of the reports before its last prune took effect, so up to 3 report
    # intervals of steps. Bounded, far from the 80 steps x 4 ranks kept without trimming.
    held = result["replication"]["shards_held"]
    rate = max(e["steps_per_s"] for e in events_of(result, "throughput"))
    interval = validate(spec).health.report_interval_s
    per_rank = VERSIONS + COMMITS_KEPT + 2 + math.ceil(3 * rate * interval)
    assert held and sum(held.values()) <= 4 * per_rank, (held, rate)


def test_a_job_within_four_versions_per_rank_recovers_from_each_fault_kind(
    multinode, mrun, mbaseline
):
    """checkpoint.memory_budget: 4 at replicas=2 (the lean rule, ckpt/footprint.py): each
    node keeps 2 versions of its ranks' state and 2 copies of its peers', and the job
    recovers from a killed worker, a hang and a lost node to the failure-free model, each
    costing at most one step, its checkpoints never taking more than 4x the state per rank
    (rings, copies and spare buffers, as the nodes report them)."""
    multinode.ensure_worker_nodes(3)
    spec = small_spec(
        steps=90,
        checkpoint={"every_steps": 1, "replicas": 2, "memory_budget": 4},
        # 2.4 MB of state per rank: the rings' skeleton areas and headers are small beside.
        config__model__d_model=128,
        health__hang_timeout_s=4.0,
        failure__max_restarts=6,
        chaos__faults=[
            {"kind": "kill_worker", "rank": 1, "at_step": 20},
            {"kind": "hang", "rank": 2, "at_step": 40},
            {"kind": "kill_node", "rank": 3, "at_step": 60},
        ],
    )
    assert validate(spec).checkpoint.max_lag_steps == 0  # the lean rule copies every step
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert result["model_digest"] == mbaseline(spec)["model_digest"]
    failures = result["failures"]
    assert {f["fault_index"] for f in failures} == {0, 1, 2}, failures
    assert all(f["steps_redone"] <= 1 for f in failures), failures
    assert not events_of(result, "restart_from_scratch")
    state = result["checkpoint"]["bytes_per_snapshot"]
    world = spec["workers"]
    held = [e["memory_bytes"] for e in events_of(result, "throughput") if e["memory_bytes"]]
    # Rings, copies and buffers, all nodes: 4x the state per rank, and the rings' headers
    # and skeleton areas (a few pages a slot).
    assert held and max(held) <= 4.1 * world * state, (max(held), state)


@pytest.mark.long
def test_nodes_lost_at_random_steps_of_a_fast_loop_cost_at_most_the_lag_bound(
    multinode, mrun, mbaseline
):
    """checkpoint.max_lag_steps (2, the default): the commit never trails the newest
    snapshot by more than 2 steps, so a node lost at any moment costs at most 3 steps. Five
    nodes killed at random steps of one job (a spare node for each), a loop of tens
    of steps a second; each loss redoes <= 3 steps and the job ends with the failure-free
    model. Before the bound, the copies of such a loop lagged by seconds: a loss sent it
    back dozens of steps, or to step 0."""
    seed = int(os.environ.get("STALWART_TEST_SEED") or time.time_ns() % 10**6)
    rng = random.Random(seed)
    at = [20 + 55 * i + rng.randrange(35) for i in range(5)]
    faults = [{"kind": "kill_node", "rank": rng.randrange(4), "at_step": s} for s in at]
    spec = small_spec(
        steps=300,
        failure__max_restarts=8,
        chaos__faults=faults,
        # The memory preflight asks each node (the loop's state is ~0.1 MB): they fit.
        checkpoint__state_size_per_rank="1Mi",
    )
    assert validate(spec).checkpoint.max_lag_steps == 2  # the default
    # A node's place for each loss, from the start (Ray's test cluster adds nodes from the
    # main thread only, which runs the job).
    multinode.ensure_worker_nodes(3 + len(faults))
    try:
        result = mrun(spec)
    finally:
        multinode.ensure_worker_nodes(3, exactly=True)
    why = f"seed {seed} (STALWART_TEST_SEED), faults {faults}"
    assert result["status"] == "succeeded", (result["error"], why)
    assert len(events_of(result, "node_lost")) == 5, (result["failures"], why)
    for f in result["failures"]:  # one per rank lost
        assert f["kind"] == "node_lost", (f, why)
        assert f["steps_redone"] is not None and f["steps_redone"] <= 3, (f, why)
    assert result["replication"]["wait_s"] is not None
    multinode.ensure_worker_nodes(3)
    clean = mbaseline(spec)
    assert result["model_digest"] == clean["model_digest"], why


def _two_nodes_spec(**changes):
    """2 ranks, one per node (2 CPUs each): one replica group of both nodes."""
    return small_spec(
        workers=2,
        resources={"cpu": WORKER_NODE_CPUS},
        **changes,
    )


def test_kill_node_and_drop_replicas_restore_from_durable_storage(
    multinode, mrun, mbaseline, tmp_path
):
    # Ranks on two nodes (one replica group); a third node takes rank 0's replacement.
    uri = tmp_path / "durable"
    spec = _two_nodes_spec(
        steps=80,
        checkpoint={
            "every_steps": 1,
            "replicas": 2,
            "persist": {"uri": str(uri), "every_steps": 10, "keep_last": 2},
        },
        # Both wait at step 55 until step 50 is on storage (after_persist): at 65 steps/s
        # the job ran past its first writes, and a restore from step 0 tests nothing. The
        # wait's bound is half the hang timeout: room for a failed write's 5 s cool-down.
        health__hang_timeout_s=30,
        chaos__faults=[
            {"kind": "drop_replicas", "rank": 1, "at_step": 55, "after_persist": True},
            {"kind": "kill_node", "rank": 0, "at_step": 55, "after_persist": True},
        ],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    persisted = [e["step"] for e in events_of(result, "persisted")]
    assert persisted and all(s % 10 == 0 for s in persisted), persisted
    # Neither node's memory has a complete step: rank 0's node is gone, rank 1's was wiped.
    assert events_of(result, "restart_from_scratch") == []
    gen2 = events_of(result, "generation")[1]
    assert gen2["restore_tiers"] == {"durable": 2}
    assert 10 <= gen2["restore_step"] <= 50 and gen2["restore_step"] % 10 == 0
    assert gen2["restore_step"] in persisted
    waited = {e["persisted_step"] for e in events_of(result, "fault_injected")}
    assert waited == {50} and gen2["restore_step"] == 50  # what after_persist waited for
    # A failed write (a step being written when the faults hit; see docs/checkpoints.md for
    # another seen once) leaves the older checkpoints in use and a later one is written.
    for failed in events_of(result, "persist_failed"):
        assert "older complete checkpoints stay valid" in failed["reason"]
    assert max(persisted) > gen2["restore_step"]
    # keep_last=2: two complete checkpoints on storage, every one with its manifest.
    steps = sorted(p.name for p in (uri / spec["name"]).iterdir())
    assert len(steps) <= 3, steps  # 2 complete + possibly one being written at the end
    complete = [s for s in steps if (uri / spec["name"] / s / "manifest.json").exists()]
    assert len(complete) == 2, steps
    multinode.ensure_worker_nodes(3)  # the lost node's place, for the baseline's 2 ranks
    assert result["model_digest"] == mbaseline(spec)["model_digest"]


def _wait_for(path: Path, kind: str, ok, timeout_s: float) -> dict:
    """The first event of `kind` in the events.jsonl at `path` for which ok(event) holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    e = json.loads(line)
                    if e["type"] == kind and ok(e):
                        return e
        time.sleep(0.2)  # polling a file another process writes; bounded by the deadline
    raise AssertionError(f"no matching {kind!r} event in {path} within {timeout_s} s")


def test_driver_sigkill_then_rerun_resumes_from_the_last_durable_step(
    multinode, mrun, mbaseline, tmp_path
):
    uri = tmp_path / "durable"
    spec = small_spec(
        name="resume-me",
        steps=300,
        checkpoint={
            "every_steps": 1,
            "replicas": 2,
            "persist": {"uri": str(uri), "every_steps": 20, "keep_last": 3},
        },
    )
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = cli_env()
    first_out = tmp_path / "first"
    first = subprocess.Popen(
        [
            *CLI,
            *("run", str(job)),
            *("--address", multinode.address, "--run-dir", str(first_out), "-o", "json"),
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(first_out / "events.jsonl", "persisted", lambda e: e["step"] >= 40, 180)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    done_before = max(int(p.name.split("-")[1]) for p in (uri / "resume-me").iterdir())
    assert done_before < 300, "the first run was not interrupted"

    second = stalwart_cli(
        "run", str(job), "--run-dir", str(tmp_path / "second"), "-o", "json",
        address=multinode.address, timeout=300,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout)
    assert result["status"] == "succeeded", result["error"]
    [resume] = [e for e in _events(tmp_path / "second") if e["type"] == "resume"]
    assert resume["step"] >= 40 and resume["step"] % 20 == 0, resume
    assert "resuming from durable step" in resume["reason"]
    assert result["resumed_from"] == resume["step"]
    gen1 = next(e for e in _events(tmp_path / "second") if e["type"] == "generation")
    assert gen1["restore_step"] == resume["step"] and gen1["restore_tiers"] == {"durable": 4}
    assert result["model_digest"] == mbaseline(spec)["model_digest"]
    # The same job again with --resume never starts at step 0 although durable steps of it
    # exist (a shorter run: only where it starts matters).
    never = stalwart_cli(
        "run", str(job), "--run-dir", str(tmp_path / "third"), "-o", "json", "--resume", "never",
        "--set", "steps=30", address=multinode.address, timeout=300,
    )  # fmt: skip
    assert never.returncode == 0, never.stderr[-3000:]
    assert json.loads(never.stdout)["resumed_from"] is None


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]


def test_corrupt_and_partial_checkpoints_are_skipped_with_reasons(mrun, mbaseline, tmp_path):
    uri = tmp_path / "durable"
    spec = small_spec(
        name="corrupt-me",
        # Long enough for two grid steps and the end to be written (a write takes 0.2-0.5 s
        # on a busy 2-core machine; 45 steps trained in 1.5 s left one grid step, once).
        steps=95,
        checkpoint={"persist": {"uri": str(uri), "every_steps": 10, "keep_last": 3}},
    )
    first = mrun(spec)
    assert first["status"] == "succeeded", first["error"]
    root = uri / "corrupt-me"
    # keep_last=3 complete checkpoints: of the grid (10, 20, ... 90: the newest may not have
    # been due before the end) and the end of the run (95).
    kept = sorted(int(p.name.split("-")[1]) for p in root.iterdir())
    assert len(kept) == 3 and kept[-1] == 95, kept
    oldest, middle, newest = kept
    # Rank 1's file of the DCP step, named for the generation that wrote it.
    [shard] = (root / f"step-{newest:012d}").glob("__1_0.gen*.distcp")
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    (root / f"step-{middle:012d}" / "manifest.json").unlink()  # a writer died before it
    second = mrun(spec)
    assert second["status"] == "succeeded", second["error"]
    skipped = {
        e["step"]: e["reason"] for e in second["events"] if e["type"] == "checkpoint_skipped"
    }
    assert set(skipped) == {newest, middle}
    assert "rank 1" in skipped[newest] and "truncated" in skipped[newest]
    assert "manifest" in skipped[middle]
    assert second["resumed_from"] == oldest
    assert second["model_digest"] == mbaseline(spec)["model_digest"]


# A storage outage: tests/chaos, scenario storage-unavailable.


def test_sharded_optimizer_kill_node_restores_each_ranks_own_shard_exactly(
    mrun, mbaseline, tmp_path
):
    # ZeroRedundancyOptimizer (ZeRO-1): each rank holds AdamW's moments for its own
    # partition of the parameters only, so the four ranks checkpoint different state.
    uri = tmp_path / "durable"
    spec = small_spec(
        name="zero",
        entrypoint="stalwart.examples.gpt.train_zero:train_loop",
        steps=60,
        checkpoint={
            "every_steps": 10,
            "replicas": 2,
            "persist": {"uri": str(uri), "every_steps": 20, "keep_last": 5},
        },
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 37, "after_commit": True}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    [lost] = events_of(result, "node_lost")
    gen2 = events_of(result, "generation")[1]
    assert set(map(int, gen2["restored_remotely"])) == set(lost["ranks"])
    assert set(gen2["restored_remotely"].values()) == {"peer"}
    assert gen2["restore_step"] == 30
    # Exact: restoring another rank's shard would be refused (ckpt/sharded.py ShardMismatch)
    # and a wrong moment would change the digest.
    assert result["model_digest"] == mbaseline(spec)["model_digest"]
    # What the ranks checkpoint: each its own partition, of different sizes.
    store = DurableStore(str(uri), "zero")
    manifest, _ = store.newest_valid(world_size=4)
    assert manifest is not None and manifest.step == 60
    partitions = {}
    for rank in range(4):
        state = restore(store.read_shard(manifest.step, rank, manifest))
        partitions[rank] = state["objects"]["optimizer"]["partition"]
        assert (partitions[rank]["rank"], partitions[rank]["world_size"]) == (rank, 4)
        moments = state["objects"]["optimizer"]["local"]["state"]
        assert [m["exp_avg"].numel() for m in moments.values()] == partitions[rank]["numels"]
    # The partitions differ and together cover the model (which has no buffers) once.
    assert len({tuple(p["numels"]) for p in partitions.values()}) > 1, partitions
    model = restore(store.read_shard(manifest.step, 0, manifest))["objects"]["model"]
    covered = sorted(n for p in partitions.values() for n in p["numels"])
    assert covered == sorted(t.numel() for t in model.values())

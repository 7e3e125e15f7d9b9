"""FSDP2 state through DCP, against plain torch (tests/component/plain_fsdp.py, which
imports nothing of stalwart: the checks that use it run it in a process of its own):

- a DCP checkpoint stalwart wrote loads with plain ``dcp.load`` and training goes on from
  it bit for bit as in stalwart;
- a job starts from a DCP checkpoint a plain torchrun-style FSDP2 script saved
  (``checkpoint.init_from``) and ends with the model the script itself would have;
- an elastic shrink from 4 to 2 ranks (a lost node, no room) reshards the state from the
  nodes' memory, and a resume at 3 ranks reshards it from durable storage: the losses after
  each are those of plain torch continuing from the same state at that world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.component.conftest import REPO, events_of, small_spec, stalwart_cli
from tests.component.multinode import WORKER_NODE_CPUS

pytestmark = [pytest.mark.component, pytest.mark.timeout(600)]


def plain(**args) -> tuple[dict[int, list[float]], str]:
    """tests/component/plain_fsdp.py's plain job, in a fresh Python process."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.component.plain_fsdp", json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses, digest, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported is False  # plain torch only
    return {int(r): ls for r, ls in losses.items()}, digest


def job(tmp_path: Path, **changes) -> dict:
    return small_spec(
        name="dcp",
        entrypoint="tests.component.plain_fsdp:train_loop",
        output_dir=str(tmp_path / "out"),
        **{"config": {}, **changes},
    )


def losses_of(out: Path, rank: int, world: int) -> dict[int, float]:
    """step -> rank `rank`'s loss, from the newest generation the job ran at `world`."""
    rows = [json.loads(x) for x in (out / f"loss-rank{rank}.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r[1] == world]
    newest = max(r[0] for r in rows)
    return {step: loss for gen, _, step, loss in rows if gen == newest}


def test_a_dcp_checkpoint_stalwart_wrote_loads_with_plain_dcp_load(mrun, tmp_path):
    uri = tmp_path / "durable"
    spec = job(
        tmp_path,
        steps=16,
        checkpoint={"every_steps": 1, "persist": {"uri": str(uri), "every_steps": 8}},
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    step8 = uri / "dcp" / "step-000000000008"
    assert (step8 / ".metadata").exists() and (step8 / "__3_0.gen1.distcp").exists()
    # Plain torch, from stalwart's step 8: steps 8..15 as stalwart trained them.
    losses, digest = plain(world=4, steps=16, start=8, load=str(step8))
    assert digest == result["model_digest"]
    assert losses[0] == list(losses_of(tmp_path / "out", 0, 4).values())[8:]
    # `stalwart checkpoint export` of the sharded step 16: the full model, whose digest is
    # the job's (the digest of a sharded model is the unsharded model's).
    out = tmp_path / "export"
    done = stalwart_cli("checkpoint", "export", str(uri), str(out), "--format", "torch")
    assert done.returncode == 0, done.stderr
    import torch

    from stalwart.ckpt.snapshot import state_digest

    full = torch.load(out / "model.pt", weights_only=True)
    assert state_digest(full) == result["model_digest"]
    assert full["head.weight"].shape == (5, 24)


def test_a_job_starts_from_a_plain_torchrun_dcp_checkpoint(mrun, tmp_path):
    saved = tmp_path / "torchrun-ckpt"
    plain(world=4, steps=10, save=str(saved))
    reference, digest = plain(world=4, steps=20, start=10, load=str(saved))
    spec = job(tmp_path, steps=20, checkpoint={"every_steps": 1, "init_from": str(saved)})
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    ran = losses_of(tmp_path / "out", 0, 4)
    assert sorted(ran) == list(range(10, 20))  # it went on from the checkpoint's step
    assert list(ran.values()) == reference[0]
    assert result["model_digest"] == digest
    # Another model's checkpoint: refused before training, naming the field; nothing
    # written where it came from.
    other = tmp_path / "other"
    plain(world=2, steps=2, save=str(other), dim=16)
    before = sorted(p.name for p in other.iterdir())
    bad = mrun({**job(tmp_path, steps=5), "checkpoint": {"init_from": str(other)}})
    assert bad["status"] == "failed"
    message = bad["error"]["message"]
    assert "checkpoint.init_from" in message and "not a checkpoint of this model" in message
    assert sorted(p.name for p in other.iterdir()) == before


def test_shrink_to_2_and_resume_at_3_reshard_with_the_right_loss(multinode, mrun, tmp_path):
    multinode.ensure_worker_nodes(2, exactly=True)
    uri = tmp_path / "durable"
    spec = job(
        tmp_path,
        steps=20,
        workers={"min": 2, "max": 4},
        failure={"max_restarts": 3, "replacement_timeout_s": 3},
        checkpoint={"every_steps": 1, "persist": {"uri": str(uri), "every_steps": 10}},
        chaos__faults=[{"kind": "kill_node", "rank": 0, "at_step": 7, "after_commit": True}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    assert [(r["from"], r["to"]) for r in result["resizes"]] == [(4, 2)]
    restored = result["failures"][0]["restored_step"]
    assert restored == 7
    gen = events_of(result, "generation")[-1]
    assert gen["restore_tiers"]  # from memory, not durable storage
    assert "durable" not in gen["restore_tiers"]
    # Plain torch: 4 ranks to step 7, then 2 ranks from there.
    first = tmp_path / "plain-7"
    plain(world=4, steps=7, save=str(first))
    after, _ = plain(world=2, steps=20, start=7, load=str(first))
    for rank in (0, 1):
        ran = losses_of(tmp_path / "out", rank, 2)
        assert sorted(ran) == list(range(7, 20))
        assert list(ran.values()) == after[rank]

    # The same job resumed at 3 ranks from its durable step 20, resharded from storage.
    multinode.ensure_worker_nodes(2)
    more = {**spec, "workers": 3, "steps": 26, "chaos": {"faults": []}}
    resumed = mrun(more)
    assert resumed["status"] == "succeeded", resumed["error"]
    [event] = [e for e in events_of(resumed, "resume") if e.get("step") is not None]
    assert event["step"] == 20
    step20 = uri / "dcp" / "step-000000000020"
    continued, digest = plain(world=3, steps=26, start=20, load=str(step20))
    for rank in range(3):
        ran = losses_of(tmp_path / "out", rank, 3)
        assert sorted(ran) == list(range(20, 26))
        assert list(ran.values()) == continued[rank]
    assert resumed["model_digest"] == digest
    assert WORKER_NODE_CPUS == 2  # 2 nodes of 2: a lost node leaves room for 2 ranks only


def test_an_hsdp_job_shrinks_to_a_multiple_of_its_shard_groups(multinode, mrun, tmp_path):
    # HSDP with shard groups of 2, one rank per node: a lost node leaves 3 ranks, one shard
    # group short; workers.multiple_of=2 lets one more go and the job goes on with 2, its
    # state resharded from memory from the (2, 2) mesh onto (1, 2).
    multinode.ensure_worker_nodes(4, exactly=True)
    spec = job(
        tmp_path,
        steps=14,
        workers={"min": 2, "max": 4, "multiple_of": 2},
        resources={"cpu": WORKER_NODE_CPUS},
        config={"shard": 2},
        failure={"max_restarts": 3, "replacement_timeout_s": 3},
        chaos__faults=[{"kind": "kill_node", "rank": 1, "at_step": 6, "after_commit": True}],
    )
    result = mrun(spec)
    assert result["status"] == "succeeded", result["error"]
    [resize] = result["resizes"]
    assert (resize["from"], resize["to"]) == (4, 2)
    assert "workers.multiple_of=2" in resize["reason"]
    first = tmp_path / "plain-6"
    cpus = spec["resources"]["cpu"]  # stalwart's torch threads per rank
    plain(world=4, shard=2, steps=6, save=str(first), threads=cpus)
    after, _ = plain(world=2, shard=2, steps=14, start=6, load=str(first), threads=cpus)
    for rank in (0, 1):
        ran = losses_of(tmp_path / "out", rank, 2)
        assert sorted(ran) == list(range(6, 14))
        assert list(ran.values()) == after[rank]
    multinode.ensure_worker_nodes(3)

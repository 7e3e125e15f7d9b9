"""`stalwart verify`: the job with and without a killed worker, compared object by object;
and the warning about a scheduler the loop did not register."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stalwart.orchestrator.driver import RunOptions, run_job
from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.verify import verify
from tests.component.conftest import REPO, events_of, small_spec, stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(600)]


# Two ranks: what a verify compares does not depend on the world's size (each rank more is
# a process importing torch, in each of a verify's two runs).
def _spec(register: bool) -> dict:
    return small_spec(
        name="verify",
        workers=2,
        entrypoint="tests.component.loops:scheduler_loop",
        steps=20,
        config={"register_scheduler": register},
    )


def test_verify_passes_a_loop_that_registers_everything(ray_address, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_spec(register=True)))
    got = stalwart_cli(
        "verify",
        str(path),
        "--set",
        f"entrypoint={REPO / 'tests/component/loops.py'}:scheduler_loop",
        "--kill-at",
        "9",
        "--run-dir",
        str(tmp_path / "v"),
        "-o",
        "json",
        address=ray_address,
        timeout=500,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    verdict = json.loads(got.stdout)
    assert verdict["identical"] is True and verdict["kill_at"] == 9 and verdict["rank"] == 1
    names = {d["name"] for d in verdict["objects"]["0"]}
    assert names == {"model", "optimizer", "scheduler"}
    assert verdict["runs"]["faulty"]["restarts"] == 1


def test_verify_names_what_an_unregistered_scheduler_changes(ray_address, tmp_path):
    spec = validate(_spec(register=False))

    def run(variant, out: Path):
        return run_job(
            variant,
            RunOptions(address=ray_address, output=out, base_dir=str(REPO), owns_cluster=True),
        )

    verdict = verify(spec, run, tmp_path / "v", kill_at=9)
    assert not verdict.identical
    model = next(d for d in verdict.diffs[0] if d.name == "model")
    assert not model.identical and model.path and "elements differ" in model.detail
    opt = next(d for d in verdict.diffs[0] if d.name == "optimizer")
    assert opt.path == "param_groups[0]/lr", opt  # the schedule started over
    assert any("LR scheduler (StepLR)" in w for w in verdict.warnings)
    # The job said so at its start, once, from rank 0.
    events = [
        json.loads(line)
        for line in (tmp_path / "v" / "clean" / "events.jsonl").read_text().splitlines()
    ]
    [warning] = events_of({"events": events}, "exactness_warning")
    assert "LR scheduler (StepLR)" in warning["reason"] and warning["rank"] == 0


def test_verify_compares_a_sharded_model_whole(ray_address, tmp_path):
    # FSDP2 on 2 ranks (examples/fsdp): each rank checkpoints its own DTensor shards; the
    # verify assembles model and optimizer from every rank's chunks and compares them whole.
    spec = validate(
        small_spec(
            name="verify-fsdp",
            workers=2,
            entrypoint="stalwart.examples.fsdp.train:train_loop",
            steps=12,
        )
    )

    def run(variant, out: Path):
        return run_job(
            variant,
            RunOptions(address=ray_address, output=out, base_dir=str(REPO), owns_cluster=True),
        )

    verdict = verify(spec, run, tmp_path / "v", kill_at=5, rank=1)
    assert verdict.error is None, verdict.error
    assert verdict.identical, [vars(d) for d in verdict.diffs[0]]
    assert {d.name for d in verdict.diffs[0]} == {"model", "optimizer"}
    clean = verdict.runs["clean"]["model_digest"]
    assert clean == verdict.runs["faulty"]["model_digest"]

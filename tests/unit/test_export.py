"""`stalwart checkpoint export` (ckpt/export.py, orchestrator/cli_checkpoint.py).

Each test writes a real durable checkpoint without Ray: a model, an AdamW optimizer and a
scheduler captured by SnapshotBuffer, written by DurableStore.write_shard for 2 ranks and
completed by write_manifest, as the node agents and the supervisor do.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

from stalwart.ckpt.durable import DurableStore, step_name
from stalwart.ckpt.export_formats import flatten, plain, strip_wrapper_prefix
from stalwart.ckpt.legacy_shard import shard_name
from stalwart.ckpt.snapshot import SnapshotBuffer
from stalwart.orchestrator.cli import main

pytestmark = pytest.mark.timeout(60)

JOB = "gpt"
WORLD = 2
STEPS = (10, 20)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return value


def _rank_model(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s model state as a DistributedDataParallel's (keys under `module.`);
    ranks differ (rank is added to the float tensors) so that --rank is visible."""
    return collections.OrderedDict(
        (f"module.{k}", v + rank if v.is_floating_point() else v)
        for k, v in model.state_dict().items()
    )


@pytest.fixture
def ckpt(tmp_path: Path):
    """(durable root, {(step, rank): the objects as written})."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    root = tmp_path / "durable"
    store = DurableStore(str(root), JOB, retries=0, backoff_s=0)
    written = {}
    buffers = [SnapshotBuffer() for _ in range(WORLD)]
    done = 0
    for step in STEPS:
        while done < step:
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            done += 1
        records = []
        for rank in range(WORLD):
            objects = {
                "model": _rank_model(model, rank),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
            }
            state = {"step": step, "objects": objects, "rng": {"torch": torch.get_rng_state()}}
            snap = buffers[rank].capture(step, state)
            records.append(store.write_shard(step, rank, snap))
            written[step, rank] = _clone(objects)
        store.write_manifest(step, WORLD, records)
    return root, written


def _export(*args: str):
    return CliRunner().invoke(main, ["checkpoint", "export", *args], catch_exceptions=False)


def _assert_model(loaded: dict, written: dict, ordered: bool = True) -> None:
    """`loaded` holds `written`'s tensors, bit for bit, under its keys without `module.`
    (in its order, but from safetensors, which stores tensors by dtype and size)."""
    expected = {k.removeprefix("module."): v for k, v in written.items()}
    assert (list(loaded) if ordered else sorted(loaded)) == (
        list(expected) if ordered else sorted(expected)
    )
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert torch.equal(loaded[key], tensor), key


def _assert_one_line_error(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    err = result.stderr
    assert "Traceback" not in err and "Traceback" not in result.stdout
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_torch_format_writes_each_object_loadable_with_weights_only(ckpt, tmp_path):
    root, written = ckpt
    out = tmp_path / "out"
    result = _export(str(root), str(out), "--format", "torch")
    assert result.exit_code == 0, result.stderr
    assert f"exported step 20 of job {JOB} (rank 0 of 2)" in result.stdout
    assert str(out / "model.pt") in result.stdout
    assert "prefix 'module.' stripped" in result.stdout

    model = torch.load(out / "model.pt", weights_only=True)
    _assert_model(model, written[20, 0]["model"])
    opt = torch.load(out / "optimizer.pt", weights_only=True)
    want = written[20, 0]["optimizer"]
    assert opt["param_groups"] == want["param_groups"]
    assert set(opt["state"]) == set(want["state"])
    for index, slots in want["state"].items():
        for slot, tensor in slots.items():
            assert torch.equal(opt["state"][index][slot], tensor), (index, slot)
    assert torch.load(out / "scheduler.pt", weights_only=True) == written[20, 0]["scheduler"]

    doc = json.loads((out / "manifest.json").read_text())
    assert doc["format"] == "torch"
    assert (doc["job"], doc["step"], doc["rank"], doc["world_size"]) == (JOB, 20, 0, 2)
    assert doc["files"] == ["model.pt", "optimizer.pt", "scheduler.pt"]
    assert doc["objects"]["model"]["stripped_prefix"] == "module."
    assert doc["objects"]["model"]["tensors"] == len(written[20, 0]["model"])
    assert doc["objects"]["optimizer"]["stripped_prefix"] is None
    assert sorted(os.listdir(out)) == ["manifest.json", "model.pt", "optimizer.pt", "scheduler.pt"]


def test_safetensors_format_flattens_nested_state_and_keeps_the_rest_as_metadata(ckpt, tmp_path):
    root, written = ckpt
    out = tmp_path / "out"
    result = _export(str(root / JOB), str(out), "--format", "safetensors")  # URI/JOB works too
    assert result.exit_code == 0, result.stderr
    _assert_model(
        safetensors.torch.load_file(out / "model.safetensors"),
        written[20, 0]["model"],
        ordered=False,
    )

    want = written[20, 0]["optimizer"]
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    assert set(tensors) == {f"state.{i}.{s}" for i, slots in want["state"].items() for s in slots}
    for index, slots in want["state"].items():
        for slot, tensor in slots.items():
            assert torch.equal(tensors[f"state.{index}.{slot}"], tensor)
    assert meta["format"] == "pt"
    groups = json.loads(meta["param_groups"])
    assert groups[0]["lr"] == want["param_groups"][0]["lr"]
    assert groups[0]["betas"] == list(want["param_groups"][0]["betas"])
    assert groups[0]["params"] == want["param_groups"][0]["params"]

    with safe_open(out / "scheduler.safetensors", "pt") as f:  # no tensors: all metadata
        assert list(f.keys()) == []
        assert json.loads(f.metadata()["last_epoch"]) == written[20, 0]["scheduler"]["last_epoch"]
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["format"] == "safetensors"
    assert doc["files"] == ["model.safetensors", "optimizer.safetensors", "scheduler.safetensors"]
    assert doc["objects"]["optimizer"]["metadata_values"] == 1


def test_step_and_rank_pick_an_older_step_and_another_ranks_shard(ckpt, tmp_path):
    root, written = ckpt
    out = tmp_path / "out"
    result = _export(str(root), str(out), "--format", "torch", "--step", "10", "--rank", "1")
    assert result.exit_code == 0, result.stderr
    _assert_model(torch.load(out / "model.pt", weights_only=True), written[10, 1]["model"])
    assert not torch.equal(
        written[10, 1]["model"]["module.0.weight"], written[20, 1]["model"]["module.0.weight"]
    )
    doc = json.loads((out / "manifest.json").read_text())
    assert (doc["step"], doc["rank"]) == (10, 1)


def test_a_run_dir_names_the_job_and_its_durable_uri(ckpt, tmp_path):
    root, written = ckpt
    run_dir = tmp_path / "runs" / "gpt-1"
    run_dir.mkdir(parents=True)
    uri = DurableStore(str(root), JOB).describe()  # what result.json's persist.uri holds
    result_json = {"name": JOB, "status": "succeeded", "persist": {"uri": uri, "persisted": [20]}}
    (run_dir / "result.json").write_text(json.dumps(result_json))
    (run_dir / "events.jsonl").write_text("")
    out = tmp_path / "out"
    result = _export(str(run_dir), str(out), "--format", "torch", "-o", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc == json.loads((out / "manifest.json").read_text())
    assert (doc["job"], doc["step"], doc["run_dir"]) == (JOB, 20, str(run_dir))
    _assert_model(torch.load(out / "model.pt", weights_only=True), written[20, 0]["model"])


def test_a_run_that_did_not_finish_is_found_by_its_persisted_events(ckpt, tmp_path):
    root, written = ckpt
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = DurableStore(str(root), JOB).describe()
    event = {"ts": 1.0, "type": "persisted", "step": 10, "uri": uri, "seq": 7}
    (run_dir / "events.jsonl").write_text('{"type": "state"}\n' + json.dumps(event) + "\n")
    result = _export(str(run_dir), str(tmp_path / "out"), "--format", "torch", "--step", "10")
    assert result.exit_code == 0, result.stderr
    got = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    _assert_model(got, written[10, 0]["model"])


def test_an_unknown_step_lists_the_steps_there(ckpt, tmp_path):
    root, _ = ckpt
    (root / JOB / step_name(30)).mkdir()  # a writer died: no manifest
    result = _export(str(root), str(tmp_path / "out"), "--format", "torch", "--step", "15")
    _assert_one_line_error(
        result, 2, "step 15 is not among", "steps there: 10, 20", "incomplete", "30"
    )
    assert not (tmp_path / "out").exists()


def test_a_run_without_a_durable_tier_says_to_set_persist_uri(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"name": "quickstart", "persist": None}))
    (run_dir / "events.jsonl").write_text("")
    result = _export(str(run_dir), str(tmp_path / "out"), "--format", "torch")
    _assert_one_line_error(
        result, 2, "result.json", "persist is null", "die with the job", "checkpoint.persist.uri"
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["{tmp}/nowhere", "{tmp}/out"], ["nowhere: no such file or directory"]),
        (["{root}", "{tmp}/out", "--rank", "5"], ["--rank 5", "written by 2 ranks (0..1)"]),
        (["{root}", "{root}"], ["not empty"]),
        (["{root}", "{tmp}/out", "--job", "other"], ["no checkpoints of job 'other'"]),
    ],
)
def test_bad_input_exits_2_with_one_line(ckpt, tmp_path, args, needles):
    root, _ = ckpt
    args = [a.format(tmp=tmp_path, root=root) for a in args]
    _assert_one_line_error(_export(*args, "--format", "torch"), 2, *needles)


def test_several_jobs_under_one_uri_need_the_job_name(ckpt, tmp_path):
    root, _ = ckpt
    (root / "other" / step_name(5)).mkdir(parents=True)
    result = _export(str(root), str(tmp_path / "out"), "--format", "torch")
    _assert_one_line_error(result, 2, "2 jobs (gpt, other)", "--job NAME")
    result = _export(str(root), str(tmp_path / "out"), "--format", "torch", "--job", JOB)
    assert result.exit_code == 0, result.stderr


def _corrupt(root: Path, step: int, rank: int) -> None:
    path = root / JOB / step_name(step) / shard_name(rank)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 tells
    path.write_bytes(bytes(data))


def test_a_corrupt_shard_exits_1_and_the_default_step_walks_back(ckpt, tmp_path):
    root, written = ckpt
    _corrupt(root, 20, 0)
    result = _export(str(root), str(tmp_path / "a"), "--format", "torch", "--step", "20")
    _assert_one_line_error(result, 1, "step 20", "rank 0's shard", "sha256 mismatch")

    result = _export(str(root), str(tmp_path / "b"), "--format", "torch")
    assert result.exit_code == 0, result.stderr
    assert "warning: skipped step 20" in result.stderr
    doc = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert doc["step"] == 10
    assert doc["skipped_steps"][0]["step"] == 20
    _assert_model(
        torch.load(tmp_path / "b" / "model.pt", weights_only=True), written[10, 0]["model"]
    )

    _corrupt(root, 10, 0)
    result = _export(str(root), str(tmp_path / "c"), "--format", "torch")
    _assert_one_line_error(result, 1, "reads back intact", "step 20", "step 10")


def test_the_export_loads_in_a_python_without_stalwart(ckpt, tmp_path):
    root, written = ckpt
    for fmt in ("torch", "safetensors"):
        result = _export(str(root), str(tmp_path / fmt), "--format", fmt)
        assert result.exit_code == 0, result.stderr
    script = (
        "import sys, torch, safetensors.torch\n"
        "a = torch.load(sys.argv[1], weights_only=True)\n"
        "b = safetensors.torch.load_file(sys.argv[2])\n"
        "o = torch.load(sys.argv[3], weights_only=True)\n"
        "assert all(torch.equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)\n"
        "assert sorted(o) == ['param_groups', 'state']\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'stalwart')\n"
        "assert not loaded, loaded\n"
        "print(' '.join(a))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tmp_path / "torch" / "model.pt"),
            str(tmp_path / "safetensors" / "model.safetensors"),
            str(tmp_path / "torch" / "optimizer.pt"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    want = [k.removeprefix("module.") for k in written[20, 0]["model"]]
    assert done.stdout.split() == want


def test_values_weights_only_refuses_are_converted_and_noted():
    notes: list[str] = []
    state = {
        "a": np.arange(3, dtype=np.int16),
        "n": np.float64(0.5),
        "q": collections.deque([1, 2]),
        "when": datetime.date(2026, 1, 2),
        "rng": np.random.RandomState(3),  # its state holds a numpy array too
        "t": torch.arange(6).view(2, 3).t(),  # not contiguous
        "s": torch.arange(10)[2:4],  # a view into a larger storage
    }
    out = plain(state, "extra", notes)
    assert torch.equal(out["a"], torch.tensor([0, 1, 2], dtype=torch.int16))
    assert type(out["n"]) is float and out["q"] == [1, 2] and out["when"] == "2026-01-02"
    assert out["t"].is_contiguous() and torch.equal(out["t"], state["t"])
    assert out["s"].untyped_storage().nbytes() == 2 * 8 and torch.equal(out["s"], state["s"])
    assert sorted(n.split(":")[0] for n in notes) == [
        "extra['a']",
        "extra['q']",
        "extra['rng']",
        "extra['rng']['state']['key']",
        "extra['when']",
    ]
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["rng"]["state"]["pos"] == 624
    tensors, meta = flatten(out)
    assert set(tensors) == {"a", "t", "s", "rng.state.key"} and json.loads(meta["q"]) == [1, 2]
    assert json.loads(meta["rng.state.pos"]) == 624


def test_only_a_prefix_every_key_shares_is_stripped():
    t = torch.zeros(1)
    assert strip_wrapper_prefix({"module._orig_mod.w": t, "module._orig_mod.b": t}) == (
        {"w": t, "b": t},
        "module._orig_mod.",
    )
    mixed = {"module.w": t, "head.b": t}
    assert strip_wrapper_prefix(mixed) == (mixed, None)
    assert strip_wrapper_prefix({"module.x": 1}) == ({"module.x": 1}, None)  # no tensors

"""FSDP2 and HSDP on stalwart's group, four real gloo processes on loopback: every
DeviceMesh dimension's group and every dist.new_group is one of stalwart's (abortable,
named the same in every generation), a snapshot keeps each rank's DTensor shards only and
restores them exactly into the model the next generation builds, the model digest is the
unsharded model's, and the divergence guard compares shards along the replicate dimension
only (worker/collective.py, ckpt/dtensor.py, ckpt/fsdp.py, worker/divergence.py)."""

from __future__ import annotations

import copy
import datetime
import json
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_torch_group import _blocked, _free_port

pytestmark = pytest.mark.timeout(180)

WORLD = 4


def _configure(group, store, rank: int, gen: int) -> None:
    group.configure(
        dist.PrefixStore(f"gen{gen}", store),
        rank,
        WORLD,
        gen,
        "gloo",
        torch.device("cpu"),
        "127.0.0.1",
        datetime.timedelta(seconds=60),
    )


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 3)  # 3 rows: uneven shards on 2 ranks

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _build(mesh):
    from torch.distributed.fsdp import fully_shard

    net = Net()
    plain = copy.deepcopy(net.state_dict())
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    return net, opt, plain


def _steps(net, opt, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = net(torch.randn(5, 6, generator=g)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _local(net) -> list[bytes]:
    return [p.to_local().detach().numpy().tobytes() for p in net.parameters()]


def _worker(rank: int, port: int, out_dir: str, out) -> None:
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from stalwart.ckpt import dtensor, reshard
        from stalwart.ckpt.dcp_format import shard_signature
        from stalwart.ckpt.durable import DurableStore
        from stalwart.ckpt.fsdp import ShardedModel, ShardedOptimizer, sharded_views
        from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, restore, state_digest
        from stalwart.orchestrator.worker.collective import ElasticGroup
        from stalwart.orchestrator.worker.divergence import DivergenceGuard, ReplicaDivergence
        from stalwart.orchestrator.worker.torch_group import AbortableProcessGroup

        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
        group = ElasticGroup()
        res: dict = {}
        _configure(group, store, rank, 1)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        res["mesh_groups"] = [
            (type(mesh.get_group(d)).__name__, mesh.get_group(d).group_name) for d in range(2)
        ]
        res["ours"] = all(isinstance(mesh.get_group(d), AbortableProcessGroup) for d in range(2))
        pair = dist.new_group([0, 1])
        res["new_group"] = (
            isinstance(pair, AbortableProcessGroup)
            if rank in (0, 1)
            else pair is dist.GroupMember.NON_GROUP_MEMBER
        )
        if rank in (0, 1):
            t = torch.ones(1) * (rank + 1)
            dist.all_reduce(t, group=pair)
            res["pair_sum"] = t.item()
        net, opt, plain = _build(mesh)
        views = sharded_views({"model": net, "optimizer": opt})
        assert isinstance(views["model"], ShardedModel)
        assert isinstance(views["optimizer"], ShardedOptimizer)
        # The digest of the sharded model is the unsharded model's.
        res["digest_is_unsharded"] = state_digest(views["model"].state_dict()) == state_digest(
            plain
        )
        _steps(net, opt, rank, range(3))
        state = {name: v.state_dict() for name, v in views.items()}
        res["optimizer_keys"] = sorted(state["optimizer"]["state"])
        saved_full = {
            k: v.full_tensor().numpy().tobytes() for k, v in views["model"].state_dict().items()
        }
        # As ctx snapshots it (context._state); the allow-list check runs here.
        snap = SnapshotBuffer().capture(3, {"step": 3, "objects": state})
        res["sig"] = shard_signature(bytes(snap.skeleton))
        # The step as a DCP checkpoint: every rank writes its file, rank 0 the index.
        durable = DurableStore(out_dir, "job")
        write = durable.write_rank(
            3, rank, Snapshot(3, snap.skeleton, snap.metas, snap.payload.clone().numpy())
        )
        store.set(f"write{rank}", json.dumps(write))
        writes = [json.loads(store.get(f"write{r}")) for r in range(WORLD)]
        if rank == 0:
            durable.write_manifest(3, WORLD, writes=writes)
            store.set("manifest", "1")
        store.wait(["manifest"])
        manifest = durable.verify(3, WORLD)
        res["sharded_manifest"] = manifest.sharded
        res["read_back"] = durable.read_shard(3, rank, manifest).digest() == snap.digest()
        res["files"] = sorted(w["record"]["file"] for w in writes)
        full_bytes = sum(t.numel() * t.element_size() for t in plain.values())
        # Parameters and AdamW's two moments: a shard group of 2 keeps about half of each.
        res["shard_fraction"] = sum(m.nbytes for m in snap.metas) / (3 * full_bytes)
        # The GPU path (ckpt/device_copy.py) on the fake CUDA of tests/unit/test_device_copy:
        # the DTensors' local shards copied on a side stream, the next step fenced off them.
        from stalwart.ckpt.device_copy import AsyncCapture
        from tests.unit.test_device_copy import FakeCuda

        cap = AsyncCapture(FakeCuda())
        cap.guard(opt)
        pending = cap.capture(3, {"step": 3, "objects": state})
        _steps(net, opt, rank, range(3, 4))  # the next step: after the copy, on the device
        res["device_copy"] = pending.wait().digest() == snap.digest()
        res["device_cloned"] = cap.stats.cloned_bytes  # guarded shards are not cloned
        _steps(net, opt, rank, range(4, 6))
        res["straight"] = _local(net)
        res["straight_digest"] = state_digest(views["model"].state_dict())
        # Divergence: equal along the replicate dimension; then rank 0 drifts.
        guard = DivergenceGuard(1, lambda t, op, g: _reduce(t, op, g))
        guard.check(6, {"model": net}, torch.device("cpu"))
        if rank == 0:
            with torch.no_grad():
                next(net.parameters()).to_local().view(-1)[0] += 1.0
        try:
            guard.check(7, {"model": net}, torch.device("cpu"))
            res["diverged"] = None
        except ReplicaDivergence as e:
            res["diverged"] = str(e)
        old_pair = pair

        # Generation 2: a recovery; the loop builds mesh, model and optimizer again.
        _configure(group, store, rank, 2)
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        res["names_again"] = [mesh2.get_group(d).group_name for d in range(2)]
        net2, opt2, _ = _build(mesh2)
        views2 = sharded_views({"model": net2, "optimizer": opt2})
        back = restore(snap, "cpu", dtensor.rebuilder(dtensor.meshes_of([net2, opt2])))
        for name, view in views2.items():
            view.load_state_dict(back["objects"][name])
        _steps(net2, opt2, rank, range(3, 6))
        res["resumed"] = _local(net2)
        res["resumed_digest"] = state_digest(views2["model"].state_dict())
        try:
            if rank in (0, 1):
                dist.all_reduce(torch.ones(1), group=old_pair)
            res["stale"] = None
        except Exception as e:
            res["stale"] = f"{type(e).__name__}: {e}"
        # Another layout: refused, naming both.
        flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
        net3, opt3, _ = _build(flat)
        try:
            restore(snap, "cpu", dtensor.rebuilder(dtensor.meshes_of([net3, opt3])))
            res["other_mesh"] = None
        except dtensor.MeshChanged as e:
            res["other_mesh"] = str(e)
        # ... and loaded resharded from the durable step: the full tensors are the same.
        views3 = sharded_views({"model": net3, "optimizer": opt3})
        reshard.load(views3, ["model", "optimizer"], durable.reader(3, manifest), "step 3")
        res["resharded"] = {
            k: v.full_tensor().numpy().tobytes() for k, v in views3["model"].state_dict().items()
        }
        res["saved_full"] = saved_full

        # Generation 3: rank 2 never joins its replicate group's all-reduce (with rank 0).
        _configure(group, store, rank, 3)
        mesh3 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if rank == 0:
            sub = mesh3.get_group("replicate")
            res["blocked"] = _blocked(lambda: dist.all_reduce(torch.ones(4), group=sub), group)
        store.set(f"done{rank}", "1")
        store.wait([f"done{r}" for r in range(WORLD)])
        out.put((rank, "ok", res))
    except Exception:
        out.put((rank, "error", traceback.format_exc()))


def _reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, ops[op], group=group)
    return t


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    out_dir = str(tmp_path_factory.mktemp("durable"))
    procs = [ctx.Process(target=_worker, args=(r, port, out_dir, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=150) for _ in range(WORLD)), key=lambda g: g[0])
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, status, detail in got:
        assert status == "ok", f"rank {rank}:\n{detail}"
    return [g[2] for g in got]


def test_every_mesh_dimension_and_new_group_is_stalwarts_with_stable_names(ranks):
    for res in ranks:
        assert res["ours"] and res["new_group"], res["mesh_groups"]
        names = [name for _, name in res["mesh_groups"]]
        assert all(n.startswith("stalwart-") for n in names), names
        assert res["names_again"] == names  # the same group, the same name next generation
    assert ranks[0]["pair_sum"] == ranks[1]["pair_sum"] == 3.0
    # Ranks 0 and 2 share a replicate group; 0 and 1 a shard group.
    assert ranks[0]["mesh_groups"][0] == ranks[2]["mesh_groups"][0]
    assert ranks[0]["mesh_groups"][1] == ranks[1]["mesh_groups"][1]
    assert ranks[0]["mesh_groups"][0] != ranks[1]["mesh_groups"][0]


def test_snapshot_keeps_local_shards_and_restores_them_exactly(ranks):
    for res in ranks:
        assert 0.4 < res["shard_fraction"] < 0.7, res["shard_fraction"]  # local shards only
        assert res["resumed"] == res["straight"]
        assert res["optimizer_keys"][:2] == ["blocks.0.bias", "blocks.0.weight"]
    # HSDP: the replicate dimension's ranks hold the same shards.
    assert ranks[0]["straight"] == ranks[2]["straight"]
    assert ranks[0]["straight"] != ranks[1]["straight"]


def test_the_digest_is_the_unsharded_models_and_the_same_on_every_rank(ranks):
    assert all(res["digest_is_unsharded"] for res in ranks)
    digests = {res["straight_digest"] for res in ranks} | {res["resumed_digest"] for res in ranks}
    assert len(digests) == 1


def test_divergence_is_checked_along_the_replicate_dimension_only(ranks):
    # Rank 0 changed its shard: its replicate peer (rank 2) sees it too; 1 and 3 do not.
    for rank in (0, 2):
        assert "blocks.0.weight" in (ranks[rank]["diverged"] or ""), ranks[rank]["diverged"]
    assert ranks[1]["diverged"] is None and ranks[3]["diverged"] is None


def test_a_kept_group_of_an_earlier_generation_is_refused_with_what_to_do(ranks):
    for rank in (0, 1):
        stale = ranks[rank]["stale"] or ""
        assert stale.startswith("StaleGroup") and "inside train_loop" in stale, stale


def test_a_snapshot_of_another_mesh_layout_is_refused_naming_both(ranks):
    text = ranks[0]["other_mesh"] or ""
    assert "replicate=2, shard=2" in text and "shard=4" in text, text


def test_a_subgroup_collective_a_peer_never_joins_is_released_by_the_abort(ranks):
    raised, after_s, was_pending = ranks[0]["blocked"]
    assert was_pending
    assert "a peer died" in raised, raised
    assert after_s < 30, after_s  # the abort, not gloo's 60 s timeout


def test_replicas_of_the_same_shard_have_the_same_signature(ranks):
    sigs = [res["sig"] for res in ranks]
    assert None not in sigs
    assert sigs[0] == sigs[2] and sigs[1] == sigs[3] and sigs[0] != sigs[1]


def test_an_hsdp_step_is_a_dcp_checkpoint_each_rank_reads_back_exactly(ranks):
    for res in ranks:
        assert res["files"] == [f"__{r}_0.distcp" for r in range(WORLD)]
        assert res["sharded_manifest"] is True
        assert res["read_back"]  # replicas' chunks written once, found in the other's file


def test_an_hsdp_step_loads_resharded_onto_another_mesh(ranks):
    for res in ranks:
        assert res["resharded"] == res["saved_full"]


def test_the_gpu_path_copies_dtensor_shards_and_fences_the_next_step(ranks):
    for res in ranks:
        assert res["device_copy"] is True
        assert res["device_cloned"] == 0

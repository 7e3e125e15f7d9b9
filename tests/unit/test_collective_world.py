"""Each generation's group is torch.distributed's default group, so ZeroRedundancyOptimizer
runs on it, and its rank shard checkpoints and restores (ckpt/sharded.py). Two real gloo
processes on loopback; a second generation replaces the first's group."""

from __future__ import annotations

import datetime
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer

from stalwart.ckpt.sharded import RankShard, ShardMismatch, rank_local_view
from stalwart.orchestrator.worker.collective import ElasticGroup, forget_group, solo_group

pytestmark = pytest.mark.timeout(120)

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _train(opt: ZeroRedundancyOptimizer, model: torch.nn.Module, rank: int, steps: range):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # average gradients as DDP would
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)
        opt.step()


def _bytes(model: torch.nn.Module) -> list[bytes]:
    # Plain bytes through the queue: torch tensors would travel as shared-memory handles
    # that die with this process.
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def _worker(rank: int, port: int, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
        group = ElasticGroup()
        results = {}
        for gen in (1, 2):
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
            pg = group.process_group
            assert dist.is_initialized() and dist.group.WORLD is pg
            assert (dist.get_rank(), dist.get_world_size()) == (rank, WORLD)
            model = _model()
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, process_group=pg, lr=0.01
            )
            shard = rank_local_view(opt)
            assert isinstance(shard, RankShard)
            if gen == 2:
                # A recovery: restore this rank's own shard and the model, then go on.
                model.load_state_dict(results["model_at_3"])
                shard.load_state_dict(results["shard_at_3"])
                _train(opt, model, rank, range(3, 6))
                results["resumed"] = _bytes(model)
            else:
                _train(opt, model, rank, range(3))
                results["model_at_3"] = {k: v.clone() for k, v in model.state_dict().items()}
                sd = shard.state_dict()
                results["shard_at_3"] = {
                    "partition": sd["partition"],
                    "local": {
                        "state": {
                            i: {k: v.clone() for k, v in s.items()}
                            for i, s in sd["local"]["state"].items()
                        },
                        "param_groups": sd["local"]["param_groups"],
                    },
                }
                _train(opt, model, rank, range(3, 6))
                results["straight"] = _bytes(model)
        partition = results["shard_at_3"]["partition"]
        out.put((rank, "ok", partition, results["straight"], results["resumed"]))
    except Exception:
        out.put((rank, "error", traceback.format_exc(), None, None))


def test_zero_runs_on_each_generation_and_its_shards_restore_exactly():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=90) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, status, detail, _, _ in got:
        assert status == "ok", f"rank {rank}:\n{detail}"
    (_, _, part0, straight0, resumed0), (_, _, part1, straight1, resumed1) = got
    # Ranks hold different shards: each has its own partition of the parameters.
    assert (part0["rank"], part1["rank"]) == (0, 1)
    assert part0["world_size"] == part1["world_size"] == WORLD
    assert sum(part0["numels"]) + sum(part1["numels"]) == sum(
        p.numel() for p in _model().parameters()
    )
    assert part0["numels"] and part1["numels"] and part0["numels"] != part1["numels"]
    # Every rank ends with the same full model; restored shards continue bit-exactly.
    for a, b, c, d in zip(straight0, straight1, resumed0, resumed1, strict=True):
        assert a == b == c == d


def test_a_shard_refuses_another_rank_world_or_partition():
    solo_group()  # a one-rank default group, as a one-worker job gets it
    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    shard = RankShard(opt)
    good = shard.state_dict()
    assert good["partition"] == {"rank": 0, "world_size": 1, "numels": [128, 64, 16, 4]}
    shard.load_state_dict(good)
    other_rank = {**good, "partition": {**good["partition"], "rank": 1, "world_size": 2}}
    with pytest.raises(ShardMismatch, match=r"rank 1 of 2 offered to rank 0 of 1: .* reshard"):
        shard.load_state_dict(other_rank)
    other_model = {**good, "partition": {**good["partition"], "numels": [1, 2]}}
    with pytest.raises(ShardMismatch, match=r"sizes \[1, 2\] \(2 tensors\)"):
        shard.load_state_dict(other_model)
    with pytest.raises(ShardMismatch, match="not a rank's shard"):
        shard.load_state_dict(opt.optim.state_dict())


def test_restored_hyperparameters_reach_the_wrapper():
    solo_group()
    opt = ZeroRedundancyOptimizer(_model().parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    shard = RankShard(opt)
    opt.param_groups[0]["lr"] = 0.02  # a scheduler's change, then a checkpoint
    opt.step()  # copies the wrapper's lr down to the local optimizer
    saved = shard.state_dict()
    opt.param_groups[0]["lr"] = 0.5
    shard.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == opt.optim.param_groups[0]["lr"] == 0.02


def test_plain_objects_are_registered_as_they_are():
    m = _model()
    assert rank_local_view(m) is m


def test_forget_group_leaves_torch_uninitialized():
    pg = solo_group()
    assert dist.group.WORLD is pg
    forget_group(pg)
    try:
        assert not dist.is_initialized()
    finally:
        from stalwart.orchestrator.worker import collective

        collective._solo = None  # the next solo_group() installs a fresh one

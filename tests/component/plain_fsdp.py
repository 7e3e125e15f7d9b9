"""An FSDP2 job in two forms, for comparing stalwart with plain torch: `train_loop(ctx)` under
stalwart, and `main` (torch.multiprocessing, gloo, torch's own process groups) without it.
This module imports nothing of stalwart: the plain runs must not use it (the tests check).

Both train the same model on the same data, a function of (step, rank) only, with no
dropout (nothing random after the initialization), and record each rank's loss per step.
The plain form can start from a DCP checkpoint, save one (dcp.save of get_state_dict, as a
torchrun script does) and load any (dcp.load into get_state_dict's targets)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

DIM, LAYERS, BATCH = 24, 3, 6


class Net(torch.nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(LAYERS))
        self.head = torch.nn.Linear(dim, 5)  # 5 rows: uneven shards at 2, 3 and 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def build(world: int, device_type: str = "cpu", dim: int = DIM, shard: int | None = None):
    """FSDP2 over all ranks, or HSDP with `shard` ranks per shard group (the replicate
    dimension is whatever the world makes of it, as torchtitan's dp_replicate)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if shard is not None and shard < world:
        mesh = init_device_mesh(
            device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    net = Net(dim)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    return net, opt


def batch(step: int, rank: int, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(BATCH, dim, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def one_step(net, opt, step: int, rank: int) -> float:
    x, y = batch(step, rank, net.head.in_features)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def digest(net) -> str:
    """sha256 of the full model in sorted key order (name, dtype, shape, bytes): what
    stalwart's model digest is for a sharded model."""
    h = hashlib.sha256()
    sd = net.state_dict()
    for name in sorted(sd):
        t = sd[name].full_tensor().detach().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_loop(ctx) -> None:
    """The job under stalwart: each rank appends (generation, world, step, loss) to
    OUTPUT/loss-rank<R>.jsonl."""
    net, opt = build(ctx.world_size, ctx.device.type, shard=ctx.config.get("shard"))
    ctx.register(model=net, optimizer=opt)
    path = os.path.join(ctx.output_dir, f"loss-rank{ctx.rank}.jsonl")
    for step in ctx.steps():
        loss = one_step(net, opt, step, ctx.rank)
        ctx.report(loss=loss)
        with open(path, "a") as f:
            f.write(json.dumps([ctx.generation, ctx.world_size, step, loss]) + "\n")


def _rank(rank: int, world: int, port: int, args: dict, out) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # As many torch threads per rank as stalwart's workers have (resources.cpu): how a CPU
    # kernel splits its work (its summation order) depends on the thread count, and on an
    # AMD EPYC here two threads gave losses 1e-7 apart from one thread's.
    torch.set_num_threads(args["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net, opt = build(world, dim=args["dim"], shard=args["shard"])
    start = 0
    if args.get("load"):
        state = {
            "model": get_model_state_dict(net),
            "optimizer": get_optimizer_state_dict(net, opt),
        }
        dcp.load(state, checkpoint_id=args["load"])
        set_model_state_dict(net, state["model"])
        set_optimizer_state_dict(net, opt, state["optimizer"])
        start = args["start"]
    losses = [one_step(net, opt, step, rank) for step in range(start, args["steps"])]
    if args.get("save"):
        state = {
            "model": get_model_state_dict(net),
            "optimizer": get_optimizer_state_dict(net, opt),
            "step": args["steps"],
        }
        dcp.save(state, checkpoint_id=args["save"])
    final = digest(net)
    imported = any(m == "stalwart" or m.startswith("stalwart.") for m in sys.modules)
    out.put((rank, losses, final, imported))
    dist.destroy_process_group()


def main(
    world: int,
    steps: int,
    start: int = 0,
    load: str | None = None,
    save: str | None = None,
    dim: int = DIM,
    shard: int | None = None,
    threads: int = 1,
):
    """The plain job: `world` processes train steps `start`..`steps`-1 (from the DCP
    checkpoint `load` when given; save one to `save`), `threads` torch threads each (the
    stalwart job's resources.cpu). Returns {rank: losses}, the final digest, and whether
    any process had stalwart imported."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = {
        "steps": steps,
        "start": start,
        "load": load,
        "save": save,
        "dim": dim,
        "shard": shard,
        "threads": threads,
    }
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=240) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    losses = {r: ls for r, ls, _, _ in got}
    digests = {d for _, _, d, _ in got}
    assert len(digests) == 1, digests
    return losses, digests.pop(), any(imported for *_, imported in got)


if __name__ == "__main__":
    print(json.dumps(main(**json.loads(sys.argv[1]))))

"""The quickstart's GPT sharded with FSDP2: ``fully_shard`` on every block and on the root.

With ``config.shard: S`` (S < the world size) it is HSDP, the way torchtitan lays it out:
a 2-D mesh (replicate=world/S, shard=S), parameters sharded within each group of S ranks
and replicated across the groups; the replicate dimension is whatever the world makes of
it, so an elastic job (``workers: {min, max, multiple_of: S}``) keeps its shard groups.
Every rank reads its own data either way (data parallel over all ranks).

The mesh and the model are built inside train_loop: a recovery calls it again with the new
generation's process groups, and restores the registered state into what it builds."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stalwart.examples.gpt.model import GPT, GPTConfig, loss_fn, synthetic_batch


def train_loop(ctx) -> None:
    cfg = GPTConfig(**ctx.config.get("model", {}))
    batch = int(ctx.config.get("batch_size", 16))
    lr = float(ctx.config.get("lr", 3e-3))

    shard = int(ctx.config.get("shard", ctx.world_size))
    if shard < ctx.world_size:  # HSDP
        shape, names = (ctx.world_size // shard, shard), ("replicate", "shard")
    else:
        shape, names = (ctx.world_size,), ("shard",)
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    model = GPT(cfg).to(ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ctx.register(model=model, optimizer=optimizer)

    for step in ctx.steps():
        inputs, targets = synthetic_batch(step, ctx.rank, batch, cfg, ctx.seed, ctx.device)
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.report(loss=loss.item(), samples=batch, tokens=batch * cfg.seq_len)

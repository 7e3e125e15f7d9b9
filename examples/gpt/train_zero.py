"""The quickstart's GPT with a sharded optimizer: ZeRO stage 1 over the job's process group.

Each rank keeps AdamW's moments for its partition of the parameters only
(torch.distributed.optim.ZeroRedundancyOptimizer), so ranks checkpoint different state: a
recovered rank k restores exactly rank k's shard from its own node, a peer's memory or
storage. Gradients are averaged by prepare_model's DDP as usual; after each step every rank
broadcasts the parameters it updated.

Run it with `--set entrypoint=stalwart.examples.gpt.train_zero:train_loop`. Keep `workers` fixed:
stalwart does not reshard optimizer state across world sizes.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from stalwart.examples.gpt.model import GPT, GPTConfig, loss_fn, synthetic_batch


def train_loop(ctx) -> None:
    cfg = GPTConfig(**ctx.config.get("model", {}))
    batch = int(ctx.config.get("batch_size", 16))
    lr = float(ctx.config.get("lr", 3e-3))

    model = ctx.prepare_model(GPT(cfg))
    # Built inside the loop: a recovery calls train_loop again with the new generation's group.
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        process_group=ctx.process_group,
        lr=lr,
        weight_decay=0.01,
    )
    ctx.register(model=model, optimizer=optimizer)  # the optimizer: this rank's shard only

    for step in ctx.steps():
        inputs, targets = synthetic_batch(step, ctx.rank, batch, cfg, ctx.seed, ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        optimizer.step()
        ctx.report(loss=loss.item(), samples=batch, tokens=batch * cfg.seq_len)

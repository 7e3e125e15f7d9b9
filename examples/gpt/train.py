"""The quickstart's train loop: a small GPT on synthetic data, data-parallel over the ranks."""

from __future__ import annotations

import torch

from stalwart.examples.gpt.model import GPT, GPTConfig, loss_fn, synthetic_batch


def train_loop(ctx) -> None:
    cfg = GPTConfig(**ctx.config.get("model", {}))
    batch = int(ctx.config.get("batch_size", 16))
    lr = float(ctx.config.get("lr", 3e-3))

    model = ctx.prepare_model(GPT(cfg))  # DDP whose all-reduce survives recoveries
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ctx.register(model=model, optimizer=optimizer)  # what is checkpointed (+ RNG, step)

    for step in ctx.steps():  # starts after the last committed step
        inputs, targets = synthetic_batch(step, ctx.rank, batch, cfg, ctx.seed, ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        optimizer.step()
        ctx.report(loss=loss.item(), samples=batch, tokens=batch * cfg.seq_len)
        if step % 50 == 0:  # shows live (rank 0's) and lands in RUN_DIR/logs/rank-R.log
            print(f"step {step}: loss {loss.item():.4f}")

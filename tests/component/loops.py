"""Train loops used by the tests to misbehave on purpose."""

from __future__ import annotations

from stalwart.examples.gpt.train import train_loop as gpt_loop


class DataCorrupted(ValueError):
    pass


def raising_loop(ctx) -> None:
    """The GPT loop, except that rank `raise_rank` raises at step `raise_at`."""
    raise_at = ctx.config["raise_at"]
    raise_rank = ctx.config["raise_rank"]
    original = ctx.report

    def report(**metrics):
        original(**metrics)
        if ctx.rank == raise_rank and ctx.progress.step + 1 == raise_at:
            raise DataCorrupted(f"bad record in shard {ctx.rank} at step {raise_at}")

    ctx.report = report
    gpt_loop(ctx)


not_callable = 42


def slow_step_loop(ctx) -> None:
    """The GPT loop, except that rank `slow_rank` spends `slow_s` seconds outside any
    collective after step `slow_at` (a long data load, say), in the first generation only."""
    import time

    original = ctx.report

    def report(**metrics):
        original(**metrics)
        if (
            ctx.rank == ctx.config["slow_rank"]
            and ctx.progress.step + 1 == ctx.config["slow_at"]
            and ctx.generation == 1
        ):
            time.sleep(ctx.config["slow_s"])  # the workload: a step that takes this long

    ctx.report = report
    gpt_loop(ctx)


class _LockedSampler:
    """A sampler-like object whose state_dict() holds what no checkpoint can keep."""

    def __init__(self) -> None:
        import threading

        self.epoch = 0
        self._lock = threading.Lock()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "lock": self._lock}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


def unsafe_state_loop(ctx) -> None:
    """The GPT loop with an object registered whose state cannot be checkpointed."""
    ctx.register(sampler=_LockedSampler())
    gpt_loop(ctx)


def diverging_loop(ctx) -> None:
    """The GPT loop, except that rank `diverge_rank` nudges one parameter outside DDP after
    step `diverge_at` (a rank-dependent update), in the first generation only."""
    import torch

    original = ctx.report

    def report(**metrics):
        original(**metrics)
        if (
            ctx.rank == ctx.config["diverge_rank"]
            and ctx.progress.step + 1 == ctx.config["diverge_at"]
        ):
            model = ctx._objects["model"]
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)

    ctx.report = report
    gpt_loop(ctx)


def _cnn_loop(ctx, scheduler: str | None, **ddp_kwargs) -> None:
    """The converted DDP example's CNN under ctx.prepare_model, each rank on its own data;
    `scheduler`: None, "registered" or "unregistered" (a StepLR the loop forgets)."""
    import torch
    import torch.nn.functional as F

    from stalwart.examples.ddp.train import Net, dataset

    data = dataset()
    model = ctx.prepare_model(Net(), **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = None
    if scheduler is not None:
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    if scheduler == "registered":
        ctx.register(model=model, optimizer=optimizer, scheduler=sched)
    else:
        ctx.register(model=model, optimizer=optimizer)
    for step in ctx.steps():
        lo = (step * ctx.world_size + ctx.rank) * 8 % len(data)
        images, labels = data[lo : lo + 8]
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if sched is not None:
            sched.step()
        ctx.report(loss=loss.item(), samples=8)


def batchnorm_loop(ctx) -> None:
    """The CNN (BatchNorm) with DDP's broadcast_buffers, as in DDP."""
    _cnn_loop(ctx, scheduler=None, broadcast_buffers=True)


def scheduler_loop(ctx) -> None:
    """The CNN with a step LR schedule; `register_scheduler: false` forgets to register
    the scheduler (its schedule then starts over after a recovery)."""
    registered = ctx.config.get("register_scheduler", True)
    _cnn_loop(ctx, scheduler="registered" if registered else "unregistered")


def nan_loss_loop(ctx) -> None:
    """The GPT loop, except that rank `nan_rank` reports a NaN loss at step `nan_step`,
    every time it runs that step (a bad batch: deterministic, as a replay is)."""
    original = ctx.report

    def report(**metrics):
        if ctx.rank == ctx.config["nan_rank"] and ctx.progress.step == ctx.config["nan_step"]:
            metrics["loss"] = float("nan")
        original(**metrics)

    ctx.report = report
    gpt_loop(ctx)

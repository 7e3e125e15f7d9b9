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


def held_loop(ctx) -> None:
    """The GPT loop, except that in the first generation every rank waits before step
    `hold_at` until the file `release` exists (at most 120 s): a test sees the job running
    for as long as it needs, however slow its polls are."""
    import os
    import time

    original = ctx.report

    def report(**metrics):
        original(**metrics)
        if ctx.progress.step + 1 == ctx.config["hold_at"] and ctx.generation == 1:
            deadline = time.monotonic() + 120
            while not os.path.exists(ctx.config["release"]) and time.monotonic() < deadline:
                time.sleep(0.05)

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


def waits_for_standbys_loop(ctx) -> None:
    """The GPT loop, except that rank 0, on reaching a step of `standbys_at`, waits (at most
    120 s) until the job's event log shows a ready standby on every node holding ranks: a
    fault after it finds them. A job without standbys (its failure-free baseline, lean)
    waits for none."""
    import json
    import time
    from pathlib import Path

    events = Path(ctx.output_dir).parent / "events.jsonl"
    waits = set(ctx.config["standbys_at"])
    original = ctx.report

    def every_node_has_one() -> bool:
        node_of: dict[str, str] = {}  # rank -> node
        ready: dict[str, int] = {}  # node -> standbys ready there
        for e in (json.loads(line) for line in events.read_text().splitlines() if line):
            if e["type"] == "scheduled":
                node_of = {r: w["node_id"] for r, w in e["workers"].items()}
            elif e["type"] == "standby_ready":
                ready[e["node"]] = ready.get(e["node"], 0) + 1
            elif e["type"] == "replaced":
                for r, how in e["ranks"].items():
                    node_of[r] = how["node"]
                    if how["via"] == "standby":
                        ready[how["node"]] -= 1
        return bool(node_of) and all(ready.get(n, 0) > 0 for n in node_of.values())

    def planned() -> bool:
        for e in (json.loads(line) for line in events.read_text().splitlines() if line):
            if e["type"] == "standby_plan":
                return bool(e["enabled"])
        return True

    def report(**metrics):
        original(**metrics)
        if ctx.rank == 0 and ctx.progress.step in waits and planned():
            deadline = time.monotonic() + 120
            while not every_node_has_one():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no standby on every node by step {ctx.progress.step}")
                time.sleep(0.2)  # polling the event log for a condition, with a deadline

    ctx.report = report
    gpt_loop(ctx)

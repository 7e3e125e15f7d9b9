"""A Ray Train v2 script converted to stalwart (docs/migrating.md, "From Ray Train v2").

The original: a ``train_func`` run by ``TorchTrainer`` on 4 workers, restarted from its last
reported checkpoint up to 3 times. It saves and loads its own checkpoint, and a restart
begins the epoch again (Ray Train keeps no data position)::

    import os
    import tempfile

    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from torch.utils.data import DataLoader

    from stalwart.examples.ddp.train import Net, dataset  # the model and data


    def train_func(config):
        model = ray.train.torch.prepare_model(Net(dropout=config["dropout"]))
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        loader = DataLoader(dataset(), batch_size=config["batch_size"], shuffle=True,
                            drop_last=True)
        loader = ray.train.torch.prepare_data_loader(loader)  # a DistributedSampler, to device

        step = 0
        checkpoint = ray.train.get_checkpoint()  # None on the first attempt
        if checkpoint:
            with checkpoint.as_directory() as d:
                state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step = state["step"]

        rank = ray.train.get_context().get_world_rank()
        while step < config["steps"]:
            loader.sampler.set_epoch(step // len(loader))
            for images, labels in loader:  # after a restore: the epoch from its start
                model.train()
                loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                scheduler.step()
                step += 1
                metrics = {"loss": loss.item(), "step": step}
                with tempfile.TemporaryDirectory() as tmp:
                    checkpoint = None
                    if rank == 0 and step % config["checkpoint_every"] == 0:
                        torch.save({"model": model.module.state_dict(),
                                    "optimizer": optimizer.state_dict(),
                                    "scheduler": scheduler.state_dict(), "step": step},
                                   os.path.join(tmp, "state.pt"))
                        checkpoint = Checkpoint.from_directory(tmp)
                    ray.train.report(metrics, checkpoint=checkpoint)  # every rank reports
                if step == config["steps"]:
                    break


    trainer = TorchTrainer(
        train_func,
        train_loop_config={"batch_size": 16, "lr": 0.05, "dropout": 0.1, "steps": 60,
                           "checkpoint_every": 10},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="raytrain",
            storage_path="s3://bucket/ray-results",
            failure_config=FailureConfig(max_failures=3),
        ),
    )
    result = trainer.fit()

Converted (below, run by ``stalwart run examples/raytrain/job.yaml``): ``TorchTrainer``'s
configs become the job spec (examples/raytrain/job.yaml), ``train_loop_config`` its
``config``; the model is wrapped by ``ctx.prepare_model``; the checkpoint code is gone:
``ctx.register`` names what a checkpoint holds and ``ctx.steps()`` snapshots it (every
``checkpoint.every_steps``) and restores it, the data position (``stalwart.Epochs``) and
the RNG states included, so a recovery resumes at the next batch and ends with the
failure-free model. Lines particular to stalwart are marked ``# stalwart:``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import stalwart
from stalwart.examples.ddp.train import Net, dataset


def train_loop(ctx) -> None:  # stalwart: was train_func(config); ctx.config is the config
    cfg = ctx.config
    model = ctx.prepare_model(Net(dropout=float(cfg.get("dropout", 0.1))))  # stalwart
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg.get("lr", 0.05)), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    # stalwart: was prepare_data_loader(); the sampler it added, built here.
    data = dataset()
    sampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0
    )
    loader = DataLoader(
        data,
        batch_size=int(cfg.get("batch_size", 16)),
        sampler=sampler,
        drop_last=True,
    )
    batches = stalwart.Epochs(loader, sampler)  # stalwart: set_epoch, and the position in it

    # stalwart: replaces get_checkpoint()/Checkpoint/report(checkpoint=...): every rank's
    # state is snapshotted, restored by ctx.steps()
    ctx.register(model=model, optimizer=optimizer, scheduler=scheduler, data=batches)

    for step in ctx.steps():  # stalwart: resumes after the last committed step
        images, labels = next(batches)
        images, labels = images.to(ctx.device), labels.to(ctx.device)  # prepare_data_loader's
        model.train()
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        ctx.report(loss=loss.item(), samples=len(labels))  # stalwart: was ray.train.report
        if ctx.rank == 0 and step % 20 == 0:  # shown live, kept in RUN_DIR/logs/rank-0.log
            print(f"step {step}: loss {loss.item():.4f}")

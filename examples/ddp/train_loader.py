"""The ordinary data path under stalwart: a DataLoader with worker processes over a shuffling
DistributedSampler, epochs, augmentation from the global python and numpy RNGs, gradient
accumulation with DDP's no_sync(), and an EMA of the weights. Lines particular to stalwart
are marked `# stalwart:`.

``stalwart.Epochs`` is what makes the data position part of the checkpoint: it walks the
epochs (calling ``sampler.set_epoch``) and keeps torchdata's StatefulDataLoader state, so a
recovery resumes at the batch after the restored step's (pip install "stalwart[data]").
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import stalwart
from stalwart.examples.ddp.train import Net, dataset


def augment(images: torch.Tensor) -> torch.Tensor:
    """Random flips (python's RNG) and noise (numpy's), in the training process."""
    if random.random() < 0.5:
        images = images.flip(-1)
    noise = np.random.normal(0.0, 0.05, size=images.shape).astype(np.float32)
    return images + torch.from_numpy(noise)


def train_loop(ctx) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ctx.config
    accumulate = int(cfg.get("accumulate", 2))

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = StatefulDataLoader(
        data,
        batch_size=int(cfg.get("batch_size", 8)),
        sampler=sampler,
        num_workers=int(cfg.get("num_workers", 2)),
        drop_last=True,
    )
    batches = stalwart.Epochs(loader, sampler)  # stalwart: the epoch and position in it

    model = DistributedDataParallel(Net(dropout=0.1))
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg.get("lr", 0.05)), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.total_steps)
    ctx.register(  # stalwart: everything a step changes
        model=model, ema=ema, optimizer=optimizer, scheduler=scheduler, data=batches
    )

    for _step in ctx.steps():  # stalwart
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accumulate):
            images, labels = next(batches)
            sync = micro == accumulate - 1
            with model.no_sync() if not sync else contextlib.nullcontext():
                loss = F.cross_entropy(model(augment(images)), labels) / accumulate
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        ema.update_parameters(model.module)
        ctx.report(loss=total, samples=accumulate * len(labels))  # stalwart

"""A torchrun DDP script converted to stalwart: what changed is marked `# stalwart:`.

The body is what an ordinary data-parallel script does: init_process_group, RANK and
WORLD_SIZE from the environment, a CNN with BatchNorm and dropout wrapped in its own
DistributedDataParallel, SGD with momentum, a step LR schedule, gradient clipping, a
DistributedSampler's shuffled order per epoch, and barrier/broadcast/all_gather. Under
stalwart the process group is the generation's (init_process_group hands it back), and a
recovery releases a rank blocked in any of these collectives.

Data position: the batch of a step is a function of the step (the sampler's order for the
step's epoch, sliced at the step's position), so a restored step reads the same batch.
"""

from __future__ import annotations

import os

import fsspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset


class Net(torch.nn.Module):
    def __init__(self, channels: int = 8, classes: int = 4, dropout: float = 0.1):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.drop = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(channels * 3 * 3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


def dataset(n: int = 512, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Synthetic 12x12 images whose class is the quadrant holding the bright blob."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = torch.randn(n, 1, 12, 12, generator=g) * 0.5
    for i, c in enumerate(labels.tolist()):
        r, q = divmod(c, 2)
        images[i, 0, r * 6 : r * 6 + 6, q * 6 : q * 6 + 6] += 1.0
    return TensorDataset(images, labels)


def train_loop(ctx) -> None:  # stalwart: was main(); ctx is the job's context
    dist.init_process_group(backend="gloo")  # hands back stalwart's group
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = ctx.config
    batch = int(cfg.get("batch_size", 16))

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = len(sampler) // batch

    torch.manual_seed(1234 + rank)  # a rank-dependent init: DDP broadcasts rank 0's
    model = DistributedDataParallel(Net(dropout=float(cfg.get("dropout", 0.1))))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg.get("lr", 0.05)), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    ctx.register(model=model, optimizer=optimizer, scheduler=scheduler)  # stalwart

    scale = torch.tensor([1.0 if rank == 0 else 0.0])
    dist.broadcast(scale, src=0)  # rank 0's setting, as scripts share a config
    dist.barrier()

    for step in ctx.steps():  # stalwart: was `for step in range(steps)`; resumes after a restore
        epoch, position = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        order = list(iter(sampler))[position * batch : (position + 1) * batch]
        images, labels = data[order]
        model.train()
        loss = F.cross_entropy(model(images), labels) * scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        losses = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        ctx.report(loss=float(torch.cat(losses).mean()), samples=batch)  # stalwart

    if rank == 0:  # the trained model, kept: torch.load(..., weights_only=True) reads it
        # fsspec: ctx.output_dir may be a local path or a URL (s3://...).
        with fsspec.open(f"{ctx.output_dir}/model.pt", "wb") as f:
            torch.save(model.module.state_dict(), f)
    dist.destroy_process_group()  # a no-op for stalwart's group

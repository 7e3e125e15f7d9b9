"""The "before" of examples/ddp/train.py: the ordinary torchrun DDP script a user has.

    torchrun --nproc_per_node=2 examples/ddp/torchrun_original.py --steps 60 --out model.pt

Nothing of stalwart is imported: this is the script as it exists before the migration
(docs/migrating.md walks through every line that changes). A CNN with BatchNorm and dropout
in its own DistributedDataParallel, SGD with momentum, a step LR schedule, gradient clipping,
a DistributedSampler's shuffled order per epoch, barrier/broadcast/all_gather, and the final
model saved by rank 0.
"""

from __future__ import annotations

import argparse
import gc
import os

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--out", default="model.pt", help="where rank 0 saves the final model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, batch = args.steps, args.batch_size

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = len(sampler) // batch

    torch.manual_seed(1234 + rank)  # a rank-dependent init: DDP broadcasts rank 0's
    model = DistributedDataParallel(Net(dropout=args.dropout))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    scale = torch.tensor([1.0 if rank == 0 else 0.0])
    dist.broadcast(scale, src=0)  # rank 0's setting, as scripts share a config
    dist.barrier()

    for step in range(steps):
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
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {float(torch.cat(losses).mean()):.4f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    # DDP holds the process group: let it go first, so that the group is destroyed now and
    # not while the interpreter exits (where gloo's threads tearing down can abort it).
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

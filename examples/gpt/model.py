"""A small decoder-only transformer (GPT-style) and deterministic synthetic token data."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(
            cfg.d_model, cfg.n_heads, dropout=cfg.dropout, batch_first=True
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 if p.shape[0] != cfg.vocab else 2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def synthetic_batch(
    step: int,
    rank: int,
    batch: int,
    cfg: GPTConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences from a fixed hidden rule, a function of (seed, step, rank) only.

    Each sequence follows x[i+1] = (a * x[i] + b + e[i]) mod vocab with a per-sequence (a, b)
    and rare noise e, so a model can learn it and the loss visibly falls.
    """
    g = torch.Generator().manual_seed(hash((seed, step, rank)) & 0x7FFF_FFFF)
    n = cfg.seq_len + 1
    a = torch.randint(1, 4, (batch, 1), generator=g)
    b = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    noise = (torch.rand(batch, n, generator=g) < 0.05).long() * torch.randint(
        0, cfg.vocab, (batch, n), generator=g
    )
    x = torch.empty(batch, n, dtype=torch.long)
    x[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=g)
    for i in range(1, n):
        x[:, i] = (a[:, 0] * x[:, i - 1] + b[:, 0] + noise[:, i]) % cfg.vocab
    x = x.to(device)
    return x[:, :-1], x[:, 1:]


def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

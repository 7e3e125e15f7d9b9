"""What the checks that keep a real loop exact cost, against the training step they guard.

- the divergence guard's fingerprint of the parameters (worker/divergence.py), one pass
  over them, per check (the two small all-reduces that follow are not included: they carry
  one int64 per tensor);
- the exactness scan of live objects (worker/exactness.py), once per job;
- a training step of the same model (forward, backward, AdamW), the peer the ratios use.

For the quickstart's GPT and for a larger one (d_model 512, 8 layers), on one CPU thread
like a quickstart worker. Prints JSON; docs/benchmarks.md has the figures.

    python -m bench.loop_checks
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from stalwart.examples.gpt.model import GPT, GPTConfig, loss_fn, synthetic_batch
from stalwart.orchestrator.worker.divergence import fingerprint, named_parameters
from stalwart.orchestrator.worker.exactness import unregistered

MODELS = {
    "quickstart": {"vocab": 64, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4},
    "larger": {"vocab": 512, "seq_len": 128, "d_model": 512, "n_layers": 8, "n_heads": 8},
}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, cfg: dict) -> dict:
    torch.manual_seed(0)
    model_cfg = GPTConfig(**cfg, dropout=0.0)
    model = GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    objects = {"model": model, "optimizer": opt}
    params = named_parameters(objects)
    inputs, targets = synthetic_batch(0, 0, 16, model_cfg, 0, torch.device("cpu"))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, inputs, targets).backward()
        opt.step()

    step_s = _median_s(step, 10)
    guard_s = _median_s(lambda: fingerprint(params, torch.device("cpu")), 20)
    scan_s = _median_s(lambda: unregistered(objects), 3)
    n = sum(p.numel() for _, p in params)
    return {
        "model": name,
        "parameters": n,
        "tensors": len(params),
        "step_s": round(step_s, 5),
        "guard_s": round(guard_s, 6),
        "guard_per_step_at_every_100": round(guard_s / 100 / step_s, 6),
        "guard_vs_step": round(guard_s / step_s, 4),
        "scan_s": round(scan_s, 4),
    }


def main() -> None:
    torch.set_num_threads(1)
    print(json.dumps([measure(n, c) for n, c in MODELS.items()], indent=2))


if __name__ == "__main__":
    main()

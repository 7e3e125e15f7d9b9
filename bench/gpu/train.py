"""The quickstart's GPT loop (stalwart.examples.gpt.train) with the settings that make a GPU
run bit-exact across a recovery (docs/exactness.md, "What GPU runs additionally need"):
deterministic algorithms, no cuDNN autotuning, no TF32, and attention on PyTorch's math
kernel (the fused SDPA kernels' backward may use atomics). Set in the loop, so every
generation and every replacement process has them. CUBLAS_WORKSPACE_CONFIG must be in the
workers' environment before cuBLAS starts: bench/gpu_device_run.sh exports it.

warn_only=True: an operation without a deterministic kernel warns (in RUN_DIR/logs/) rather
than failing the job; the digest comparison then says whether it mattered.
"""

from __future__ import annotations

import torch

from stalwart.examples.gpt.train import train_loop as gpt_loop


def train_loop(ctx) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    gpt_loop(ctx)

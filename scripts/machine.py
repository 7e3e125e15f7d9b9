"""One line on how fast this machine is, printed before the suite runs (scripts/test.sh).

The suite's time is mostly job starts (every rank process imports torch) on two cores, so
two machines of the same size can differ by 2x: a figure in CI's log or in
docs/benchmarks.md means little without the machine it came from. Measured here, in CPU
time of a process of its own each (not the wall clock): a pure Python loop, and
`import torch` as a rank process pays it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

LOOP = "t = __import__('time').process_time(); s = 0\nfor i in range(10**7): s += i\n"
LOOP += "print(__import__('time').process_time() - t)"
IMPORT = "import time; t = time.process_time(); import torch; print(time.process_time() - t)"


def _cpu() -> str:
    """The CPU's model and the widest vector extension torch's kernels can use, from one
    read of /proc/cpuinfo."""
    fallback = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return fallback
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        fallback,
    )
    flags = " AVX-512" if " avx512f" in text else (" AVX2" if " avx2" in text else "")
    return model + flags


def _cpu_seconds(code: str) -> float | None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return float(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None


def main() -> int:
    started = time.monotonic()
    loop, imp = _cpu_seconds(LOOP), _cpu_seconds(IMPORT)

    def fmt(x: float | None) -> str:
        return "?" if x is None else f"{x:.2f} s"

    print(
        f"machine: {_cpu()}, {os.cpu_count()} CPUs; CPU time of a 10^7-step "
        f"Python loop {fmt(loop)}, of `import torch` {fmt(imp)} "
        f"(measured in {time.monotonic() - started:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Xid table and GPU health judgment: one place, documented in docs/health.md.

Xids are NVIDIA driver error codes (https://docs.nvidia.com/deploy/xid-errors/). We sort
them into three severities:

- FATAL: the GPU or its node cannot be trusted any more (fallen off the bus, uncorrectable
  memory errors, GSP/firmware failures). The node is cordoned and its ranks move.
- APPLICATION: the fault is in what ran on the GPU (illegal address, graphics engine
  exception, reset channel). The rank restarts on the same node; the node is not cordoned.
- INFO: everything else: recorded and exported, no action.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class Severity(enum.Enum):
    FATAL = "fatal"
    APPLICATION = "application"
    INFO = "info"


XID_TABLE: dict[int, tuple[Severity, str]] = {
    13: (Severity.APPLICATION, "graphics engine exception (e.g. out-of-range access)"),
    31: (Severity.APPLICATION, "GPU memory page fault (illegal address)"),
    43: (Severity.APPLICATION, "GPU stopped processing (reset channel)"),
    45: (Severity.APPLICATION, "preemptive cleanup after a previous error"),
    48: (Severity.FATAL, "double-bit ECC error"),
    62: (Severity.FATAL, "internal micro-controller halt"),
    64: (Severity.FATAL, "ECC page retirement or row remapping recording failure"),
    68: (Severity.APPLICATION, "video processor exception"),
    74: (Severity.FATAL, "NVLink error"),
    79: (Severity.FATAL, "GPU has fallen off the bus"),
    95: (Severity.FATAL, "uncontained ECC error"),
    119: (Severity.FATAL, "GSP RPC timeout"),
    120: (Severity.FATAL, "GSP error"),
    140: (Severity.FATAL, "unrecovered ECC error"),
    143: (Severity.FATAL, "GPU initialization failure"),
}


def classify_xid(xid: int) -> tuple[Severity, str]:
    return XID_TABLE.get(xid, (Severity.INFO, "not in stalwart's table: recorded only"))


@dataclass(frozen=True)
class GpuReading:
    """One probe reading of one GPU. Counters are cumulative, as NVML reports them."""

    node: str
    index: int
    at: float
    xids: tuple[int, ...] = ()  # Xid events since the previous reading
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int = 0  # volatile double-bit ECC errors
    retired_pages: int = 0
    remap_failure: bool = False  # row remapping failed: the memory is bad
    lost: bool = False  # the GPU stopped answering (NVML: GPU is lost)
    error: str | None = None  # the probe could not read it


@dataclass(frozen=True)
class GpuVerdict:
    fatal: dict[tuple[str, int], str] = field(default_factory=dict)  # (node, gpu) -> why
    application: dict[tuple[str, int], str] = field(default_factory=dict)
    info: dict[tuple[str, int], str] = field(default_factory=dict)


def judge_gpus(
    readings: Sequence[GpuReading],
    previous_ecc: dict[tuple[str, int], int],
    max_temperature_c: float,
) -> tuple[GpuVerdict, str]:
    """Sort readings into fatal / application / info findings.

    `previous_ecc`: each GPU's uncorrected-ECC count when the job started, so only new
    errors count (a count that was already there belongs to an older job).
    """
    fatal: dict[tuple[str, int], str] = {}
    app: dict[tuple[str, int], str] = {}
    info: dict[tuple[str, int], str] = {}

    def add(bucket: dict, key: tuple[str, int], why: str) -> None:
        bucket[key] = f"{bucket[key]}; {why}" if key in bucket else why

    for r in readings:
        key = (r.node, r.index)
        if r.lost:
            add(fatal, key, "GPU lost (stopped answering)")
        if r.ecc_uncorrected > previous_ecc.get(key, r.ecc_uncorrected):
            add(fatal, key, f"uncorrectable ECC errors rose to {r.ecc_uncorrected}")
        if r.remap_failure:
            add(fatal, key, "row remapping failed")
        for xid in r.xids:
            severity, text = classify_xid(xid)
            bucket = {Severity.FATAL: fatal, Severity.APPLICATION: app, Severity.INFO: info}
            add(bucket[severity], key, f"Xid {xid}: {text}")
        if r.temperature_c is not None and r.temperature_c > max_temperature_c:
            add(info, key, f"temperature {r.temperature_c:.0f} C > {max_temperature_c:.0f} C")
        if r.error:
            add(info, key, f"probe error: {r.error}")
    verdict = GpuVerdict(fatal, app, info)
    parts = [
        f"{sev} on node {n[:12]} gpu {i}: {why}"
        for sev, bucket in (("fatal", fatal), ("application error", app), ("note", info))
        for (n, i), why in sorted(bucket.items())
    ]
    return verdict, "; ".join(parts) if parts else "all GPUs healthy"

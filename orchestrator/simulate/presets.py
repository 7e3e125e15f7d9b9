"""Published failure rates, as named presets for a scenario's `failures.preset`.

llama3: the unexpected interruptions of Llama 3 405B's pre-training, 16,384 H100 GPUs over a
54-day snapshot (Llama Team, "The Llama 3 Herd of Models", 2024, Table 5: 419 unexpected
interruptions, 47 planned ones left out), by root cause, each put to the kind of fault
stalwart's detectors see it as:

- gpu: the GPU itself fails (an Xid the NVML probe reads as fatal): its rank is replaced,
  its node cordoned.
- node: the host goes (power, chassis, CPU, memory, a disk, maintenance that was not
  planned): its agent goes silent; every rank on it is replaced.
- network: a switch, a cable or a NIC: the node drops off the others (as a lost node).
- process: a software fault ends one rank's process (Ray reports the death at once).
- hang: a collective that never returns (NCCL watchdog timeouts): found by the hang timeout.
- numeric: silent data corruption, caught when the loss is no longer finite: the group
  rolls back to its last commit in place.
"""

from __future__ import annotations

from typing import NamedTuple


class Cause(NamedTuple):
    name: str
    kind: str
    count: int


class Preset(NamedTuple):
    source: str
    gpus: int
    days: float
    causes: tuple[Cause, ...]

    @property
    def total(self) -> int:
        return sum(c.count for c in self.causes)


LLAMA3 = Preset(
    "Llama 3 405B pre-training, 16,384 H100, 54 days (The Llama 3 Herd of Models, Table 5)",
    16_384,
    54.0,
    (
        Cause("faulty GPU", "gpu", 148),
        Cause("GPU HBM3 memory", "gpu", 72),
        Cause("software bug", "process", 54),
        Cause("network switch/cable", "network", 35),
        Cause("host maintenance", "node", 32),
        Cause("GPU SRAM memory", "gpu", 19),
        Cause("GPU system processor", "gpu", 17),
        Cause("NIC", "network", 7),
        Cause("NCCL watchdog timeouts", "hang", 7),
        Cause("silent data corruption", "numeric", 6),
        Cause("GPU thermal interface and sensor", "gpu", 6),
        Cause("SSD", "node", 3),
        Cause("power supply", "node", 3),
        Cause("server chassis", "node", 2),
        Cause("IO expansion board", "node", 2),
        Cause("dependency", "process", 2),
        Cause("CPU", "node", 2),
        Cause("system memory", "node", 2),
    ),
)

PRESETS = {"llama3": LLAMA3}

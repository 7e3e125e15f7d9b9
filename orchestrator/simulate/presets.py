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

rsc1, rsc2: Meta's two research clusters (A100, 8 per node), as Kokolis et al. report them
("Revisiting Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025): the
rate of job-interrupting infrastructure failures per node-day fitted over 11 months, 6.50
per 1,000 node-days on RSC-1 and 2.34 on RSC-2, which projects a 16,384-GPU job's MTTF to
about 1.8 hours on RSC-1 and a 131,072-GPU job's to about 14 minutes. The paper fits one
rate for every cause, so these presets have one cause, counted as a lost node (its ranks
replaced; the conservative reading of a failure the rate does not break down). The figures
are the paper's as cited; the copies of it reachable from this workplace hold only its
abstract, so they were not re-read against its text (docs/simulate.md).
"""

from __future__ import annotations

from typing import NamedTuple


class Cause(NamedTuple):
    name: str
    kind: str
    count: float  # failures over the preset's GPUs and days


class Preset(NamedTuple):
    source: str
    gpus: int
    days: float
    causes: tuple[Cause, ...]

    @property
    def total(self) -> float:
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


def _per_node_day(cluster: str, per_1000_node_days: float) -> Preset:
    """A rate per 1,000 node-days of 8 GPUs, as one cause over 1,000 nodes for a day."""
    return Preset(
        f"Meta {cluster}, A100, {per_1000_node_days} failures per 1,000 node-days (Kokolis "
        "et al., HPCA 2025)",
        8_000,
        1.0,
        (Cause(f"{cluster} infrastructure failure", "node", per_1000_node_days),),
    )


RSC1 = _per_node_day("RSC-1", 6.50)
RSC2 = _per_node_day("RSC-2", 2.34)

PRESETS = {"llama3": LLAMA3, "rsc1": RSC1, "rsc2": RSC2}

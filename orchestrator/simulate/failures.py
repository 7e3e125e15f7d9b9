"""The failures of one simulated run: a Poisson process per cause over the cluster's GPUs,
each failure put on a node and a GPU at random. Every strategy of a seed meets the same
failures (common random numbers: their differences are the strategies', not the draw's)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import NamedTuple

from stalwart.orchestrator.simulate.scenario import DAY_S, Scenario


class Straggler(NamedTuple):
    at: float  # seconds into the run: a GPU starts computing slowly
    node: int
    gpu: int


class Failure(NamedTuple):
    at: float  # seconds into the run
    cause: str
    kind: str
    node: int
    gpu: int  # on its node


def _arrivals(rng: random.Random, per_s: float, horizon: float) -> Iterator[float]:
    """The times of a Poisson process of rate `per_s` before `horizon` (none at rate 0).
    A caller may draw more from `rng` between two: the draws stay in one order."""
    if per_s <= 0:
        return
    t = rng.expovariate(per_s)
    while t < horizon:
        yield t
        t += rng.expovariate(per_s)


def draw(sc: Scenario, seed: int) -> list[Failure]:
    rng = random.Random(seed)
    causes = [c for c in sc.failures.rates() if c.per_gpu_day > 0]
    per_s = [c.per_gpu_day * sc.cluster.gpus / DAY_S for c in causes]
    out: list[Failure] = []
    for t in _arrivals(rng, sum(per_s), sc.job.horizon_s):
        c = rng.choices(causes, weights=per_s)[0]
        node = rng.randrange(sc.cluster.nodes)
        out.append(Failure(t, c.name, c.kind, node, rng.randrange(sc.cluster.gpus_per_node)))
    return out


def draw_stragglers(sc: Scenario, seed: int) -> list[Straggler]:
    """Slow-GPU episodes, a Poisson process of their own (its own random numbers, so a
    scenario's failures are the same with or without stragglers)."""
    rng = random.Random(seed * 104_729 + 3)
    per_s = sc.failures.stragglers.per_gpu_day * sc.failures.scale * sc.cluster.gpus / DAY_S
    return [
        Straggler(t, rng.randrange(sc.cluster.nodes), rng.randrange(sc.cluster.gpus_per_node))
        for t in _arrivals(rng, per_s, sc.job.horizon_s)
    ]


def mtbf_s(sc: Scenario) -> float:
    """The cluster's mean time between failures, from the rates."""
    per_day = sum(c.per_gpu_day for c in sc.failures.rates()) * sc.cluster.gpus
    return DAY_S / per_day if per_day else float("inf")

"""A scenario's runs: every strategy over every seed, on the same failures per seed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.orchestrator.simulate import baselines
from stalwart.orchestrator.simulate.analytic import restart_storage_estimate
from stalwart.orchestrator.simulate.failures import Failure, Straggler, draw, draw_stragglers
from stalwart.orchestrator.simulate.outcome import Outcome, summary
from stalwart.orchestrator.simulate.scenario import Scenario
from stalwart.orchestrator.simulate.strategies import Stalwart

Strategy = Callable[[Scenario, int, list[Failure], list[Straggler]], Outcome]

STRATEGY: dict[str, Strategy] = {
    "stalwart": lambda sc, seed, failures, stragglers: Stalwart(sc, seed).run(failures, stragglers),
    "restart-storage": baselines.restart_storage,
    "gemini": baselines.gemini,
    "replica-group": baselines.replica_group,
    "standby-switch": baselines.standby_switch,
}


def simulate(
    sc: Scenario, progress: Callable[[int, int], None] | None = None
) -> dict[str, list[Outcome]]:
    """strategy -> its outcome per seed (seeds sc.seed .. sc.seed + sc.seeds - 1)."""
    runs: dict[str, list[Outcome]] = {name: [] for name in sc.strategies}
    for i in range(sc.seeds):
        seed = sc.seed + i
        failures, stragglers = draw(sc, seed), draw_stragglers(sc, seed)
        for name in sc.strategies:
            runs[name].append(STRATEGY[name](sc, seed, failures, stragglers))
        if progress is not None:
            progress(i + 1, sc.seeds)
    return runs


def report(sc: Scenario, runs: dict[str, list[Outcome]]) -> dict[str, Any]:
    """What `stalwart simulate -o json` prints."""
    interval = baselines.save_interval(sc)
    return {
        "scenario": sc.name,
        "gpus": sc.cluster.gpus,
        "nodes": sc.cluster.nodes,
        "days": sc.job.days,
        "optimal_save_interval_s": round(baselines.optimal_interval(sc), 1),
        "kokolis_estimate": {"restart-storage": restart_storage_estimate(sc, interval)},
        "strategies": [summary(outs) for outs in runs.values()],
    }

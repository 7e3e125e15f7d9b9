"""Closed-form estimates the simulator is checked against where their assumptions hold,
and that `stalwart simulate` prints beside its own figures.

Kokolis et al. ("Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
HPCA 2025) estimate a job's effective training time ratio from its MTTF: every failure
costs the restart overhead u0 (the failure noticed, the job started again, its checkpoint
loaded) and on average half a checkpoint interval redone, so

    E[ETTR] ~= 1 - (u0 + interval / 2) / MTTF

as long as checkpoints stall nothing and failures are rare against what each costs (no
failure lands in a recovery, none in the same interval as another). Where those hold, the
simulated restart-storage strategy must agree with it (tests/unit/test_simulate.py).
"""

from __future__ import annotations

from typing import Any

from stalwart.orchestrator.simulate.baselines import detection_s
from stalwart.orchestrator.simulate.failures import mtbf_s
from stalwart.orchestrator.simulate.scenario import Scenario

# Failures rare against what each costs: u0 + interval within this share of the MTTF.
RARE = 0.1


def kokolis_ettr(mttf_s: float, restart_overhead_s: float, interval_s: float) -> float:
    """Kokolis et al.'s first-order estimate of ETTR (never below 0)."""
    return max(0.0, 1.0 - (restart_overhead_s + interval_s / 2) / mttf_s)


def restart_overhead_s(sc: Scenario) -> float:
    """u0 of restart-storage: noticed (a hang by the watchdog, the rest by timeouts),
    restarted and loaded, averaged over the causes by their rates."""
    c = sc.costs.restart_storage
    rates = sc.failures.rates()
    total = sum(r.per_gpu_day for r in rates)
    detect = (
        sum(r.per_gpu_day * detection_s(sc, r.kind) for r in rates) / total
        if total
        else detection_s(sc, "node")
    )
    return detect + c.restart_s + c.load_s


def restart_storage_estimate(sc: Scenario, interval_s: float) -> dict[str, Any]:
    """Kokolis et al.'s estimate for restart-storage at this scenario, and whether its
    assumptions hold here (the reasons they do not, if not)."""
    mttf = mtbf_s(sc)
    u0 = restart_overhead_s(sc)
    stall = sc.costs.restart_storage.save_stall_s
    why = []
    if stall > 0:
        why.append(f"each save stalls training {stall:g} s")
    if u0 + interval_s > RARE * mttf:
        why.append(
            f"u0 + interval ({u0 + interval_s:,.0f} s) is over {RARE:.0%} of the MTTF "
            f"({mttf:,.0f} s)"
        )
    return {
        "ettr": round(kokolis_ettr(mttf, u0, interval_s), 5),
        "mttf_h": round(mttf / 3600, 3),
        "restart_overhead_s": round(u0, 1),
        "interval_s": round(interval_s, 1),
        "assumptions_hold": not why,
        "outside_assumptions": why,
    }

"""The strategies stalwart is measured against, in the same model, each as its published
shape: what it does with every failure, and what it pays while nothing fails.

- restart-storage (TorchElastic, Ray Train): the world restarts and loads the newest
  checkpoint from storage, saved every interval (by default Young's optimum,
  sqrt(2 x MTBF x save stall)); training pauses for each save.
- gemini: the same world restart, from checkpoints kept in CPU memory every few minutes.
- replica-group (torchft, FT-HSDP): the failed replica group drops out; every group stalls
  while the quorum changes, and the group's share of throughput is lost until it rejoins.
- standby-switch (TrainMover): a standby takes the failed machine's place; the job resumes
  from its last checkpoint without a world restart.
"""

from __future__ import annotations

import math

from stalwart.orchestrator.simulate.failures import Failure, Straggler, mtbf_s
from stalwart.orchestrator.simulate.outcome import Outcome
from stalwart.orchestrator.simulate.scenario import Scenario


def optimal_interval(sc: Scenario) -> float:
    """Young's first-order optimum: sqrt(2 x MTBF x the cost of one save)."""
    return math.sqrt(2 * mtbf_s(sc) * max(sc.costs.restart_storage.save_stall_s, 1e-9))


def save_interval(sc: Scenario) -> float:
    """restart-storage's save interval: the scenario's, or Young's optimum."""
    c = sc.costs.restart_storage
    return optimal_interval(sc) if c.interval_s == "optimal" else c.interval_s


def unmoved(out: Outcome, sc: Scenario, stragglers: list[Straggler]) -> Outcome:
    """No straggler detection: each slow GPU paces the job until its episode ends."""
    s = sc.failures.stragglers
    for e in stragglers:
        out.stragglers += 1
        out.slow(min(s.duration_s, out.horizon_s - e.at), s.slowdown)
    return out


def detection_s(sc: Scenario, kind: str) -> float:
    """A world-restart strategy's notice of a failure: NCCL's watchdog for a hang, the
    timeouts for the rest."""
    c = sc.costs.restart_storage
    return c.hang_detect_s if kind == "hang" else c.detect_s


def _outcome(name: str, sc: Scenario, seed: int, idle_gpus: int = 0) -> Outcome:
    return Outcome(name, seed, sc.job.horizon_s, gpus=sc.cluster.gpus, idle_gpus=idle_gpus)


def _world_restart(
    out: Outcome,
    sc: Scenario,
    failures: list[Failure],
    stragglers: list[Straggler],
    restore_s: float,
    interval: float,
    stall: float,
    restart_s: float,
) -> Outcome:
    resume = 0.0
    for f in failures:
        at = max(f.at, resume)
        out.interruptions += 1
        detect = detection_s(sc, f.kind)
        redone = min((at - resume) % (interval + stall), interval)
        out.lose("detection", detect)
        out.lose("restart", restart_s)
        out.lose("restore", restore_s)
        out.redo(redone, sc.job.step_time_s)
        out.recoveries_s.append(detect + restart_s + restore_s)
        resume = at + detect + restart_s + restore_s + redone
    unmoved(out, sc, stragglers)
    training = out.horizon_s - sum(out.lost.values())
    out.lose("checkpoint", max(0.0, training) * stall / (interval + stall))
    return out


def restart_storage(
    sc: Scenario, seed: int, failures: list[Failure], stragglers: list[Straggler]
) -> Outcome:
    c = sc.costs.restart_storage
    out = _outcome("restart-storage", sc, seed)
    return _world_restart(
        out, sc, failures, stragglers, c.load_s, save_interval(sc), c.save_stall_s, c.restart_s
    )


def gemini(
    sc: Scenario, seed: int, failures: list[Failure], stragglers: list[Straggler]
) -> Outcome:
    g = sc.costs.gemini
    out = _outcome("gemini", sc, seed)
    restart = sc.costs.restart_storage.restart_s
    return _world_restart(out, sc, failures, stragglers, g.restore_s, g.interval_s, 0.0, restart)


def replica_group(
    sc: Scenario, seed: int, failures: list[Failure], stragglers: list[Straggler]
) -> Outcome:
    r = sc.costs.replica_group
    out = _outcome("replica-group", sc, seed)
    resume = 0.0
    for f in failures:
        at = max(f.at, resume)
        out.interruptions += 1
        out.lose("restart", r.stall_s)  # every group waits for the new quorum
        out.lose("cold_start", r.rejoin_s / r.groups)  # one group's share, until it rejoins
        out.recoveries_s.append(r.stall_s)
        resume = at + r.stall_s
    return unmoved(out, sc, stragglers)


def standby_switch(
    sc: Scenario, seed: int, failures: list[Failure], stragglers: list[Straggler]
) -> Outcome:
    """A world restart whose restart is the standby's switch, with nothing to load and
    checkpoints that stall nothing; the standby machines hold GPUs that do not train."""
    s = sc.costs.standby_switch
    out = _outcome("standby-switch", sc, seed, s.standby_nodes * sc.cluster.gpus_per_node)
    return _world_restart(out, sc, failures, stragglers, 0.0, s.interval_s, 0.0, s.switch_s)

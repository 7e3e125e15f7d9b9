"""A simulation scenario: the cluster, the job, the failure rates and each strategy's costs,
validated like a job spec (every bad field named), with a JSON Schema for editors.

Costs whose default was measured by bench/ on the 2-core development machine say so in
their description; the others are assumptions for a large cluster, stated as such (the
published studies do not give them), and belong in the scenario when a team knows its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stalwart.orchestrator.simulate.presets import PRESETS
from stalwart.orchestrator.spec import load_model
from stalwart.orchestrator.spec_health import StragglerSpec

DAY_S = 86_400.0
Kind = Literal["gpu", "node", "network", "process", "hang", "numeric"]
STRATEGIES = ("stalwart", "restart-storage", "gemini", "replica-group", "standby-switch")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Cluster(_Strict):
    gpus: int = Field(16_384, ge=1, description="GPUs the job trains on (one rank each)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs (ranks) per node")

    @model_validator(mode="after")
    def _whole_nodes(self) -> Cluster:
        if self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})"
            )
        return self

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


class Cause(_Strict):
    name: str = Field(min_length=1)
    kind: Kind
    per_gpu_day: float = Field(ge=0, description="failures per GPU per day")


class Stragglers(_Strict):
    per_gpu_day: float = Field(
        0.0,
        ge=0,
        description="slow-GPU episodes per GPU per day (no published rate is shipped: "
        "set your cluster's; 0: none)",
    )
    slowdown: float = Field(
        2.5,
        gt=1,
        description="the slow GPU's compute time over its peers' while an episode lasts "
        "(the whole job steps at its pace)",
    )
    duration_s: float = Field(
        3600.0, gt=0, description="how long an episode lasts when nothing moves its rank"
    )


class Failures(_Strict):
    preset: Literal["llama3", "rsc1", "rsc2"] | None = Field(
        "llama3",
        description="published rates (presets.py), scaled to this cluster's GPUs: Llama 3's "
        "by cause, or Meta's research clusters RSC-1/RSC-2 (Kokolis et al.)",
    )
    scale: float = Field(1.0, ge=0, description="multiplies every rate")
    causes: list[Cause] = Field(default_factory=list, description="more causes, or instead")
    stragglers: Stragglers = Field(default_factory=Stragglers)

    def rates(self) -> list[Cause]:
        """Every cause with its rate per GPU-day, the preset's first."""
        out = []
        if self.preset is not None:
            p = PRESETS[self.preset]
            out += [
                Cause(name=c.name, kind=c.kind, per_gpu_day=c.count / (p.gpus * p.days))
                for c in p.causes
            ]
        out += self.causes
        return [c.model_copy(update={"per_gpu_day": c.per_gpu_day * self.scale}) for c in out]


class Job(_Strict):
    days: float = Field(30.0, gt=0, description="simulated wall-clock days")
    step_time_s: float = Field(
        5.0, gt=0, description="one training step at this scale (an assumption)"
    )

    @property
    def horizon_s(self) -> float:
        return self.days * DAY_S


class StalwartCosts(_Strict):
    replicas: int = Field(2, ge=1, description="checkpoint.replicas")
    spares: int = Field(1, ge=0, description="warm spare nodes (failure.spares, per node)")
    max_lag_steps: int = Field(2, ge=0, description="checkpoint.max_lag_steps")
    heartbeat_timeout_s: float = Field(3.0, gt=0, description="health.heartbeat_timeout_s")
    gpu_probe_s: float = Field(1.0, gt=0, description="a fatal Xid to its report (NVML probe)")
    death_notice_s: float = Field(0.1, ge=0, description="Ray's report of a dead process")
    hang_timeout_s: float | None = Field(
        None, gt=0, description="health.hang_timeout_s (unset: derived from the step time)"
    )
    hang_floor_s: float = Field(20.0, gt=0, description="health.hang.floor_s")
    hang_factor: float = Field(5.0, gt=0, description="health.hang.factor")
    replace_s: float = Field(
        0.95,
        ge=0,
        description="a warm spare takes the ranks and training resumes (measured "
        "here: kill -> first step, 4 ranks)",
    )
    restore_s: float = Field(0.3, ge=0, description="a shard restored from a peer's memory")
    cold_start_s: float = Field(
        120.0,
        ge=0,
        description="no warm spare: a node from the cluster's pool, its processes "
        "started (an assumption)",
    )
    spare_refill_s: float = Field(120.0, ge=0, description="a used spare started again")
    persist_every_s: float = Field(1800.0, gt=0, description="durable checkpoint interval")
    load_s: float = Field(120.0, ge=0, description="restore from durable storage")
    restart_s: float = Field(300.0, ge=0, description="a world restart (the fallback)")
    step_overhead: float = Field(
        0.01,
        ge=0,
        description="step time with a snapshot every step over plain DDP, less 1 (measured "
        "on one H200, docs/benchmarks.md: 1.000x with the side-stream capture, 0.7 ms of "
        "the training thread per capture of 1 GB, 0.9 % of its 79 ms step; rounded up. "
        "On the 2-core CPU machine, 4 ranks: 1.07x)",
    )
    max_restarts: int | None = Field(None, ge=0, description="failure.max_restarts")
    loss_rollbacks: int = Field(
        3,
        ge=0,
        description="health.loss_guard.max_rollbacks (roll backs for a loss that "
        "is not finite before the job fails)",
    )
    flap_failures: int = Field(
        3, ge=1, description="failures on one node within flap_window_s that cordon it"
    )
    flap_window_s: float = Field(600.0, gt=0, description="the flapping rule's window")
    manual_restart_s: float = Field(
        3600.0, ge=0, description="a failed job restarted by hand from storage"
    )
    straggler: StragglerSpec = Field(
        default_factory=StragglerSpec,
        description="health.straggler, the job spec's own section (the detector and its "
        "decision are the supervisor's: health/straggler.py)",
    )


class RestartCosts(_Strict):
    detect_s: float = Field(60.0, ge=0, description="a failure to its notice (timeouts)")
    hang_detect_s: float = Field(600.0, ge=0, description="NCCL's watchdog (10 min)")
    restart_s: float = Field(300.0, ge=0, description="the world restarted and initialised")
    load_s: float = Field(120.0, ge=0, description="a checkpoint read from storage")
    save_stall_s: float = Field(30.0, ge=0, description="training paused per save")
    interval_s: float | Literal["optimal"] = Field(
        "optimal", description="save interval; optimal: sqrt(2 x MTBF x save_stall_s)"
    )


class GeminiCosts(_Strict):
    interval_s: float = Field(180.0, gt=0, description="in-memory checkpoint interval")
    restore_s: float = Field(30.0, ge=0, description="restore from CPU memory, every rank")


class ReplicaGroupCosts(_Strict):
    groups: int = Field(8, ge=2, description="data-parallel replica groups")
    stall_s: float = Field(180.0, ge=0, description="every group stalls while one drops out")
    rejoin_s: float = Field(600.0, ge=0, description="the group's replacement rejoins")


class StandbyCosts(_Strict):
    switch_s: float = Field(20.0, ge=0, description="the standby takes over (TrainMover)")
    standby_nodes: int = Field(
        1, ge=0, description="standby machines held ready (GPUs that do not train)"
    )
    interval_s: float = Field(300.0, gt=0, description="checkpoint interval")


class Costs(_Strict):
    stalwart: StalwartCosts = Field(default_factory=StalwartCosts)
    restart_storage: RestartCosts = Field(default_factory=RestartCosts)
    gemini: GeminiCosts = Field(default_factory=GeminiCosts)
    replica_group: ReplicaGroupCosts = Field(default_factory=ReplicaGroupCosts)
    standby_switch: StandbyCosts = Field(default_factory=StandbyCosts)


class Scenario(_Strict):
    name: str = Field("scenario", min_length=1)
    cluster: Cluster = Field(default_factory=Cluster)
    job: Job = Field(default_factory=Job)
    failures: Failures = Field(default_factory=Failures)
    strategies: list[Literal[STRATEGIES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(STRATEGIES), min_length=1
    )
    costs: Costs = Field(default_factory=Costs)
    seed: int = Field(0, ge=0)
    seeds: int = Field(5, ge=1, le=1000, description="runs per strategy (for intervals)")

    @model_validator(mode="after")
    def _fits(self) -> Scenario:
        spares = self.costs.stalwart.spares
        if spares >= self.cluster.nodes:
            raise ValueError(
                f"costs.stalwart.spares ({spares}) must be fewer than the cluster's nodes "
                f"({self.cluster.nodes})"
            )
        return self


def load_scenario(path: str | Path, overrides: list[str] = ()) -> Scenario:
    """Read and check a scenario file; SpecError names every bad field."""
    return load_model(path, Scenario, list(overrides))

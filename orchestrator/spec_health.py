"""The `health` section of a job spec: heartbeats, hangs, stragglers, GPUs, the preflight
and the loss guard (orchestrator/spec.py re-exports them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stalwart.orchestrator.spec_checkpoint import MAX_COUNT, MAX_STEPS
from stalwart.orchestrator.spec_faults import _Model


class StragglerSpec(_Model):
    """Per-rank compute time (excluding time waiting in collectives) against the median."""

    policy: Literal["alert", "replace", "none"] = Field(
        "alert",
        description="alert: event and metric only; replace: move the rank to a spare on "
        "another node and cordon its node; none: do not look",
    )
    threshold: float = Field(
        2.0,
        gt=1,
        description="flag a rank whose compute time is this many times its peers' median "
        "(lower it on quiet, uniform hardware; noisy shared machines reach 1.5)",
    )
    window_steps: int = Field(
        5,
        ge=1,
        le=MAX_STEPS,
        description="steps per window; a rank's window score is its best (shortest) "
        "compute time in the window over the other ranks' median best",
    )
    consecutive_windows: int = Field(
        2, ge=1, le=MAX_COUNT, description="flag only after this many consecutive slow windows"
    )
    min_excess_s: float = Field(
        0.005,
        ge=0,
        description="ignore differences smaller than this many seconds per step (timer noise)",
    )
    min_duration_s: float = Field(
        3.0,
        ge=0,
        description="flag only a slowdown whose evidence spans at least this many seconds of "
        "steps: at 30 steps/s two windows are 0.3 s, the length of a GC pause or a "
        "neighbour's burst, not of a sick GPU",
    )
    warmup_steps: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="steps at the start of each generation (a start, a restart, a resize) "
        "that are not judged: lazy initialisation, allocator warm-up, the first checkpoint "
        "copies and processes still starting on the same machine make them uneven",
    )


class SlowLinkSpec(_Model):
    """A node's network judged by the round trips of its report requests
    (health/slow_link.py: a delay) and by the TCP segments each node sends again
    (health/lossy_link.py: a loss): a slow link names its node, not a rank."""

    policy: Literal["alert", "none"] = Field(
        "alert",
        description="alert: event and metric (its ranks compute as fast as their peers: "
        "nothing to replace); none: do not look",
    )
    threshold: float = Field(
        3.0,
        gt=1,
        description="flag a node whose round trip is this many times the other nodes' median",
    )
    window: int = Field(
        15,
        ge=2,
        le=MAX_COUNT,
        description="round trips per window (one per health.report_interval_s); a window's "
        "round trip is its mean without its longest",
    )
    consecutive_windows: int = Field(
        2, ge=1, le=MAX_COUNT, description="flag only after this many consecutive slow windows"
    )
    min_excess_s: float = Field(
        0.02,
        ge=0,
        description="ignore round trips less than this many seconds over the other nodes' "
        "(a busy machine's scheduling)",
    )
    loss_threshold: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="a link between two nodes is lossy when this share of the data segments "
        "they sent each other was sent again (TCP retransmissions, health/lossy_link.py); a "
        "node is flagged when most of its measured links are lossy, and all of them "
        "together, while most other links are not",
    )
    loss_min_segments: int = Field(
        100,
        ge=1,
        description="a link is judged in a window only when its two ends sent each other at "
        "least this many data segments",
    )
    loss_window_s: float = Field(
        3.0, gt=0, description="seconds per window of TCP counters (consecutive_windows apply)"
    )


class GpuSpec(_Model):
    probe: Literal["auto", "nvml", "fake", "none"] = Field(
        "auto",
        description="auto: NVML where GPUs are visible, else the fake probe (fed by chaos "
        "faults); none: no GPU health checks",
    )
    interval_s: float = Field(2.0, gt=0, description="how often each node agent reads its GPUs")
    max_temperature_c: float = Field(
        95.0, gt=0, description="a GPU hotter than this is reported (not cordoned)"
    )


class PreflightSpec(_Model):
    enabled: bool = Field(True, description="check every node before it trains")
    matmul_size: int = Field(256, ge=16, le=16384, description="side of the square matmul timed")
    matmul_repeats: int = Field(20, ge=1, le=MAX_COUNT, description="matmuls timed per node")
    max_slowdown: float = Field(
        3.0, gt=1, description="cordon a node this many times slower than the median node"
    )
    timeout_s: float = Field(30.0, gt=0, description="a node whose check takes longer fails")


class LossGuardSpec(_Model):
    enabled: bool = Field(
        True,
        description="a rank that reports a loss (ctx.report(loss=...)) that is NaN or "
        "infinite is stopped before that step is checkpointed, and the job rolls back to the "
        "last committed step and retries",
    )
    max_rollbacks: int = Field(
        3,
        ge=0,
        le=MAX_COUNT,
        description="roll backs for a non-finite loss before the job fails; the same step "
        "failing again after a roll back fails it at once (a replay is bit-exact: the model "
        "or the data makes that loss)",
    )


class HangSpec(_Model):
    """How the hang timeout is derived when health.hang_timeout_s is not set
    (health/hang_timeout.py)."""

    floor_s: float = Field(
        20.0, gt=0, description="the least a derived step timeout is, however fast the steps"
    )
    factor: float = Field(
        5.0,
        ge=1,
        description="the step timeout is this many times the longest step the job has seen "
        "(each generation's first step left out)",
    )
    startup_s: float = Field(
        300.0,
        gt=0,
        description="a generation's first step (rendezvous, restore, compile) and every "
        "step before min_steps were seen",
    )
    copies_s: float = Field(
        60.0,
        gt=0,
        description="how long ranks may wait at a step boundary for their checkpoint copies "
        "to reach peer nodes (checkpoint.max_lag_steps) before replication is called stuck "
        "(never less than the step timeout)",
    )
    busy_limit_s: float = Field(
        1800.0,
        gt=0,
        description="a rank past its step timeout whose training thread still uses its CPU "
        "(an evaluation, a step longer than any seen) is busy, not hung, up to this long",
    )
    min_steps: int = Field(
        5, ge=1, le=MAX_STEPS, description="steps seen before the timeout is derived"
    )


class HealthSpec(_Model):
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="a node whose agent is silent this long is lost"
    )
    isolated_timeout_s: float = Field(
        30.0,
        ge=0,
        description="when every node of the job (two or more, alive in Ray's table) falls "
        "silent at once, that is the supervisor's own link (a partition of its node), not "
        "every node lost: they are lost only after this long (their ranks train on among "
        "themselves meanwhile); 0 treats them as any silent node",
    )
    starved_agent_timeout_s: float = Field(
        15.0,
        ge=0,
        description="an agent silent past heartbeat_timeout_s whose node's raylet still "
        "accepts a connection from the supervisor (made during the silence, each 0.5 s) is "
        "starved of CPU on a live node, not lost: its node is lost only after this long "
        "(a gone or cut-off host, or a dead raylet, accepts none and is lost at "
        "heartbeat_timeout_s); at most heartbeat_timeout_s (0) turns it off",
    )
    report_interval_s: float = Field(
        0.2,
        gt=0,
        description="how often the supervisor asks each node agent for its report "
        "(one small call per node per interval)",
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="a rank whose heartbeat arrives but whose step has not advanced this "
        "long is hung; its stacks are captured and it is replaced. null (the default): "
        "derived from the job's own steps (health.hang), logged and exported as "
        "stalwart_hang_timeout_seconds; a number fixes it for every step",
    )
    hang: HangSpec = Field(default_factory=lambda: HangSpec())
    divergence_every_steps: int = Field(
        100,
        ge=0,
        le=MAX_STEPS,
        description="compare a fingerprint of the registered modules' parameters across "
        "ranks after each generation's first step and every N steps (one pass over the "
        "parameters, two small all-reduces): replicas that differ fail the job naming the "
        "step and the tensors; 0 = off (a sharded model, FSDP)",
    )
    cordon_ttl_s: float | None = Field(
        3600.0,
        gt=0,
        description="how long a cordoned node gets no ranks of this job; null = until "
        "`stalwart uncordon`",
    )
    loss_guard: LossGuardSpec = Field(default_factory=LossGuardSpec)
    straggler: StragglerSpec = Field(default_factory=StragglerSpec)
    slow_link: SlowLinkSpec = Field(default_factory=SlowLinkSpec)
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)

"""The job's Prometheus metrics as data: names, types, labels, help texts and buckets.

`DEFINITIONS` is the one place where they live: the exporter (orchestrator/observe/metrics.py)
builds its metrics from it, the dashboards and alert rules are tested against it, and
docs/metrics.md is generated from it (``python -m stalwart.orchestrator.observe.metric_defs >
docs/metrics.md``; a unit test keeps the file current). Kept apart from the exporter: what needs
only the definitions (the docs, the tests of the dashboards and alert rules) imports no
prometheus-client.

Conventions: the ``stalwart_`` prefix, base units in names (seconds, bytes), ``_total`` on
counters, a ``train_job`` label on every series (not ``job``: Prometheus sets ``job`` to
the scrape job and would rename ours to ``exported_job``), ``rank``/``node`` where useful and
never ``step`` (one series per step would grow without bound).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from stalwart.orchestrator.state import JobState

JOB_STATES = tuple(s.value for s in JobState)
TERMINAL_STATES = tuple(s.value for s in JobState if s.terminal)
RECOVERY_OUTCOMES = ("recovered", "gave_up")
GPU_GAUGES = (
    "stalwart_gpu_temperature_celsius",
    "stalwart_gpu_power_watts",
    "stalwart_gpu_ecc_uncorrected_errors",
    "stalwart_gpu_retired_pages",
    "stalwart_gpu_up",
)
RECOVERY_PHASES = ("detect", "decide", "abort", "replace", "rendezvous", "reenter", "restore")
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CHECKPOINT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # gauge, counter or histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


DEFINITIONS: tuple[MetricDef, ...] = (
    MetricDef(
        "stalwart_job_state", "gauge", "1 for the job's current state, 0 for the others", ("state",)
    ),
    MetricDef("stalwart_step", "gauge", "the newest step any rank has completed"),
    MetricDef("stalwart_total_steps", "gauge", "the steps the job runs in all"),
    MetricDef(
        "stalwart_committed_step",
        "gauge",
        "the newest step whose every shard has its copies in memory (the restore point)",
    ),
    MetricDef(
        "stalwart_checkpoint_memory_bytes",
        "gauge",
        "bytes the nodes' memory takes for the job's in-memory checkpoints (snapshot rings, "
        "slot files, peers' copies and spare buffers, all nodes): flat in a healthy run",
    ),
    MetricDef(
        "stalwart_committed_timestamp_seconds",
        "gauge",
        "when the committed step last moved (unix time)",
    ),
    MetricDef(
        "stalwart_persisted_timestamp_seconds",
        "gauge",
        "when the newest durable checkpoint was completed (unix time)",
    ),
    MetricDef(
        "stalwart_gpu_faults_total",
        "counter",
        "findings of the GPU health probe, by severity (fatal: node cordoned; application: rank "
        "restarted; note: reported only)",
        ("node", "gpu", "severity"),
    ),
    MetricDef(
        "stalwart_gpu_xid_total",
        "counter",
        "critical Xid events the GPU health probe read, by code (docs/health.md: what each means)",
        ("node", "gpu", "xid"),
    ),
    MetricDef(
        "stalwart_gpu_temperature_celsius",
        "gauge",
        "a GPU's core temperature at the probe's last reading",
        ("node", "gpu"),
    ),
    MetricDef(
        "stalwart_gpu_power_watts",
        "gauge",
        "a GPU's power draw at the probe's last reading",
        ("node", "gpu"),
    ),
    MetricDef(
        "stalwart_gpu_ecc_uncorrected_errors",
        "gauge",
        "a GPU's volatile uncorrected (double-bit) ECC error count, as NVML reports it",
        ("node", "gpu"),
    ),
    MetricDef(
        "stalwart_gpu_retired_pages",
        "gauge",
        "a GPU's memory pages retired for ECC errors",
        ("node", "gpu"),
    ),
    MetricDef(
        "stalwart_gpu_up",
        "gauge",
        "1 while the probe reads a GPU, 0 once it is lost or cannot be read (GPU readings "
        "come from NVML, or from the fake probe only when health.gpu.probe is fake; a lost "
        "node's go)",
        ("node", "gpu"),
    ),
    MetricDef(
        "stalwart_persisted_step", "gauge", "the newest step written completely to durable storage"
    ),
    MetricDef(
        "stalwart_checkpoint_duration_seconds",
        "histogram",
        "time to checkpoint, by tier: memory = a rank's snapshot (capture on the step plus the "
        "hand-over to its node's store), peer = a node's round of copies to its peers, durable "
        "= one complete durable checkpoint. Memory and peer observe the mean of the snapshots "
        "or rounds between two polls, once for each",
        ("tier",),
        CHECKPOINT_BUCKETS,
    ),
    MetricDef(
        "stalwart_checkpoint_bytes",
        "gauge",
        "size of the newest checkpoint, by tier: memory = the job's snapshot (all ranks' "
        "shards), durable = the newest durable checkpoint",
        ("tier",),
    ),
    MetricDef(
        "stalwart_commit_lag_steps",
        "gauge",
        "steps between the newest step and the committed one (what a node loss would redo)",
    ),
    MetricDef(
        "stalwart_steps_per_second",
        "gauge",
        "the job's step rate over the last throughput interval",
    ),
    MetricDef(
        "stalwart_step_duration_seconds",
        "histogram",
        "step cycle time of each rank's completed steps",
        buckets=STEP_BUCKETS,
    ),
    MetricDef(
        "stalwart_samples_total", "counter", "samples the ranks reported (ctx.report(samples=...))"
    ),
    MetricDef(
        "stalwart_tokens_total", "counter", "tokens the ranks reported (ctx.report(tokens=...))"
    ),
    MetricDef(
        "stalwart_train_metric",
        "gauge",
        "a scalar the train loop reports (ctx.report, e.g. loss), mean over ranks",
        ("name",),
    ),
    MetricDef("stalwart_workers", "gauge", "ranks in the current generation"),
    MetricDef(
        "stalwart_generation", "gauge", "the current generation (1 + recoveries and resizes)"
    ),
    MetricDef(
        "stalwart_rank_compute_seconds",
        "gauge",
        "a rank's last step's compute time (loop body minus collective waits)",
        ("rank", "node"),
    ),
    MetricDef(
        "stalwart_rank_collective_wait_seconds",
        "gauge",
        "a rank's last step's time waiting in collectives",
        ("rank", "node"),
    ),
    MetricDef(
        "stalwart_straggler_score",
        "gauge",
        "a rank's compute time over its peers' median (1 is normal)",
        ("rank",),
    ),
    MetricDef(
        "stalwart_heartbeat_age_seconds",
        "gauge",
        "seconds since a rank's last heartbeat (written into its ring, or sent to its node agent)",
        ("rank",),
    ),
    MetricDef("stalwart_rank_memory_bytes", "gauge", "a rank's resident memory", ("rank", "node")),
    MetricDef("stalwart_failures_total", "counter", "failures acted on, by kind", ("kind",)),
    MetricDef(
        "stalwart_recoveries_total",
        "counter",
        "recoveries, by outcome (recovered, gave_up)",
        ("outcome",),
    ),
    MetricDef(
        "stalwart_recovery_duration_seconds",
        "histogram",
        "a failure's time to the first step after the restore",
        buckets=DURATION_BUCKETS,
    ),
    MetricDef(
        "stalwart_recovery_phase_duration_seconds",
        "histogram",
        "a recovery's time per phase",
        ("phase",),
        DURATION_BUCKETS,
    ),
    MetricDef("stalwart_steps_redone_total", "counter", "steps trained again after recoveries"),
    MetricDef(
        "stalwart_restarts_left",
        "gauge",
        "restarts the failure budget still allows (-1: unlimited)",
    ),
    MetricDef("stalwart_cordoned_nodes", "gauge", "nodes this job does not place ranks on"),
    MetricDef("stalwart_spares_ready", "gauge", "warm spare workers ready to take a rank"),
    MetricDef(
        "stalwart_standbys_ready",
        "gauge",
        "pre-started processes holding no room, ready to take a rank (failure.standby)",
    ),
    MetricDef(
        "stalwart_hang_timeout_seconds",
        "gauge",
        "how long a rank may go without finishing a step before it is hung (derived from "
        "the job's steps unless health.hang_timeout_s fixes it)",
    ),
    MetricDef("stalwart_stragglers_flagged_total", "counter", "straggler flags raised"),
    MetricDef(
        "stalwart_node_link_round_trip_seconds",
        "gauge",
        "a node's report round trip from the supervisor (mean of the latest window without "
        "its longest; health.slow_link)",
        ("node",),
    ),
    MetricDef(
        "stalwart_node_link_retransmit_ratio",
        "gauge",
        "the share of the data segments a node sent to other machines' addresses that it "
        "sent again (TCP retransmissions, its kernel's counters, the latest window of "
        "health.slow_link.loss_window_s); which node a lossy link is on: the slow_link "
        "events with signal loss",
        ("node",),
    ),
    MetricDef("stalwart_slow_links_flagged_total", "counter", "slow link flags raised"),
    MetricDef(
        "stalwart_replication_sent_bytes_total", "counter", "bytes of shards sent to peers' memory"
    ),
    MetricDef(
        "stalwart_replication_wait_seconds_total",
        "counter",
        "seconds training waited at step boundaries for its checkpoint copies to reach peer "
        "nodes (checkpoint.max_lag_steps): the job's, the longest wait of its ranks",
    ),
    MetricDef(
        "stalwart_persist_failures_total", "counter", "durable checkpoint writes that failed"
    ),
    MetricDef(
        "stalwart_wall_seconds_total", "counter", "seconds the job has been running or recovering"
    ),
    MetricDef(
        "stalwart_productive_seconds_total",
        "counter",
        "seconds of those spent on steps that were kept (goodput = productive / wall)",
    ),
)


def render_docs() -> str:
    """docs/metrics.md, from DEFINITIONS."""
    lines = [
        "# Metrics",
        "",
        "Generated from `orchestrator/observe/metric_defs.py` "
        "(`python -m stalwart.orchestrator.observe.metric_defs > docs/metrics.md`); "
        "tests/unit/test_metrics.py fails when this file is stale.",
        "",
        "The supervisor serves them at `http://METRICS_HOST:PORT/metrics` (`metrics.host`, "
        "default 127.0.0.1; `metrics.port`, 0 = a free port, printed at start and written to "
        "result.json). Every series has a `train_job` label (the job's name).",
        "",
        "| name | type | labels | help |",
        "| --- | --- | --- | --- |",
    ]
    for d in DEFINITIONS:
        labels = ", ".join(f"`{x}`" for x in ("train_job", *d.labels))
        lines.append(f"| `{d.name}` | {d.kind} | {labels} | {d.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_docs())

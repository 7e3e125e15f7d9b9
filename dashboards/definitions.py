"""The four dashboards: Job overview, Workers and stragglers, Checkpoints and recovery,
Nodes and GPUs. Metric names are those of orchestrator/observe/metric_defs.py (docs/metrics.md)."""

from __future__ import annotations

from typing import Any

from stalwart.dashboards.grafana import JOB, Panel, Row, Target, build

HEATMAP = {"calculate": False, "yAxis": {"unit": "none"}, "cellGap": 1}
RATE = "[$__rate_interval]"
RANGE = "[$__range]"


def job_overview() -> dict[str, Any]:
    return build(
        "stalwart-job-overview",
        "stalwart / Job overview",
        "Is the job making progress, how fast, how much of its time was productive.",
        [
            Row("Progress"),
            Panel(
                "State",
                "stat",
                (Target(f"max by (state) (stalwart_job_state{{{JOB}}}) == 1", "{{state}}"),),
                "none",
                "the job's current state",
                w=6,
                h=4,
                options={"textMode": "name"},
            ),
            Panel(
                "Step",
                "stat",
                (
                    Target(f"max(stalwart_step{{{JOB}}})", "step"),
                    Target(f"max(stalwart_total_steps{{{JOB}}})", "of"),
                ),
                "none",
                "newest step completed, out of the job's steps",
                w=6,
                h=4,
            ),
            Panel(
                "Goodput (last hour)",
                "stat",
                (Target(f"stalwart:goodput:ratio_1h{{{JOB}}}", "goodput"),),
                "percentunit",
                "productive seconds over wall seconds (recording rule stalwart:goodput:ratio_1h)",
                w=6,
                h=4,
            ),
            Panel(
                "Restarts left",
                "stat",
                (Target(f"min(stalwart_restarts_left{{{JOB}}})", "restarts left"),),
                "none",
                "recoveries the failure budget still allows (-1: unlimited)",
                w=6,
                h=4,
            ),
            Panel(
                "Steps per second",
                "timeseries",
                (Target(f"max(stalwart_steps_per_second{{{JOB}}})", "steps/s"),),
                "short",
                "the job's step rate",
            ),
            Panel(
                "Loss",
                "timeseries",
                (Target(f'avg(stalwart_train_metric{{{JOB},name="loss"}})', "loss"),),
                "none",
                "mean over ranks of what the train loop reports as loss",
            ),
            Panel(
                "Samples per second",
                "timeseries",
                (Target(f"sum(rate(stalwart_samples_total{{{JOB}}}{RATE}))", "samples/s"),),
                "short",
                "samples the ranks report, per second",
            ),
            Row("Time"),
            Panel(
                "Goodput over time",
                "timeseries",
                (
                    Target(
                        f"sum(rate(stalwart_productive_seconds_total{{{JOB}}}{RATE})) / "
                        f"sum(rate(stalwart_wall_seconds_total{{{JOB}}}{RATE}))",
                        "goodput",
                    ),
                ),
                "percentunit",
                "share of wall time spent on steps that were kept",
                w=12,
            ),
            Panel(
                "Failures by kind",
                "bargauge",
                (
                    Target(
                        f"sum by (kind) (increase(stalwart_failures_total{{{JOB}}}{RANGE}))",
                        "{{kind}}",
                        instant=True,
                    ),
                ),
                "none",
                "failures acted on in the time range",
                w=12,
            ),
        ],
    )


def workers() -> dict[str, Any]:
    return build(
        "stalwart-workers",
        "stalwart / Workers and stragglers",
        "Which rank is slow: compute time without collective waits, scores, heartbeats.",
        [
            Row("Per rank"),
            Panel(
                "Compute time per rank",
                "heatmap",
                (Target(f"max by (rank) (stalwart_rank_compute_seconds{{{JOB}}})", "{{rank}}"),),
                "s",
                "each rank's step time minus its collective waits; a straggler's row is hot",
                w=12,
                options=HEATMAP,
            ),
            Panel(
                "Straggler score per rank",
                "heatmap",
                (Target(f"max by (rank) (stalwart_straggler_score{{{JOB}}})", "{{rank}}"),),
                "none",
                "compute time over the peers' median: 1 is normal, 2 flags",
                w=12,
                options=HEATMAP,
            ),
            Panel(
                "Collective wait per rank",
                "timeseries",
                (
                    Target(
                        f"max by (rank) (stalwart_rank_collective_wait_seconds{{{JOB}}})",
                        "rank {{rank}}",
                    ),
                ),
                "s",
                "time each rank waits for the others: everyone but the straggler waits",
            ),
            Panel(
                "Heartbeat age per rank",
                "timeseries",
                (
                    Target(
                        f"max by (rank) (stalwart_heartbeat_age_seconds{{{JOB}}})",
                        "rank {{rank}}",
                    ),
                ),
                "s",
                "seconds since each rank's last heartbeat (into its ring, or to its agent)",
            ),
            Panel(
                "Step time (p50, p90)",
                "timeseries",
                (
                    Target(
                        "histogram_quantile(0.5, sum by (le) (rate("
                        f"stalwart_step_duration_seconds_bucket{{{JOB}}}{RATE})))",
                        "p50",
                    ),
                    Target(
                        "histogram_quantile(0.9, sum by (le) (rate("
                        f"stalwart_step_duration_seconds_bucket{{{JOB}}}{RATE})))",
                        "p90",
                    ),
                ),
                "s",
                "step cycle time over all ranks",
            ),
            Panel(
                "Stragglers flagged",
                "stat",
                (
                    Target(
                        f"sum(increase(stalwart_stragglers_flagged_total{{{JOB}}}{RANGE}))",
                        "flags",
                        instant=True,
                    ),
                ),
                "none",
                "straggler flags raised in the time range",
                w=6,
                h=4,
            ),
            Panel(
                "Ranks",
                "stat",
                (Target(f"max(stalwart_workers{{{JOB}}})", "ranks"),),
                "none",
                "ranks in the current generation (elastic jobs vary)",
                w=6,
                h=4,
            ),
        ],
    )


def checkpoints() -> dict[str, Any]:
    return build(
        "stalwart-checkpoints",
        "stalwart / Checkpoints and recovery",
        "How fresh the checkpoints are and how long recoveries take.",
        [
            Row("Checkpoints"),
            Panel(
                "Committed and persisted step",
                "timeseries",
                (
                    Target(f"max(stalwart_step{{{JOB}}})", "newest"),
                    Target(f"max(stalwart_committed_step{{{JOB}}})", "committed (memory)"),
                    Target(f"max(stalwart_persisted_step{{{JOB}}})", "persisted (storage)"),
                ),
                "none",
                "the step a node loss would return to, and the one on durable storage",
            ),
            Panel(
                "Commit lag",
                "timeseries",
                (Target(f"max(stalwart_commit_lag_steps{{{JOB}}})", "steps"),),
                "short",
                "steps a node loss would redo now",
            ),
            Panel(
                "Training held for copies",
                "timeseries",
                (
                    Target(
                        f"sum(rate(stalwart_replication_wait_seconds_total{{{JOB}}}{RATE}))",
                        "waiting",
                    ),
                ),
                "percentunit",
                "share of the time training waited at step boundaries for its checkpoint "
                "copies to reach peer nodes (checkpoint.max_lag_steps: the commit lag's bound)",
            ),
            Panel(
                "Checkpoint age",
                "timeseries",
                (
                    Target(
                        f"time() - max(stalwart_committed_timestamp_seconds{{{JOB}}})",
                        "committed",
                    ),
                    Target(
                        f"time() - max(stalwart_persisted_timestamp_seconds{{{JOB}}})",
                        "persisted",
                    ),
                ),
                "s",
                "seconds since the committed step moved and since the last durable checkpoint",
            ),
            Panel(
                "Copies sent to peers",
                "timeseries",
                (
                    Target(
                        f"sum(rate(stalwart_replication_sent_bytes_total{{{JOB}}}{RATE}))",
                        "sent",
                    ),
                ),
                "Bps",
                "bytes per second of shards copied to peers' memory",
            ),
            Panel(
                "Checkpoint duration by tier (mean)",
                "timeseries",
                (
                    Target(
                        "sum by (tier) (rate("
                        f"stalwart_checkpoint_duration_seconds_sum{{{JOB}}}{RATE})) / "
                        "sum by (tier) (rate("
                        f"stalwart_checkpoint_duration_seconds_count{{{JOB}}}{RATE}))",
                        "{{tier}}",
                    ),
                ),
                "s",
                "memory: a rank's snapshot; peer: a round of copies to peers; durable: one "
                "complete checkpoint on storage",
            ),
            Panel(
                "Checkpoint size by tier",
                "timeseries",
                (Target(f"max by (tier) (stalwart_checkpoint_bytes{{{JOB}}})", "{{tier}}"),),
                "bytes",
                "memory: the job's snapshot, all ranks; durable: the newest checkpoint on storage",
            ),
            Row("Recovery"),
            Panel(
                "Recoveries",
                "stat",
                (
                    Target(
                        f"sum by (outcome) (increase(stalwart_recoveries_total{{{JOB}}}{RANGE}))",
                        "{{outcome}}",
                        instant=True,
                    ),
                ),
                "none",
                "recoveries in the time range, by outcome",
                w=6,
                h=6,
            ),
            Panel(
                "Steps redone",
                "stat",
                (
                    Target(
                        f"sum(increase(stalwart_steps_redone_total{{{JOB}}}{RANGE}))",
                        "steps",
                        instant=True,
                    ),
                ),
                "none",
                "steps trained again after recoveries in the time range",
                w=6,
                h=6,
            ),
            Panel(
                "Recovery time by phase (mean)",
                "bargauge",
                (
                    Target(
                        "sum by (phase) (increase("
                        f"stalwart_recovery_phase_duration_seconds_sum{{{JOB}}}{RANGE})) / "
                        "sum by (phase) (increase("
                        f"stalwart_recovery_phase_duration_seconds_count{{{JOB}}}{RANGE}))",
                        "{{phase}}",
                        instant=True,
                    ),
                ),
                "s",
                "detect, decide, abort, replace, rendezvous, reenter, restore",
                w=12,
                h=6,
            ),
        ],
    )


def nodes() -> dict[str, Any]:
    return build(
        "stalwart-nodes",
        "stalwart / Nodes and GPUs",
        "Which node is sick: cordons, spares, GPU findings, memory per node.",
        [
            Row("Nodes"),
            Panel(
                "Cordoned nodes",
                "stat",
                (Target(f"max(stalwart_cordoned_nodes{{{JOB}}})", "cordoned"),),
                "none",
                "nodes this job places no ranks on",
                w=6,
                h=4,
            ),
            Panel(
                "Spares and standbys ready",
                "stat",
                (
                    Target(f"max(stalwart_spares_ready{{{JOB}}})", "spares"),
                    Target(f"max(stalwart_standbys_ready{{{JOB}}})", "standbys"),
                ),
                "none",
                "warm spare workers, and pre-started processes holding no room "
                "(failure.standby), ready to take a rank",
                w=6,
                h=4,
            ),
            Panel(
                "Memory per node",
                "timeseries",
                (
                    Target(
                        f"sum by (node) (stalwart_rank_memory_bytes{{{JOB}}})",
                        "{{node}}",
                    ),
                ),
                "bytes",
                "resident memory of the job's ranks on each node",
                w=12,
            ),
            Panel(
                "Compute time per node (slowest rank)",
                "timeseries",
                (
                    Target(
                        f"max by (node) (stalwart_rank_compute_seconds{{{JOB}}})",
                        "{{node}}",
                    ),
                ),
                "s",
                "a sick node's ranks compute slower",
                w=12,
            ),
            Panel(
                "Report round trip per node",
                "timeseries",
                (
                    Target(
                        f"max by (node) (stalwart_node_link_round_trip_seconds{{{JOB}}})",
                        "{{node}}",
                    ),
                ),
                "s",
                "the supervisor's report requests to each node's agent, there and back "
                "(health.slow_link): a delayed link stands out here, not in the ranks' "
                "compute time",
                w=12,
            ),
            Panel(
                "TCP segments sent again per node",
                "timeseries",
                (
                    Target(
                        f"max by (node) (stalwart_node_link_retransmit_ratio{{{JOB}}})",
                        "{{node}}",
                    ),
                ),
                "percentunit",
                "the share of the data segments each node sent to other addresses that it "
                "sent again (its kernel's TCP counters, health.slow_link's loss_*): a lossy "
                "link stands out here, where round trips hardly move",
                w=12,
            ),
            Row("GPUs"),
            Panel(
                "GPU findings",
                "bargauge",
                (
                    Target(
                        f"max by (node, gpu, severity) (stalwart_gpu_faults_total{{{JOB}}})",
                        "{{node}} GPU {{gpu}} {{severity}}",
                        instant=True,
                    ),
                ),
                "none",
                "since the job started: fatal (node cordoned), application (rank restarted), "
                "note (reported)",
                w=12,
            ),
            Panel(
                "Xid events by code",
                "bargauge",
                (
                    Target(
                        f"max by (node, gpu, xid) (stalwart_gpu_xid_total{{{JOB}}})",
                        "{{node}} GPU {{gpu}} Xid {{xid}}",
                        instant=True,
                    ),
                ),
                "none",
                "critical Xid events read by the GPU probe since the job started, by code "
                "(docs/health.md; a code's series is born with its first event)",
                w=12,
            ),
            Panel(
                "GPU temperature",
                "timeseries",
                (
                    Target(
                        f"max by (node, gpu) (stalwart_gpu_temperature_celsius{{{JOB}}})",
                        "{{node}} GPU {{gpu}}",
                    ),
                ),
                "celsius",
                "each GPU's core temperature at the probe's readings",
            ),
            Panel(
                "GPU power",
                "timeseries",
                (
                    Target(
                        f"max by (node, gpu) (stalwart_gpu_power_watts{{{JOB}}})",
                        "{{node}} GPU {{gpu}}",
                    ),
                ),
                "watt",
                "each GPU's power draw",
            ),
            Panel(
                "ECC errors and retired pages",
                "timeseries",
                (
                    Target(
                        f"max by (node, gpu) (stalwart_gpu_ecc_uncorrected_errors{{{JOB}}})",
                        "{{node}} GPU {{gpu}} uncorrected ECC",
                    ),
                    Target(
                        f"max by (node, gpu) (stalwart_gpu_retired_pages{{{JOB}}})",
                        "{{node}} GPU {{gpu}} retired pages",
                    ),
                ),
                "short",
                "volatile uncorrected ECC errors (counted as NVML reports them) and retired pages",
            ),
        ],
    )


ALL = {
    "job-overview": job_overview,
    "workers": workers,
    "checkpoints": checkpoints,
    "nodes": nodes,
}

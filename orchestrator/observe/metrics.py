"""The job's Prometheus exporter on the supervisor, and the time accounts behind its goodput.

The metrics' names, types, labels and help texts are data in orchestrator/observe/metric_defs.py
(`DEFINITIONS`); this module builds them into one registry per job, so two jobs' supervisors in
one process never share a series.

Values come from two places: the job's events (state changes, decisions, recoveries,
persisted checkpoints, throughput), fed to `JobMetrics.on_event` as they are emitted, and
`JobMetrics.refresh`, which the supervisor calls after each agent poll with what it knows
(steps, heartbeats, scores, spares, cordons). The exporter binds 127.0.0.1 unless
`metrics.host` says otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from stalwart.health.observations import FailureKind
from stalwart.orchestrator.observe.histogram import BatchHistogram
from stalwart.orchestrator.observe.metric_defs import (
    DEFINITIONS,
    GPU_GAUGES,
    JOB_STATES,
    RECOVERY_OUTCOMES,
    RECOVERY_PHASES,
    TERMINAL_STATES,
)

log = logging.getLogger(__name__)


class Downtime:
    """A job's time accounts, fed its `state` and `recovered` events in order: when it first
    ran, when it ended, and its seconds down recovering. A recovery is down from its failure
    to the first step after the restore (its `recovered` event's longest recovered_after_s:
    detection before the RECOVERING state, restore and first step after it), or for its
    RECOVERING state when that is longer or has not ended. The exporter's goodput and the
    report's (orchestrator/observe/analysis.py) both count with it."""

    def __init__(self) -> None:
        self.first_running: float | None = None
        self.ended: float | None = None
        self._since: float | None = None  # an open RECOVERING state's start
        self._closed = 0.0  # the ended recoveries' seconds down
        self._last_span = 0.0  # the newest ended RECOVERING state's length

    def feed(self, e: Mapping[str, Any]) -> None:
        if e["type"] == "state":
            self._state(e.get("new"), e["ts"])
        elif e["type"] == "recovered":
            values = e.get("recovered_after_s")
            values = values if isinstance(values, list | tuple) else ()
            measured = [x for x in values if isinstance(x, int | float)]
            longest = max(measured, default=0.0)
            self._closed += max(0.0, longest - self._last_span)
            self._last_span = max(self._last_span, longest)

    def _state(self, new: Any, at: float) -> None:
        if new == "RUNNING" and self.first_running is None:
            self.first_running = at
        if new == "RECOVERING" and self._since is None:
            self._since = at
        elif new != "RECOVERING" and self._since is not None:
            self._last_span = at - self._since
            self._closed += self._last_span
            self._since = None
        if new in TERMINAL_STATES and self.ended is None:
            self.ended = at

    def down(self, until: float) -> float:
        """Seconds down recovering up to `until` (an open recovery counts up to it)."""
        return self._closed + (until - self._since if self._since is not None else 0.0)


class JobMetrics:
    """One job's metrics in its own registry, and the HTTP exporter serving them."""

    def __init__(self, job: str):
        self.job = job
        self.registry = CollectorRegistry(auto_describe=True)
        self._m: dict[str, Any] = {}
        for d in DEFINITIONS:
            labels = ("train_job", *d.labels)
            if d.kind == "histogram":
                self._m[d.name] = BatchHistogram(d.name, d.help, labels, d.buckets)
                self.registry.register(self._m[d.name])
            else:
                # prometheus-client adds `_total` to a counter's samples itself.
                name = d.name.removesuffix("_total") if d.kind == "counter" else d.name
                kind = Counter if d.kind == "counter" else Gauge
                self._m[d.name] = kind(name, d.help, labels, registry=self.registry)
            if not d.labels and d.kind != "gauge":
                # Counters and histograms start at 0 (absent would read "never measured");
                # gauges appear once they have a value (a persisted step of 0 would lie).
                self._m[d.name].labels(job)
        # Labelled counters whose label values are known start at 0 too: a series born at 1
        # has no increase() in Prometheus, and the first failure of a kind would not count.
        for kind in FailureKind:
            self._m["stalwart_failures_total"].labels(job, kind.value)
        for outcome in RECOVERY_OUTCOMES:
            self._m["stalwart_recoveries_total"].labels(job, outcome)
        self._children: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._last: dict[tuple[str, Any], float] = {}  # (counter, source) -> counted so far
        self._mean_marks: dict[tuple[str, str, Any], tuple[int, float]] = {}
        self._ranks: set[tuple[str, ...]] = set()
        self._seen_steps: dict[int, int] = {}  # rank -> newest step observed in the histogram
        self._downtime = Downtime()
        self._committed: int | None = None
        self._gpus: set[tuple[str, int]] = set()  # (node, GPU) read so far
        self.goodput: float | None = None  # productive / wall seconds, as of the last refresh
        self.copy_wait_s = 0.0  # stalwart_replication_wait_seconds_total, as of the last refresh
        self.set_state("PENDING")

    def _(self, name: str, *labels: Any) -> Any:
        """The series of metric `name` with these labels (after train_job), cached: a
        16,384-rank job sets ~100,000 series per refresh, and labels() is not cheap."""
        key = (name, *map(str, labels))
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = self._m[name].labels(self.job, *key[1:])
        return series

    # --- exporter -----------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter; returns the port (an ephemeral one for port 0)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- events -------------------------------------------------------------------------------

    def on_event(self, e: Mapping[str, Any]) -> None:
        """Count what one job event says (called for every event, in order)."""
        with self._lock:
            kind = e["type"]
            self._downtime.feed(e)
            if kind == "state":
                self.set_state(e["new"])
                if e["new"] == "FAILED" and e.get("old") == "RECOVERING":
                    self._("stalwart_recoveries_total", "gave_up").inc()
            elif kind == "recovered":
                self._("stalwart_recoveries_total", "recovered").inc()
                for seconds in e.get("recovered_after_s", ()):
                    self._("stalwart_recovery_duration_seconds").observe(seconds)
                phase = "stalwart_recovery_phase_duration_seconds"
                for name, key in (("detect", "detected_after_s"), ("decide", "decided_after_s")):
                    for seconds in e.get(key) or ():
                        if seconds is not None:  # a failure not injected: its start is unknown
                            self._(phase, name).observe(seconds)
                for name, seconds in e.get("phases_s", {}).items():
                    if name in RECOVERY_PHASES:
                        self._(phase, name).observe(seconds)
            elif kind == "persisted":
                self._("stalwart_persisted_step").set(e["step"])
                self._("stalwart_persisted_timestamp_seconds").set(e["ts"])
                if e.get("seconds") is not None:
                    self._("stalwart_checkpoint_duration_seconds", "durable").observe(e["seconds"])
                if e.get("bytes") is not None:
                    self._("stalwart_checkpoint_bytes", "durable").set(e["bytes"])
            elif kind in ("gpu_fatal", "gpu_error", "gpu_note"):
                severity = {"gpu_fatal": "fatal", "gpu_error": "application"}.get(kind, "note")
                self._("stalwart_gpu_faults_total", e["node"], e["gpu"], severity).inc()
            elif kind == "persist_failed":
                self._("stalwart_persist_failures_total").inc()
            elif kind == "straggler":
                self._("stalwart_stragglers_flagged_total").inc()
            elif kind == "slow_link":
                self._("stalwart_slow_links_flagged_total").inc()
            elif kind == "throughput":
                self._("stalwart_steps_per_second").set(e["steps_per_s"])
                committed = e.get("committed_step")
                if committed is not None:
                    if committed != self._committed:
                        self._committed = committed
                        self._("stalwart_committed_timestamp_seconds").set(e["ts"])
                    self._("stalwart_committed_step").set(committed)
                if e.get("commit_lag_steps") is not None:
                    self._("stalwart_commit_lag_steps").set(e["commit_lag_steps"])

    def count_failures(self, kinds: Sequence[str]) -> None:
        """Count failures as the supervisor records them (result.json's `failures`): after
        a decision, with their final kind (a dead worker whose node turns out lost counts
        as node_lost) and without the collective errors that were only a symptom."""
        with self._lock:
            for kind in kinds:
                self._("stalwart_failures_total", kind).inc()

    def set_state(self, state: str) -> None:
        for s in JOB_STATES:
            self._("stalwart_job_state", s).set(1 if s == state else 0)

    def _goodput(self, now: float, redone_s: float) -> tuple[float, float]:
        """(wall, productive) seconds since the job first ran: productive leaves out the
        time spent recovering (each recovery from its failure to the first step after the
        restore, as its `recovered` event measures it, or its RECOVERING state while it
        lasts) and the time of steps that had to be trained again."""
        acct = self._downtime
        if acct.first_running is None:
            return 0.0, 0.0
        end = acct.ended if acct.ended is not None else now
        wall = max(0.0, end - acct.first_running)
        return wall, max(0.0, wall - acct.down(end) - redone_s)

    # --- the supervisor's view ----------------------------------------------------------------

    def refresh(
        self,
        progress: Mapping[str, Any],
        beats: Mapping[int, Mapping[str, Any]],
        scores: Mapping[int, float],
        now: float,
        restarts_left: int | None,
        steps_redone: int,
        replication: Mapping[str, Mapping[str, Any]],
        seconds_per_step: float | None,
    ) -> None:
        """Set what the supervisor knows after an agent poll. `beats`: rank -> the rank's
        newest heartbeat of this generation (with its `node_id`); `replication`: node -> its
        agent's replicator status (cumulative sent_bytes, rounds, seconds);
        `seconds_per_step`: the job's typical step, to price the steps redone."""
        with self._lock:
            # Between generations no rank of the new one has beaten yet: the restore point
            # (the committed step) stands for the step, not 0.
            step = max(progress["step"], progress.get("committed_step") or 0)
            self._("stalwart_step").set(step)
            self._("stalwart_total_steps").set(progress["total_steps"])
            if progress.get("committed_step") is not None:
                self._("stalwart_committed_step").set(progress["committed_step"])
            if progress.get("memory_bytes") is not None:
                self._("stalwart_checkpoint_memory_bytes").set(progress["memory_bytes"])
            self._("stalwart_workers").set(progress["workers"])
            self._("stalwart_generation").set(progress["generation"])
            self._("stalwart_spares_ready").set(progress["spares"])
            self._("stalwart_standbys_ready").set(progress.get("standbys", 0))
            if progress.get("hang_timeout_s") is not None:
                self._("stalwart_hang_timeout_seconds").set(progress["hang_timeout_s"])
            self._("stalwart_cordoned_nodes").set(progress["cordoned"])
            self._("stalwart_restarts_left").set(-1 if restarts_left is None else restarts_left)
            self._count("stalwart_steps_redone_total", steps_redone)
            for node, rep in replication.items():
                self._count("stalwart_replication_sent_bytes_total", rep.get("sent_bytes", 0), node)
                self._observe_mean("peer", node, rep.get("rounds", 0), rep.get("seconds", 0.0))
            wall, productive = self._goodput(now, steps_redone * (seconds_per_step or 0.0))
            # Nothing trained yet (a job that failed at step 0): no goodput, not 100 %.
            self.goodput = round(productive / wall, 4) if wall > 0 and step > 0 else None
            # High-water marks: productive seconds may drop (steps redone are priced when a
            # recovery reports them), a counter may not, and nothing here counts from 0 again.
            self._count_up("stalwart_wall_seconds_total", wall)
            self._count_up("stalwart_productive_seconds_total", productive)
            means: dict[str, list[float]] = {}
            ranks = set()
            snapshot_bytes = 0
            cycles: list[float] = []  # step cycle times not observed yet
            for rank, b in beats.items():
                node = b.get("node_id") or ""
                ranks.add((str(rank), node))
                self._("stalwart_heartbeat_age_seconds", rank).set(
                    max(0.0, now - b.get("received_at", now))
                )
                if b.get("compute_seconds") is not None:
                    self._("stalwart_rank_compute_seconds", rank, node).set(b["compute_seconds"])
                if b.get("collective_seconds") is not None:
                    self._("stalwart_rank_collective_wait_seconds", rank, node).set(
                        b["collective_seconds"]
                    )
                if b.get("rss_bytes") is not None:
                    self._("stalwart_rank_memory_bytes", rank, node).set(b["rss_bytes"])
                for key in ("samples", "tokens"):
                    # Per rank: a replaced rank's new process counts from 0 again.
                    self._count(f"stalwart_{key}_total", float(b.get(key) or 0.0), rank)
                for name, value in (b.get("metrics") or {}).items():
                    means.setdefault(name, []).append(float(value))
                snap = b.get("snapshot") or {}
                if snap:
                    # Per process: a replaced rank's new process counts from 0 again.
                    self._observe_mean(
                        "memory",
                        (rank, b.get("pid")),
                        snap.get("captures", 0),
                        snap.get("capture_seconds", 0.0) + snap.get("handover_seconds", 0.0),
                    )
                    snapshot_bytes += snap.get("last_bytes") or 0
                newest = self._seen_steps.get(rank, -1)
                for step, _compute, cycle in b.get("recent", ()):
                    if step > newest:
                        cycles.append(cycle)
                        newest = step
                self._seen_steps[rank] = newest
            self._("stalwart_step_duration_seconds").observe_many(cycles)
            # The ranks wait for their copies together (the next collective joins them): the
            # job waited as long as its longest-waiting rank.
            waited = [
                self._growth("copy_wait", (rank, b.get("pid")), b.get("copy_wait_seconds") or 0.0)
                for rank, b in beats.items()
            ]
            self._("stalwart_replication_wait_seconds_total").inc(max(waited, default=0.0))
            self.copy_wait_s += max(waited, default=0.0)
            for name, values in means.items():
                self._("stalwart_train_metric", name).set(sum(values) / len(values))
            if snapshot_bytes:
                self._("stalwart_checkpoint_bytes", "memory").set(snapshot_bytes)
            for rank, score in scores.items():
                self._("stalwart_straggler_score", rank).set(score)
            # Ranks gone with a resize or a replacement on another node: drop their series.
            for rank, node in self._ranks - ranks:
                for name in (
                    "stalwart_rank_compute_seconds",
                    "stalwart_rank_collective_wait_seconds",
                    "stalwart_rank_memory_bytes",
                ):
                    self._remove(name, rank, node)
            self._ranks = ranks

    def gpu_readings(
        self, node: str, gpus: Sequence[Mapping[str, Any]], gauges: bool = True
    ) -> None:
        """Set one node's GPU probe readings (the agent's report: each GPU's newest reading
        and the Xid codes read since the previous report). Xids are always counted;
        `gauges` False leaves out the readings (a CPU node's stand-in probe has no GPU to
        read). A pseudo-GPU with a negative index (an Xid of an unknown GPU) only counts."""
        with self._lock:
            for g in gpus:
                index = g["index"]
                for xid in g.get("xids") or ():
                    self._("stalwart_gpu_xid_total", node, index, xid).inc()
                if not gauges or index < 0:
                    continue
                self._gpus.add((node, index))
                for name, key in (
                    ("stalwart_gpu_temperature_celsius", "temperature_c"),
                    ("stalwart_gpu_power_watts", "power_w"),
                ):
                    if g.get(key) is not None:
                        self._(name, node, index).set(g[key])
                    else:  # lost or unreadable: no reading rather than a stale one
                        self._remove(name, node, str(index))
                self._("stalwart_gpu_ecc_uncorrected_errors", node, index).set(
                    g.get("ecc_uncorrected") or 0
                )
                self._("stalwart_gpu_retired_pages", node, index).set(g.get("retired_pages") or 0)
                self._("stalwart_gpu_up", node, index).set(
                    0 if g.get("lost") or g.get("error") else 1
                )

    def link_round_trips(self, rtt_s: Mapping[str, float]) -> None:
        """Each judged node's round trip (health/slow_link.py's window mean)."""
        with self._lock:
            for node, seconds in rtt_s.items():
                self._("stalwart_node_link_round_trip_seconds", node).set(seconds)

    def link_losses(self, rates: Mapping[str, float]) -> None:
        """Each node's share of the data segments it sent again in the last window (its
        own TCP counters, every peer: supervisor/losses.py)."""
        with self._lock:
            for node, rate in rates.items():
                self._("stalwart_node_link_retransmit_ratio", node).set(rate)

    def forget_node(self, node: str) -> None:
        """A lost node: its GPUs' readings and its round trip go (their counters stay, as
        history)."""
        with self._lock:
            self._remove("stalwart_node_link_round_trip_seconds", node)
            self._remove("stalwart_node_link_retransmit_ratio", node)
            for n, index in [k for k in self._gpus if k[0] == node]:
                for name in GPU_GAUGES:
                    self._remove(name, n, str(index))

    def _observe_mean(self, tier: str, source: Any, count: int, seconds: float) -> None:
        """Observe the checkpoints of `tier` that `source`'s cumulative (count, seconds)
        grew by since the last call, each at their mean duration."""
        key = ("checkpoint", tier, source)
        before_n, before_s = self._mean_marks.get(key, (0, 0.0))
        if count < before_n:
            before_n, before_s = 0, 0.0  # a new process or agent counting from 0 again
        self._mean_marks[key] = (count, seconds)
        new = count - before_n
        if new > 0:
            mean = max(0.0, seconds - before_s) / new
            self._("stalwart_checkpoint_duration_seconds", tier).observe_n(mean, new)

    def _count(self, name: str, cumulative: float, source: Any = None) -> None:
        """Advance a counter by what `source`'s cumulative value grew (`_growth`)."""
        grown = self._growth(name, source, cumulative)
        if grown > 0:
            self._(name).inc(grown)

    def _growth(self, name: str, source: Any, cumulative: float) -> float:
        """How much `source`'s cumulative value grew since the last call; a value that went
        down (a new process or agent counting from 0 again) counts from 0."""
        before = self._last.get((name, source), 0.0)
        self._last[(name, source)] = cumulative
        return cumulative - before if cumulative >= before else cumulative

    def _count_up(self, name: str, value: float) -> None:
        """Advance a counter to `value` if it is higher than what was counted so far."""
        before = self._last.get((name, None), 0.0)
        if value > before:
            self._(name).inc(value - before)
            self._last[(name, None)] = value

    def _remove(self, name: str, *labels: str) -> None:
        self._children.pop((name, *labels), None)
        with contextlib.suppress(KeyError):
            self._m[name].remove(self.job, *labels)

"""The job's record: failures and how each was recovered (with phase timings), the recovery in
progress, elastic resizes, node incidents, throughput, the error that ended the job, and
result.json's content.

It only records: it is told what happened, writes events and computes figures, and calls
nobody but the event log and the metrics.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.health.policy import NODE_CLASSES, per_rank
from stalwart.orchestrator.chaos.faults import FaultBook, describe
from stalwart.orchestrator.observe.metrics import JobMetrics
from stalwart.orchestrator.state import JobState
from stalwart.orchestrator.supervisor.monitor import HealthMonitor
from stalwart.orchestrator.supervisor.startup import StartupClock

PROCESS_FAULTS = ("kill_worker", "hang")  # chaos faults that hit one process, not its node
THROUGHPUT_EVENT_S = 1.0  # how often a throughput event is written
RANK_TIMES_MAX = 64  # ranks whose step times a throughput event carries, at most


class Ledger:
    def __init__(
        self,
        metrics: JobMetrics,
        faults: FaultBook,
        emit: Callable[..., None],
        clock: StartupClock | None = None,
    ):
        self.metrics = metrics
        self.clock = clock or StartupClock()  # the cold start (supervisor/startup.py)
        self.faults = faults
        self._emit = emit
        self.failures: list[dict[str, Any]] = []
        self.open_recovery: dict[str, Any] | None = None
        self.resizes: list[dict[str, Any]] = []  # elastic shrinks and grows
        self.incidents: list[tuple[str, float]] = []  # (node, when): one per node per recovery
        self.error: dict[str, Any] | None = None  # what ended the job, when it failed
        self.started_at = time.time()
        self.running_since: float | None = None
        self.ended_at: float | None = None
        self.last_rate: float | None = None  # steps/s of the newest throughput event
        self._mark: tuple[float, int] | None = None  # (when, step) of the last rate

    # --- failures and recoveries ------------------------------------------------------------

    def note_incidents(self, failures: list[WorkerFailure], lost: set[str], now: float) -> None:
        """Nodes the failures blame (the policy's flapping rule counts them). A process a
        chaos fault killed or hung says nothing about its node."""
        blamed = {
            f.node
            for f in failures
            if f.node and f.failure_class in NODE_CLASSES and not self._process_fault(f)
        }
        self.incidents.extend((n, now) for n in blamed if n not in lost)

    def _process_fault(self, f: WorkerFailure) -> bool:
        fault = self.faults.explaining(f)
        return fault is not None and fault["kind"] in PROCESS_FAULTS

    def fail(self, message: str, root: WorkerFailure | None = None) -> None:
        """The job failed: why, and the failure a user can act on (if there is one)."""
        self.error = {"message": message}
        if root is not None:
            self.error.update(
                rank=root.rank,
                kind=root.kind.value,
                error_type=root.error_type,
                traceback=root.traceback,
                output_tail=list(root.output_tail),
            )

    def record_failures(
        self,
        failures: list[WorkerFailure],
        restored_step: int | None,
        decided_at: float,
        reached: int,
        fatal: bool = False,
    ) -> list[dict[str, Any]]:
        """One entry per failed rank (a collective error beside a root cause is its symptom,
        not a failure of its own), with the chaos fault that caused it if one did; `reached`:
        the newest step any rank reached; `fatal`: the job ends with them (nothing is
        redone). A divergence is one entry however many ranks' guards reported it. Returns
        the new entries."""
        used = []
        recorded = len(self.failures)
        for f in _incidents(failures):
            if f.kind is FailureKind.COMM_ERROR and any(
                g.kind is not FailureKind.COMM_ERROR for g in failures
            ):
                continue
            fault = self.faults.explaining(f)
            if fault is not None:
                used.append(fault)
            t_fail = fault["at"] if fault else None
            # How far the job had come: a failure's own step counts (when every rank was
            # replaced, no live rank remembers it).
            high = max(reached, fault["step"] if fault else (f.step or 0))
            self.failures.append(
                {
                    "kind": f.kind.value,
                    "rank": f.rank,
                    "node": f.node,
                    "step": fault["step"] if fault else f.step,
                    "injected": fault is not None,
                    "error_type": f.error_type,
                    "failure_class": f.failure_class.value,
                    "message": describe(f, fault),
                    "failed_at": t_fail,
                    "detected_at": f.at,
                    "detected_after_s": round(f.at - t_fail, 4) if t_fail else None,
                    # A failure the release surfaced joins the recovery already decided:
                    # decided when it was seen.
                    "decided_after_s": round(max(decided_at - f.at, 0.0), 4),
                    "restored_step": restored_step,
                    # Restarted from step 0 (no restore point): every step is redone.
                    "steps_redone": None if fatal else max(high - (restored_step or 0), 0),
                    "fault_index": fault["index"] if fault else None,
                    "recovered_after_s": None,
                }
            )
        new = self.failures[recorded:]
        self.metrics.count_failures([f["kind"] for f in new])
        self.faults.consume(used)
        return new

    def open(self, generation: int, failures: list[dict[str, Any]], **details: Any) -> None:
        """A recovery into `generation` began; it closes at that generation's first step.
        `details`: phases (so far), decided_at, restore_step, replaced, from_spares. The
        failures of a recovery a new failure interrupted (its generation never stepped on
        every rank) are recovered when this one is."""
        prior = self.open_recovery["failures"] if self.open_recovery else []
        self.open_recovery = {
            "generation": generation,
            "failures": [*prior, *failures],
            **details,
        }

    def close_recovery(
        self,
        generation: int,
        beats: list[Mapping[str, Any]],
        ranks: int,
        restore_tiers: dict[str, int],
        restored_remotely: dict[int, str],
    ) -> None:
        """Once all `ranks` of `generation` (their heartbeats: `beats`) took a step, the open
        recovery is over: its phases and times go to its failures and a `recovered` event
        (the first generation's: the cold start's, a `startup` event)."""
        self.close_startup(generation, [b.get("timings", {}) for b in beats], ranks)
        rec = self.open_recovery
        if rec is None or rec["generation"] != generation or len(beats) < ranks:
            return
        timings = [b.get("timings", {}) for b in beats]
        if not all("first_step_done" in t for t in timings):
            return
        started = min(t["started"] for t in timings)
        rdzv = max(t.get("rendezvous_done", started) for t in timings)
        entered = max(t.get("setup_done", rdzv) for t in timings)
        restored = max(t.get("restored", entered) for t in timings)
        first = max(t["first_step_done"] for t in timings)
        phases = dict(rec["phases"])
        # reenter: the train loop's own set-up until ctx.steps(); restore: fetch + load.
        phases.update(
            rendezvous=rdzv - started,
            reenter=entered - rdzv,
            restore=restored - entered,
            first_step=first - restored,
        )
        self.faults.settle()
        for f in rec["failures"]:
            origin = f["failed_at"] or f["detected_at"]
            f["recovered_after_s"] = round(first - origin, 4)
            f["phases_s"] = {k: round(v, 4) for k, v in phases.items()}
            f["phases_s"]["detect"] = f["detected_after_s"]
            f["phases_s"]["decide"] = f["decided_after_s"]
            # What no phase measures (the fresh poll, an earlier recovery this one
            # continued): the phases sum to the recovery time, in the table and the figure.
            counted = sum(v for v in f["phases_s"].values() if v is not None)
            f["phases_s"]["other"] = round(max(f["recovered_after_s"] - counted, 0.0), 4)
            f["restore_tiers"] = dict(restore_tiers)
            # The whole record, for a successor supervisor to carry on (the driver keeps
            # them): a supervisor restart loses no failure from the job's account.
            self._emit("failure_closed", record=dict(f))
        self._emit(
            "recovered",
            generation=generation,
            restore_step=rec["restore_step"],
            replaced=rec["replaced"],
            from_spares=rec["from_spares"],
            restore_tiers=restore_tiers,
            restored_remotely=restored_remotely,
            phases_s={k: round(v, 4) for k, v in phases.items()},
            recovered_after_s=[f["recovered_after_s"] for f in rec["failures"]],
            # Per failure: from the failure (when known) to its detection, and to the decision.
            detected_after_s=[f["detected_after_s"] for f in rec["failures"]],
            decided_after_s=[f["decided_after_s"] for f in rec["failures"]],
        )
        self.open_recovery = None

    def close_startup(self, generation: int, timings: list[Mapping[str, Any]], ranks: int) -> None:
        """The cold start ends at the first generation's first step on every rank."""
        startup = self.clock.close(generation, timings, ranks)
        if startup is not None:
            self._emit("startup", **startup)

    def carry(self, adopt: Mapping[str, Any]) -> None:
        """What a supervisor that died had recorded: the failures it closed
        (failure_closed), when the job started and how its cold start went."""
        self.failures = [*adopt.get("failures", []), *self.failures]
        self.started_at = adopt.get("started_at", self.started_at)
        if adopt.get("startup"):
            self.clock.closed = dict(adopt["startup"])

    def resized(self, old: int, new: int, reason: str, **extra: Any) -> None:
        entry = {"at": time.time(), "from": old, "to": new, "reason": reason}
        self.resizes.append({**entry, **extra})
        self._emit("resized", old=old, new=new, reason=reason, **extra)

    # --- throughput -------------------------------------------------------------------------

    def new_generation(self) -> None:
        self._mark = None
        self.last_rate = None  # the rate of a generation that is gone

    def throughput(
        self,
        now: float,
        progress: Mapping[str, Any],
        monitor: HealthMonitor,
        ranks: int,
        on_steady: Callable[[float], None],
    ) -> None:
        """Every THROUGHPUT_EVENT_S a `throughput` event: steps/s, commit lag, loss and the
        per-rank step times; `on_steady(rate)` gets the steady rate (the replica stride
        wants it: the median step of the last 10, as a 1 s window of 1 s steps sees 0 or
        2 of them)."""
        # Until a rank of a new generation has beaten, the progress step reads 0: the
        # restore point stands for it (else the first interval counts every step since 0).
        step = max(progress["step"], progress["committed_step"] or 0)
        mark = self._mark
        if mark is None:
            self._mark = (now, step)
            return
        if now - mark[0] < THROUGHPUT_EVENT_S:
            return
        rate = (step - mark[1]) / (now - mark[0])
        steady = monitor.steps_per_s(step - 1, 10)
        if steady:
            on_steady(steady)
        committed = progress["committed_step"]
        loss = progress["loss"]
        self.last_rate = round(rate, 3)
        self._emit(
            "throughput",
            generation=progress["generation"],
            step=step,
            steps_per_s=round(rate, 3),
            committed_step=committed,
            # Steps a loss of `copies - 1` nodes would cost now (replication lag incl.).
            commit_lag_steps=step - committed if committed is not None else None,
            memory_bytes=progress.get("memory_bytes"),
            loss=None if loss is None else round(loss, 6),
            # rank -> median compute seconds of its steps in this interval (the report's
            # per-rank heatmap; the exporter has only the newest step's).
            **_rank_times(monitor, mark[1], step, ranks),
        )
        self._mark = (now, step)

    # --- the result -------------------------------------------------------------------------

    def result(
        self,
        state: JobState,
        outs: list[dict[str, Any]],
        step: int,
        total_steps: int,
        **parts: Any,
    ) -> dict[str, Any]:
        """result.json: `outs` are the ranks' last outcomes, `step` the newest step reached;
        `parts` are the other collaborators' figures, in result.json's order."""
        losses = [o["metrics"]["loss"] for o in outs if "loss" in o.get("metrics", {})]
        # The job's model: rank 0's (with DDP's broadcast_buffers, its buffers are the
        # ones every rank takes at the next forward).
        digests = [o["digest"] for o in sorted(outs, key=lambda o: o["rank"]) if o.get("digest")]
        end = self.ended_at or time.time()
        run_s = end - (self.running_since or end)
        samples = sum(o.get("samples", 0.0) for o in outs)
        succeeded = state is JobState.SUCCEEDED and run_s > 0
        p = parts
        # A job too short for a poll to see every rank's first step: their outcomes' timings.
        self.close_startup(p["generations"], [o.get("timings", {}) for o in outs], p["workers"])
        return {
            "name": p["name"],
            "metrics_url": p["metrics_url"],
            "status": {
                JobState.SUCCEEDED: "succeeded",
                JobState.FAILED: "failed",
                JobState.CANCELLED: "cancelled",
            }.get(state, state.value.lower()),
            "steps_completed": max([o["step"] for o in outs] + [step]),
            "total_steps": total_steps,
            "final_loss": sum(losses) / len(losses) if losses else None,
            "model_digest": digests[0] if digests else None,
            # Rank 0's, per registered object (model, optimizer, EMA, data position, ...).
            "object_digests": next(
                (
                    o["object_digests"]
                    for o in sorted(outs, key=lambda o: o["rank"])
                    if o.get("object_digests")
                ),
                {},
            ),
            "workers": p["workers"],
            "resizes": self.resizes,
            "generations": p["generations"],
            "restarts": p["restarts"],
            "failures": self.failures,
            "lost_steps_total": sum(f["steps_redone"] or 0 for f in self.failures),
            "wall_seconds": round(end - self.started_at, 3),
            "training_seconds": round(run_s, 3),
            # productive / wall seconds since the job first ran (docs/metrics.md, goodput)
            "goodput": p["goodput"],
            "steps_per_second": round(total_steps / run_s, 3) if succeeded else None,
            "samples_per_second": round(samples / run_s, 3) if succeeded else None,
            "committed_step": p["committed_step"],
            "cordoned": p["cordoned"],
            "lost_nodes": p["lost_nodes"],
            "stragglers": p["stragglers"],
            "slow_links": p["slow_links"],
            "checkpoint": pipeline_summary(outs),
            "replication": p["replication"],
            "persist": p["persist"],
            "resumed_from": p["resumed_from"],
            "supervisor_restarts": p["supervisor_restarts"],
            # From the driver's start to the first step, by phase (supervisor/startup.py).
            "startup": self.clock.summary(),
            "error": self.error,
        }


def _rank_times(monitor: HealthMonitor, after: int, through: int, ranks: int) -> dict[str, Any]:
    """A throughput event's per-rank view: rank -> median compute seconds of its steps in
    the interval, for at most RANK_TIMES_MAX ranks (the slowest: a 16,384-rank job would
    otherwise log a megabyte a second), and how many ranks there are."""
    times = monitor.rank_step_times(after, through)
    median = round(statistics.median(times.values()), 6) if times else None
    if len(times) > RANK_TIMES_MAX:
        times = dict(sorted(times.items(), key=lambda kv: kv[1])[-RANK_TIMES_MAX:])
    return {
        "rank_compute_s": {str(r): t for r, t in sorted(times.items())},
        "compute_median_s": median,  # over every rank: what the slowest compare with
        "ranks_total": ranks,
    }


def pipeline_summary(outs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ranks' snapshot pipelines, summed: snapshots, their size and mean costs."""
    stats = [o["pipeline"] for o in outs if o.get("pipeline")]
    if not stats:
        return None
    caps = sum(s["captures"] for s in stats)

    def mean_ms(key: str) -> float | None:
        return round(1000 * sum(s[key] for s in stats) / caps, 3) if caps else None

    return {
        "snapshots": caps,
        "bytes_per_snapshot": max(s["last_bytes"] for s in stats),
        "capture_ms_mean": mean_ms("capture_seconds"),
        "wait_ms_mean": mean_ms("wait_seconds"),
        "handover_ms_mean": mean_ms("handover_seconds"),
        "errors": sum(s["errors"] for s in stats),
    }


def _incidents(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """One failure per rank, except a replica divergence: every rank's guard finds the same
    difference in the same collective, so it is one failure of the job (the first report),
    however many ranks' reports reached the decision."""
    ranks = per_rank(failures)
    diverged = [f for f in ranks if f.kind is FailureKind.REPLICA_DIVERGENCE]
    if len(diverged) < 2:
        return ranks
    first = min(diverged, key=lambda f: f.at)
    return [f for f in ranks if f.kind is not FailureKind.REPLICA_DIVERGENCE or f is first]

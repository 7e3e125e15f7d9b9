"""The job supervisor: one Ray actor per job, an explicit state machine whose loop executes
decisions.

It owns the collaborators and is the only one that sets the job's state: each tick polls
the agents (detect), hands failures to health.policy.decide, and a RECOVERING state carries
the decision to recovery, whose steps say how they ended. It decides nothing itself.

    SCHEDULING: pool.schedule -> preflight.check_and_move -> the first generation
    RUNNING:    generation.collect + detection -> failures -> decide -> RECOVERING (or FAILED)
    RECOVERING: recovery.replace -> a fresh poll -> recovery.roll_back -> the next
                generation -> RUNNING
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import ray

from stalwart.ckpt.durable import Manifest
from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.health.policy import Action, Decision, decide
from stalwart.orchestrator.chaos.faults import FaultBook, InjectRefused
from stalwart.orchestrator.events import EventLog
from stalwart.orchestrator.observe.discovery import TargetFile
from stalwart.orchestrator.observe.metrics import JobMetrics
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.state import JobState, StateMachine, Transition
from stalwart.orchestrator.supervisor.checkpoints import Checkpoints
from stalwart.orchestrator.supervisor.detect import Detection
from stalwart.orchestrator.supervisor.elastic import Elastic
from stalwart.orchestrator.supervisor.fencing import CallerFence
from stalwart.orchestrator.supervisor.generation import Generation
from stalwart.orchestrator.supervisor.lease import LeaseKeeper
from stalwart.orchestrator.supervisor.ledger import Ledger
from stalwart.orchestrator.supervisor.output import OutputLog
from stalwart.orchestrator.supervisor.pool import WorkerPool
from stalwart.orchestrator.supervisor.preflight import Preflight
from stalwart.orchestrator.supervisor.progress import progress_of
from stalwart.orchestrator.supervisor.recovery import Recovering, Recovery
from stalwart.orchestrator.supervisor.resources import SchedulingError

log = logging.getLogger(__name__)

FINAL_REPLICATION_S = 10.0  # a finished job waits this long for its last step's copies
METRICS_REFRESH_S = 0.5  # the exporter's values are at most this old (plus a poll)...
METRICS_DUTY = 0.1  # ...unless refreshing them would take more of the supervisor's time


class JobSupervisor:
    def __init__(
        self,
        spec: dict[str, Any],
        base_dir: str | None = None,
        resume: str = "auto",
        store_key: str | None = None,
        adopt: dict[str, Any] | None = None,
        owned_cluster: bool = False,
        driver_marks: dict[str, float] | None = None,
    ):
        """`adopt`: this supervisor replaces one that died ({"restarts": n}); it takes the
        job back from the node agents of `store_key`, which outlived it. `owned_cluster`:
        the command started this cluster (a chaos kill_node may kill whole raylets).
        `driver_marks`: when the driver started, had Ray, asked for this actor."""
        self.spec = JobSpec.model_validate(spec)
        self.resume = resume  # "auto", "never" or a step number (whole-job resume)
        self.adopt = adopt
        self.supervisor_restarts = adopt["restarts"] if adopt else 0
        self.store_key = store_key or f"{self.spec.name}-{uuid.uuid4().hex[:12]}"
        self.home_node = ray.get_runtime_context().get_node_id()
        self.events = EventLog()
        self.output = OutputLog()
        self.metrics = JobMetrics(self.spec.name)
        self.events.subscribe(self.metrics.on_event)
        self.metrics_url: str | None = None
        self._target: TargetFile | None = None  # metrics.file_sd_dir
        self._metrics_at = 0.0  # when the metrics were last refreshed
        self._metrics_cost = 0.0  # seconds the last refresh took
        self.sm = StateMachine()
        self.sm.add_hook(self._on_transition)
        self._lock = threading.Lock()  # the loop's state that other actor threads read
        self._cancel = threading.Event()
        self._commit_seen = threading.Condition()  # notified after each round of reports
        self.pending: list[WorkerFailure] = []  # failures awaiting a decision
        spec_, emit = self.spec, self.events.emit
        self.owned_cluster = owned_cluster
        self.faults = FaultBook(spec_.chaos.faults, "raylet" if owned_cluster else "job")
        self.pool = WorkerPool(spec_, self.store_key, base_dir, emit)
        self.pool.clock.driver = dict(driver_marks or {})
        self.gen = Generation(spec_, self.pool, emit)
        self.callers = CallerFence(lambda: self.pool.worker_info, lambda: self.gen.number, emit)
        self.preflight = Preflight(spec_, self.pool, self.faults, emit)
        self.ckpt = Checkpoints(spec_, self.pool, emit, incarnation=self.supervisor_restarts)
        self.detect = Detection(spec_, self.pool, self.ckpt, self.metrics, emit, self._lock)
        self.ledger = Ledger(self.metrics, self.faults, emit, self.pool.clock)
        self.elastic = Elastic(
            spec_, self.pool, self.preflight, self.detect, self.ckpt, self.ledger, emit
        )
        self.recovery = Recovery(
            spec_,
            self.pool,
            self.gen,
            self.preflight,
            self.detect,
            self.ckpt,
            self.elastic,
            self.ledger,
            emit,
        )
        self.faults.wire(self.pool, self.ckpt, self._reached, self.record_fault)
        if adopt:  # what the dead supervisor's account held (the driver kept its events)
            self.ledger.carry(adopt)
            self.recovery.restarts = adopt.get("recoveries", 0)

    # --- public API (called by the driver, the CLI and the workers) --------------------------

    def run(self) -> dict[str, Any]:
        self.pool.supervisor = ray.get_runtime_context().current_actor
        threading.Thread(target=_import_torch_distributed, args=(self.spec,), daemon=True).start()
        self._start_exporter()
        leases = LeaseKeeper(lambda: list(self.pool.agents.values()))
        leases.start()
        try:
            self._set(JobState.SCHEDULING, f"placing {self.pool.world} workers")
            if self.adopt:
                self._adopt()
            self.pool.schedule(adopted=bool(self.adopt))
            self.preflight.check_and_move(list(range(self.pool.world)), initial=True)
            self.pool.scheduled(self.home_node)
            memory = self._adopted_restore_point() if self.adopt else None
            # Generations count on from a dead supervisor's (agents fence older ones).
            self.gen.number = max(self.gen.number, self.ckpt.fence)
            durable = self.ckpt.resume_point(self.resume) if memory is None else None
            self._launch(
                memory if memory is not None else (durable.step if durable else None), durable
            )
            self.ledger.running_since = time.time()
            self._set(JobState.RUNNING, f"generation {self.gen.number} started")
            while not self.sm.state.terminal:
                if self._cancel.is_set():
                    self.gen.abort_all("job cancelled")
                    self._set(JobState.CANCELLED, "cancelled by the user")
                    break
                self._tick()
        except SchedulingError as e:
            self.ledger.fail(str(e))
            self._set(JobState.FAILED, str(e))
        except Exception as e:
            log.exception("supervisor failed")
            self.ledger.fail(f"supervisor error: {type(e).__name__}: {e}")
            if not self.sm.state.terminal:
                self._set(JobState.FAILED, self.ledger.error["message"])
        finally:
            leases.stop()
            self.detect.ray_nodes.close()
            self.detect.raylets.close()
            self.ledger.ended_at = time.time()
            try:
                self._refresh_metrics()  # the final values, for the last scrapes
            except Exception:
                log.exception("final metrics refresh failed")
            self.pool.teardown(self.elastic.waiting())
            self.gen.close()
            TargetFile.retire(self._target, self.spec.metrics.linger_s)  # as the driver lingers
        return self.result()

    def poll(self, since: int = 0, output_since: int | None = None) -> dict[str, Any]:
        """Events from number `since` on, the progress, and (with `output_since`) the
        lines the ranks printed from that number on."""
        update = {
            "events": self.events.since(since),
            "events_missed": self.events.missed(since),
            "progress": self.progress(),
        }
        if output_since is not None:
            update["output"] = self.output.since(output_since)
        return update

    def record_warning(self, rank: int, message: str, who: dict | None = None) -> None:
        """A rank found state a recovery would lose (worker/exactness.py); `who`: the caller."""
        if not self.callers.refuses(who, "an exactness warning"):
            self.events.emit("exactness_warning", rank=rank, reason=message)

    def cancel(self) -> None:
        self._cancel.set()

    def record_fault(self, fault: dict[str, Any], who: dict | None = None) -> bool:
        """A worker is about to carry out a chaos fault (called before it does). False: the
        caller was replaced, and does not carry it out."""
        if self.callers.refuses(who, f"chaos fault {fault.get('index')} ({fault.get('kind')})"):
            return False
        self.faults.record(fault)
        self.events.emit("fault_injected", **fault)
        return True

    def inject(self, request: dict[str, Any]) -> dict[str, Any]:
        """`stalwart chaos inject`: a fault fired before its rank's next step, logged with who
        asked (`by`), what and when. Returns {"fault": ...} or {"error": why}."""
        step = self._step()  # takes self._lock itself
        try:
            with self._lock:
                fault = self.faults.add_live(
                    request, step, self.spec, self.owned_cluster, self.pool.ranks_on, self.sm.state
                )
        except InjectRefused as e:
            return {"error": str(e), "retry": e.retry}
        self.events.emit("fault_requested", **fault, by=request.get("by"))
        if fault["rank"] in self.pool.workers:  # else the rank's next worker carries it
            self.pool.workers[fault["rank"]].add_fault.remote(fault)
        return {"fault": fault}

    def await_commit(self, at_step: int, timeout_s: float, durable: bool = False) -> int | None:
        """Chaos after_commit (after_persist: `durable`): return once the step that
        Checkpoints.restore_point names is committed, the agents asked to copy it first
        (persisted), or at the deadline; that step then. Called by the fault's worker."""
        self.ckpt.plan.require(self.ckpt.restore_point(at_step, False)[0])
        wanted, point = self.ckpt.restore_point(at_step, durable)
        deadline = time.monotonic() + timeout_s
        with self._commit_seen:
            while (done := point()) is None or done < wanted:
                left = deadline - time.monotonic()
                if left <= 0 or self.sm.state.terminal:
                    break
                self._commit_seen.wait(left)
        return point()

    def storage_outage(self, seconds: float, who: dict | None = None) -> None:
        """Chaos storage_unavailable (called by the worker carrying out the fault)."""
        if not self.callers.refuses(who, "a storage outage"):
            self.ckpt.storage_outage(seconds)

    def store_key_of(self) -> str:
        """Which job run this is (node agents check their supervisor by it)."""
        return self.store_key

    def uncordon(self, node: str) -> bool:
        """Let `node` get ranks of this job again (`stalwart uncordon`)."""
        with self._lock:
            gone = self.pool.bad.cordons.uncordon(node)
        if gone is not None:
            self.events.emit("uncordoned", node=node, reason="by the user")
        return gone is not None

    def cordoned(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return self.pool.bad.cordoned(time.time())

    def progress(self) -> dict[str, Any]:
        return progress_of(self)

    def result(self) -> dict[str, Any]:
        ckpt = self.ckpt
        return self.ledger.result(
            self.sm.state,
            [self.gen.finished[r] for r in sorted(self.gen.finished)],
            self._step(),
            self.spec.steps,
            name=self.spec.name,
            metrics_url=self.metrics_url,
            workers=self.pool.world,
            generations=self.gen.number,
            restarts=self.recovery.restarts,
            goodput=self.metrics.goodput,
            committed_step=ckpt.commit.committed,
            cordoned=self.pool.bad.log,
            lost_nodes=sorted(self.pool.bad.lost),
            stragglers=self.detect.flags,
            slow_links=self.detect.link_flags,
            replication=ckpt.replication_summary(self.metrics.copy_wait_s),
            persist=ckpt.persister.summary() if ckpt.persister else None,
            resumed_from=ckpt.resumed_from,
            supervisor_restarts=self.supervisor_restarts,
        )

    # --- state --------------------------------------------------------------------------------

    def _set(self, state: JobState, reason: str, context: Any = None) -> Transition:
        return self.sm.set(state, reason, context)

    def _on_transition(self, t: Transition) -> None:
        self.events.emit("state", old=t.old.value, new=t.new.value, reason=t.reason)

    # --- the control loop ---------------------------------------------------------------------

    def _tick(self) -> None:
        if self.sm.state is JobState.RECOVERING:
            self._recover(self.sm.context)
            return
        self.preflight.check_spares()
        self.pool.keep_warm(trained=self.ckpt.commit.committed is not None)
        grow = self.elastic.check_growth()
        if grow:
            reason = (
                f"capacity returned: growing from {self.pool.world} to "
                f"{self.pool.world + len(grow)} ranks"
            )
            work = Recovering(Decision(Action.RESTART_GROUP), reason, [], grow=grow)
            self._set(JobState.RECOVERING, reason, work)
            return
        for ref in self.gen.ready(timeout_s=0.05):
            failure = self.gen.collect(ref, self.detect.beats)
            if failure is not None:
                self.pending.append(failure)
        interval = self.spec.health.report_interval_s
        if time.time() - self.detect.poller.last_poll >= interval or self.pending:
            self._poll()
            self._detect()
            # What memory holds changes only with a poll: so does what can be persisted.
            self.ckpt.maybe_persist(self.sm.state is JobState.RUNNING, self._step())
        if self.pending:
            self._handle_failures()
            if self.sm.state is JobState.RECOVERING:
                return  # the next tick recovers, before anything else (a metrics refresh)
        elif self.gen.done:
            self._finish()
        # At 16,384 ranks a refresh costs ~0.3 s: spacing refreshes by 1/METRICS_DUTY of
        # their cost keeps the exporter from taking the control loop's time.
        if time.time() - self._metrics_at >= max(
            METRICS_REFRESH_S, self._metrics_cost / METRICS_DUTY
        ):
            self._refresh_metrics()

    def _poll(self, wait_s: float = 0.0) -> None:
        """One round of agent reports, absorbed by everyone who keeps what they say."""
        n = self.gen.number
        reports, failures = self.detect.poll(n, wait_s)
        self.pending += failures
        # Faults carried out (an agent outlives a dead supervisor that saw them).
        self.faults.seen((i for rep in reports for i in rep.get("fired", ())), self.events.emit)
        self.ckpt.absorb(reports, self._step())
        for rep in reports:
            if rep.get("output"):
                self.output.add(rep["output"])
            for note in rep.get("notes", ()):  # what a node agent had to say (shm_full, fenced)
                self.events.emit(note.pop("type"), **note, node=rep["node"])
        with self._commit_seen:
            self._commit_seen.notify_all()
        self.ledger.close_recovery(
            n,
            self.detect.current_beats(n),
            len(self.pool.workers),
            self.gen.restore_tiers,
            self.gen.restored_remotely,
        )

    def _detect(self) -> None:
        """Run the detectors on what the agents reported; failures go to self.pending."""
        if self.sm.state is not JobState.RUNNING:
            return
        now = time.time()
        self.pool.bad.expire(now)
        self.ledger.throughput(
            now,
            self.progress(),
            self.detect.monitor,
            len(self.pool.workers),
            on_steady=lambda rate: self.ckpt.plan.steady(rate, self.ckpt.replication),
        )
        self.detect.slow_links(now)
        lost, reason = self.detect.lost_nodes(now)
        for node in lost:
            self.pending += self.detect.lose_node(node, reason, now)
        if self.pending:
            return
        hung = self.detect.hang(now, self.gen.number)
        if hung is not None:
            self.pending += hung
            return
        self.pending += self.detect.stragglers(now, self.recovery.budget())

    def _handle_failures(self) -> None:
        decision, reason = decide(
            self.pending, self.recovery.budget(), time.time(), node_history=self.ledger.incidents
        )
        if decision.action is Action.NOOP:
            return
        failures, self.pending = self.pending, []
        self.events.emit(
            "decision",
            action=decision.action.value,
            ranks=list(decision.ranks),
            reason=reason,
            failures=[_failure_event(f) for f in failures],
        )
        now = time.time()
        self.ledger.note_incidents(failures, self.pool.bad.lost, now)
        for node in decision.cordon:
            if node not in self.pool.bad.lost:
                self.pool.cordon(node, reason, now)
        if decision.action is Action.FAIL:
            self.ledger.fail(reason, _root_cause(failures))
            self.gen.abort_all(reason)
            self.ledger.record_failures(failures, None, time.time(), self._reached(), fatal=True)
            self._set(JobState.FAILED, reason)
            return
        self._set(JobState.RECOVERING, reason, Recovering(decision, reason, failures))

    def _recover(self, work: Recovering) -> None:
        """Carry out the RECOVERING state's work: replace, a fresh poll, roll back, start
        the next generation."""
        error = self.recovery.replace(work)
        # Collective errors were symptoms of this recovery's cause; other failures the
        # release surfaced want a decision of their own.
        self.pending = [p for p in self.pending if p.kind is not FailureKind.COMM_ERROR]
        self.pending += work.requeue
        if error is not None:
            self.ledger.fail(error, _root_cause(work.failures))
            self.ledger.record_failures(
                work.failures, None, work.decided_at, self._reached(), fatal=True
            )
            self._set(JobState.FAILED, error)
            return
        self._poll(wait_s=2.0)
        resume = self.recovery.roll_back(work, self._reached())
        self._launch(resume.restore_step, resume.durable)
        self._set(JobState.RUNNING, f"generation {self.gen.number}: {resume.reason}")

    def _launch(self, restore_step: int | None, durable: Manifest | None) -> None:
        """Start the next generation, restoring `restore_step` (from storage: `durable`)."""
        faults = self.faults.for_generation(
            self.pool.node_of,
            self.home_node,
            self.events.emit,
            recovery=self.gen.number >= 1,
            reached=self._reached(),
            holder_of=self.ckpt.plan.holder_rank,
        )
        self.detect.start_generation(time.time())
        self.ledger.new_generation()
        self.ckpt.plan.sync()  # the agents know their peers and the bound before step one
        self.gen.start(restore_step, *self.ckpt.restore_from(restore_step, durable), faults)
        self.ckpt.started(self.gen.number)

    def _finish(self) -> None:
        # Parameters, not buffers: under DDP's broadcast_buffers the ranks' buffers differ
        # after the last step (the job's model is rank 0's, buffers included).
        digests = {
            o.get("params_digest") or o["digest"]
            for o in self.gen.finished.values()
            if o.get("digest")
        }
        if len(digests) > 1:
            self.ledger.fail(f"ranks ended with different parameters: {sorted(digests)}")
            self._set(JobState.FAILED, self.ledger.error["message"])
            return
        self._poll(wait_s=2.0)
        newest = self.ckpt.final_copies()
        if newest is not None:
            deadline = time.monotonic() + FINAL_REPLICATION_S
            while (self.ckpt.commit.committed or -1) < newest and time.monotonic() < deadline:
                self._poll(wait_s=0.5)
        self.ckpt.persist_final(self._step())
        self._set(
            JobState.SUCCEEDED, f"all {self.pool.world} ranks finished {self.spec.steps} steps"
        )

    def _adopt(self) -> None:
        """Take the job back from the node agents a dead supervisor left."""
        self.pool.adopt_agents()
        agents = self.pool.agents
        self.events.emit(
            "supervisor_adopted",
            agents=sorted(agents),
            restarts=self.supervisor_restarts,
            reason=f"supervisor restarted ({self.supervisor_restarts} so far): "
            f"{len(agents)} node agent(s) of the job kept their memory",
        )

    def _adopted_restore_point(self) -> int | None:
        self._poll(wait_s=5.0)
        return self.ckpt.adopted_restore_point()

    def _step(self) -> int:
        """The newest step of this generation's ranks (their beats, their outcomes)."""
        beats = self.detect.current_beats(self.gen.number)
        return max([b["step"] for b in beats] + self.gen.steps(), default=0)

    def _reached(self) -> int:
        """The newest step any rank reached, in any generation."""
        beats = list(self.detect.beats.values())
        finished = list(self.gen.finished.values())
        return max(
            [b.get("step", 0) for b in beats]
            + [o.get("step", 0) for o in finished]
            + [self.detect.reached]
        )

    # --- metrics ------------------------------------------------------------------------------

    def _start_exporter(self) -> None:
        """Serve the job's metrics (orchestrator/observe/metrics.py). A port that cannot be
        bound costs the metrics, not the job: an event says why."""
        m = self.spec.metrics
        try:
            port = self.metrics.serve(m.host, m.port)
        except OSError as e:
            self.events.emit(
                "metrics_unavailable",
                reason=f"cannot serve metrics on {m.host}:{m.port} (metrics.host/metrics.port): "
                f"{e.strerror or e}",
            )
            return
        self.metrics_url = f"http://{m.host}:{port}/metrics"
        self.events.emit("metrics_exporter", url=self.metrics_url, host=m.host, port=port)
        self._target = TargetFile.publish(m, self.spec.name, port, self.events.emit)

    def _refresh_metrics(self) -> None:
        self._metrics_at = now = time.time()
        started = time.perf_counter()
        progress = self.progress()
        pool, gen = self.pool, self.gen.number
        with self._lock:
            beats = {
                r: {**b, "node_id": pool.worker_info.get(r, {}).get("node_id", "")}
                for r, b in self.detect.beats.items()
                if b.get("generation") == gen and r in pool.workers
            }
            redone = sum(f["steps_redone"] or 0 for f in self.ledger.failures)
        self.metrics.refresh(
            progress,
            beats,
            dict(self.detect.monitor.last_scores),
            now,
            self.recovery.budget().restarts_left,
            redone,
            dict(self.ckpt.replication),
            1 / self.ckpt.plan.steady_rate if self.ckpt.plan.steady_rate else None,
        )
        self.ckpt.plan.note_waits(self.metrics.copy_wait_s, now)
        self._metrics_cost = time.perf_counter() - started


def _failure_event(f: WorkerFailure) -> dict[str, Any]:
    return {
        "kind": f.kind.value,
        "rank": f.rank,
        "node": f.node,
        "step": f.step,
        "error_type": f.error_type,
        "message": (f.message or "")[:500],
    }


def _root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    # The exception a user can act on first, a symptom (a collective error) last.
    order = {FailureKind.USER_ERROR: 0, FailureKind.OOM: 0, FailureKind.COMM_ERROR: 2}
    return min(failures, key=lambda f: (order.get(f.kind, 1), f.at))


def _import_torch_distributed(spec: JobSpec) -> None:
    """The rendezvous store (generation.py) needs torch.distributed, and a persisting job's
    DCP index (ckpt/dcp_format.py) its checkpoint module: imported beside the workers'
    start, not before the supervisor asks for them (its process starts without torch) nor
    at the launch or the first durable step."""
    import torch.distributed

    if spec.checkpoint.persist.uri:
        import torch.distributed.checkpoint.filesystem  # noqa: F401

"""The training worker: one Ray actor per rank, running the user's loop in a thread.

The actor is threaded (``max_concurrency`` > 1): ``run`` occupies one thread with the train
loop while ``abort`` and ``status`` are served by others. A recovery never kills a healthy
worker: ``abort`` fails its pending collectives and makes ``ctx.steps()`` raise, ``run``
returns ``interrupted``, and the supervisor calls ``run`` again for the next generation.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from stalwart.ckpt.dcp_dir import dcp_reader
from stalwart.ckpt.device_copy import AsyncCapture
from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring_pipeline import RingPipeline
from stalwart.ckpt.snapshot import Snapshot, payload_checksum
from stalwart.health.classify import classify_exception
from stalwart.health.observations import FailureKind
from stalwart.orchestrator.chaos import actions as chaos
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.worker import heartbeat, mesh, torchrun
from stalwart.orchestrator.worker import probes as preflight
from stalwart.orchestrator.worker.collective import (
    ElasticGroup,
    GroupAborted,
    local_group,
    solo_group,
)
from stalwart.orchestrator.worker.context import LossNotFinite, RestoreFailed, TrainContext
from stalwart.orchestrator.worker.copy_wait import CopyWait
from stalwart.orchestrator.worker.divergence import ReplicaDivergence
from stalwart.orchestrator.worker.entrypoint import load_entrypoint
from stalwart.orchestrator.worker.output import OutputCapture
from stalwart.orchestrator.worker.reshard_source import reshard_source
from stalwart.orchestrator.worker.shard_fetch import Prefetch, fetch_shard, on_another_node

HEARTBEAT_INTERVAL_S = 0.25  # at least this often
HEARTBEAT_MIN_GAP_S = 0.05  # at most this often: a step's end sends one early


def is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, GroupAborted):
        return True
    comm_type = isinstance(exc, RuntimeError | dist.DistBackendError)
    return classify_exception(type(exc).__name__, str(exc), comm_type) is FailureKind.COMM_ERROR


class TrainWorker:
    def __init__(
        self,
        *,
        job: str,
        spec: dict[str, Any],
        rank: int | None,
        world_size: int,
        base_dir: str | None,
        supervisor: Any = None,
    ):
        # When this process started and how long its set-up took (the cold-start breakdown:
        # process start and imports before __init__, then the train loop's import, warm-up).
        self.boot: dict[str, float] = {"process_started": _process_started(), "init": time.time()}
        self.job = job
        self.rank = rank
        self.world_size = world_size
        # Elastic jobs may shrink to one rank; they keep their process group and DDP then.
        self.distributed = JobSpec.model_validate(spec).max_workers > 1
        self._restore_rank = rank
        self.agent: Any = None  # this node's agent, attached once the worker is placed
        self.supervisor = supervisor
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.spec = spec
        cpus = spec["resources"]["cpu"]
        torch.set_num_threads(max(1, int(cpus)))
        self.generation = 0
        # What the loop prints reaches the driver (from the import of its module on).
        self.output = OutputCapture(
            tag=lambda: (self.rank, self.generation),
            # Through this node's agent, with its report (None: no agent yet, lines wait).
            send=lambda lines: self.agent.worker_output.remote(lines) if self.agent else None,
        )
        self.output.install()
        # Before the loop's module is imported: it may bind init_process_group by name.
        torchrun.install()
        mesh.install()
        self.fn = load_entrypoint(spec["entrypoint"], base_dir)
        self.boot["entrypoint_loaded"] = time.time()
        job = JobSpec.model_validate(spec)
        self.backend = job.resolved_backend(torch.cuda.is_available())
        self.device = torch.device("cuda", 0) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # The GPU's index as NVML numbers it (Ray hands out physical ids); without GPUs,
        # the fake probe's GPU k stands for the node's k-th rank.
        gpu_ids = ray.get_gpu_ids()
        self.gpu_index: int | None = int(gpu_ids[0]) if gpu_ids else None
        self.group = ElasticGroup()
        self._preflight_groups: list[Any] = []
        # Snapshots go straight into this node's shared memory (ckpt/ring_pipeline.py),
        # through Ray where it has none.
        self.pipeline = RingPipeline(
            self._open_ring,
            self._through_ray,
            generation=lambda: self.generation,
            torn=self._torn,
            die=self._on_fault,
            # On a GPU the copy to the host runs on a side stream, overlapping the next step.
            device=AsyncCapture() if self.device.type == "cuda" else None,
            lean=job.checkpoint.lean,
        )
        self.ctx: TrainContext | None = None
        self._timings: dict[str, float] = {}
        self._train_thread: int | None = None
        self._stop = threading.Event()
        self._stepped = threading.Event()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, daemon=True, name="stalwart-heartbeat"
        )
        self._beat_thread.start()
        _warm_up()
        self.boot["ready"] = time.time()

    # --- control API -------------------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": os.getpid(),
            "backend": self.backend,
            "device": str(self.device),
            "gpu_index": self.gpu_index,
            "boot": dict(self.boot),
        }

    def attach(self, agent: Any) -> None:
        """Use `agent` (this node's) for shards and heartbeats."""
        self.agent = agent

    def assume(self, rank: int) -> None:
        """A spare takes over `rank`; its next run() joins the job as that rank."""
        assert self.rank is None and self.ctx is None, "only an idle spare can assume a rank"
        self.rank = rank

    def run(
        self,
        generation: int,
        rendezvous: dict[str, Any],
        restore_step: int | None,
        restore_from: Any,
        faults: list[dict[str, Any]],
        local_rank: int,
        rank: int | None = None,
        world_size: int | None = None,
        restore_rank: int | None = None,
        reshard_from: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Run one generation: rendezvous, restore, train until done or aborted.

        `rank`/`world_size`: this generation's, when an elastic resize renumbered the world.
        `restore_rank`: whose shard to restore (default: this rank's own). `reshard_from`:
        after a resize, where the old world's shards of the restore step are, for a
        sharded model the loop builds in the new layout: {"durable": target} or
        {"memory": {rank: agent}} (worker/reshard_source.py)."""
        self.generation = generation
        self.pipeline.restored(generation, restore_step)  # the lean rule's first floor
        if rank is not None and (rank, world_size) != (self.rank, self.world_size):
            self.rank, self.world_size = rank, world_size
            self._forget_slots()
        self._restore_rank = self.rank if restore_rank is None else restore_rank
        timings: dict[str, float] = {"started": time.time()}
        self._timings = timings
        self._train_thread = threading.get_native_id()  # its CPU time goes with the beats
        if self.ctx is None:
            self.ctx = TrainContext(
                rank=self.rank,
                world_size=self.world_size,
                distributed=self.distributed,
                local_rank=local_rank,
                node_id=self.node_id,
                device=self.device,
                total_steps=self.spec["steps"],
                every_steps=self.spec["checkpoint"]["every_steps"],
                seed=self.spec["seed"],
                config=self.spec["config"],
                group=self.group,
                pipeline=self.pipeline,
                on_fault=self._on_fault,
                on_step=self._stepped.set,
                divergence_every=self.spec["health"]["divergence_every_steps"],
                on_warning=self._warn,
                output_dir=_output_dir(self.spec),
                loss_guard=self.spec["health"]["loss_guard"]["enabled"],
                init_from=self.spec["checkpoint"].get("init_from"),
                open_reader=dcp_reader,
                copy_wait=CopyWait(
                    self.spec["checkpoint"].get("max_lag_steps"), self.pipeline.copies, self._ask
                ),
            )
        ctx = self.ctx
        whose = self._restore_rank

        def fetch(step: int) -> Snapshot | None:
            return self._fetch(restore_from, step, whose)

        if restore_step is not None and on_another_node(restore_from, self.agent):
            fetch = Prefetch(fetch, restore_step).get  # while the generation forms
        ctx.begin_generation(
            generation,
            restore_step,
            faults,
            local_rank,
            fetch=fetch,
            rank=self.rank,
            world_size=self.world_size,
            resharded=lambda: reshard_source(
                reshard_from, restore_step, lambda agent, r: self._fetch(agent, restore_step, r)
            ),
        )
        in_user_code = False
        try:
            ctx.phase_faults("rendezvous")
            if self.distributed:
                store = dist.TCPStore(
                    rendezvous["host"],
                    rendezvous["port"],
                    None,
                    False,
                    timeout=datetime.timedelta(seconds=rendezvous["timeout_s"]),
                )
                prefix = dist.PrefixStore(f"stalwart/{self.job}/gen{generation}", store)
                self.group.configure(
                    prefix,
                    self.rank,
                    self.world_size,
                    generation,
                    self.backend,
                    self.device,
                    hostname=rendezvous.get("gloo_host") or self.node_ip,
                    timeout=datetime.timedelta(seconds=rendezvous["collective_timeout_s"]),
                )
                self._store = store  # NCCL reads it lazily; keep it for the generation
            else:
                solo_group()  # what init_process_group() in the loop hands back
            torchrun.set_environment(self._torchrun_env(generation, rendezvous, local_rank))
            self.group.restoring = restore_step is not None
            timings["rendezvous_done"] = time.time()
            in_user_code = True
            self.fn(ctx)
            if ctx.progress.step < self.spec["steps"]:
                raise RuntimeError(
                    f"train loop returned after {ctx.progress.step} of {self.spec['steps']} "
                    "steps; iterate ctx.steps() to the end"
                )
            if not self.pipeline.drain(timeout=60):
                raise RuntimeError("final snapshot was not handed over within 60 s")
            self.output.flush()
            return self._outcome(
                "finished",
                timings,
                digest=ctx.model_digest(),
                params_digest=ctx.params_digest(),
                object_digests=ctx.object_digests(),
            )
        except Exception as e:
            interrupted = self.group.aborted is not None and self.group.generation == generation
            if ctx._interrupt is not None or (interrupted and is_comm_error(e)):
                return self._outcome("interrupted", timings)  # no flush: a recovery waits
            self.output.flush()  # the supervisor has the rank's last lines before its failure
            # Failing to form the group is the infrastructure's fault, not the user's.
            if isinstance(e, RestoreFailed):
                kind = "restore_failed"
            elif isinstance(e, LossNotFinite):
                kind = "loss_not_finite"
            elif isinstance(e, ReplicaDivergence):
                kind = "replica_divergence"
            elif is_comm_error(e) or not in_user_code:
                kind = "comm_error"
            elif classify_exception(type(e).__name__, str(e)) is FailureKind.OOM:
                kind = "oom"
            else:
                kind = "user_error"
            return self._outcome(
                kind,
                timings,
                error_type=type(e).__name__,
                message=str(e)[:2000],
                traceback=traceback.format_exc(),
                output_tail=self.output.tail(self.rank),
            )

    def abort(self, generation: int, reason: str) -> bool:
        """Release this rank from generation `generation` (no-op for an older one)."""
        if generation != self.generation:
            return False
        if self.ctx is not None:
            self.ctx.interrupt(reason)
        self.group.abort(reason, generation)
        return True

    def status(self) -> dict[str, Any]:
        return self._beat()

    def add_fault(self, fault: dict[str, Any]) -> bool:
        """`stalwart chaos inject`: carry `fault` out before this rank's next step."""
        if self.ctx is None:
            return False
        self.ctx.add_fault(fault)
        return True

    def shutdown(self) -> None:
        self._stop.set()

    # --- internals ----------------------------------------------------------------------------

    def _warn(self, message: str) -> None:
        """An exactness warning (worker/exactness.py): an event (shown live, kept in the
        event log), or this rank's log when there is no supervisor to tell."""
        if self.supervisor is not None:
            self.supervisor.record_warning.remote(self.rank, message, self._who())
        else:
            print(f"stalwart: warning: {message}", file=sys.stderr)

    def _who(self) -> dict[str, Any]:
        """This process, as the supervisor fences its calls (supervisor/fencing.py)."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "generation": self.generation,
            "node_id": self.node_id,
        }

    def _torchrun_env(
        self, generation: int, rendezvous: dict[str, Any], local_rank: int
    ) -> dict[str, str]:
        return torchrun.environment(
            rank=self.rank,
            world_size=self.world_size,
            local_rank=local_rank,
            nodes=rendezvous.get("nodes") or [list(range(self.world_size))],
            master_addr=rendezvous.get("host", "127.0.0.1"),
            master_port=rendezvous.get("port", 0),
            generation=generation,
            max_restarts=self.spec["failure"]["max_restarts"],
            run_id=self.job,
            device_index=self.device.index if self.device.type == "cuda" else None,
        )

    def _outcome(self, outcome: str, timings: dict[str, float], **extra: Any) -> dict[str, Any]:
        p = self.ctx.progress
        timings.update(
            {
                k: v
                for k, v in (("restored", p.restored_at), ("first_step_done", p.first_step_done_at))
                if v
            }
        )
        return {
            "rank": self.rank,
            "generation": self.generation,
            "outcome": outcome,
            "step": p.step,
            "metrics": dict(p.metrics),
            "samples": p.processed_samples,  # throughput: redone steps count again
            "tokens": p.processed_tokens,
            "timings": timings,
            "node_id": self.node_id,
            "pipeline": vars(self.pipeline.stats).copy(),
            "divergence_checks": {
                "checks": self.ctx.divergence.checks,
                "seconds": round(self.ctx.divergence.seconds, 6),
            },
            **extra,
        }

    def _open_ring(self, metas: tuple, payload_nbytes: int, skel_nbytes: int):
        """A snapshot ring in this node's shared memory (None: there is no room)."""
        return ray.get(self.agent.open_ring.remote(self.rank, metas, payload_nbytes, skel_nbytes))

    def _ask(self, generation: int, step: int, timeout_s: float):
        """How far this rank's copies are, from its agent (no ring to read: CopyWait)."""
        wait = self.agent.copies_reached.remote(self.rank, generation, step, timeout_s)
        return ray.get(wait, timeout=timeout_s + 30)

    def _torn(self, step: int) -> dict[str, Any] | None:
        return self.ctx.snapshot_fault(step) if self.ctx is not None else None

    def _through_ray(self) -> SnapshotPipeline:
        """The fall-back: snapshots copied into a buffer and sent to the agent through Ray
        by a background thread (no usable shared memory on this node)."""
        return SnapshotPipeline(self._send, pin_memory=self.device.type == "cuda")

    def _send(self, snap: Snapshot) -> None:
        payload = snap.payload.numpy() if isinstance(snap.payload, torch.Tensor) else snap.payload
        # Taken here, on the hand-over thread, not the training thread.
        checksum = payload_checksum(payload)
        torn = self._torn(snap.step)
        if torn is not None:
            self._on_fault(torn)  # dies before the shard reaches the agent
        self._put_through_ray(snap, payload, checksum)

    def _put_through_ray(self, snap: Snapshot, payload: np.ndarray, checksum: int) -> None:
        shard = Snapshot(snap.step, snap.skeleton, snap.metas, payload, checksum)
        ray.get(self.agent.put_shard.remote(self.rank, shard, self.generation))

    def _fetch(self, source: Any, step: int, rank: int | None = None) -> Snapshot | None:
        """`step`'s shard of `rank` (default: the one this rank restores) from the restore
        source (worker/shard_fetch.py)."""
        rank = self._restore_rank if rank is None else rank
        timeout_s = self.spec["failure"]["restore_timeout_s"]
        return fetch_shard(source, self.agent, rank, step, timeout_s, self.node_ip)

    def _on_fault(self, fault: dict[str, Any]) -> None:
        # Recorded synchronously, at the supervisor (a node fault takes the agent with it),
        # before the process or its node disappears.
        record = {**fault, "node_id": self.node_id}
        if self.supervisor is not None:
            # Paused here until the restore point is committed, or persisted (other ranks
            # wait in the next collective): the loss then races no copy to a peer nor
            # write to storage. At most half the hang timeout (else judged a hang).
            health = self.spec["health"]
            wait_s = min(60.0, 0.5 * (health["hang_timeout_s"] or health["hang"]["floor_s"]))
            for durable, key in ((False, "committed_step"), (True, "persisted_step")):
                if fault.get("after_persist" if durable else "after_commit"):
                    waited = self.supervisor.await_commit.remote(fault["at_step"], wait_s, durable)
                    record[key], record["at"] = ray.get(waited), time.time()  # it fails now
            if not ray.get(self.supervisor.record_fault.remote(record, self._who())):
                return  # this process was replaced (supervisor/fencing.py): not carried out
        # Also with the node agent, which outlives a supervisor: its successor must not
        # fire the fault again.
        ray.get(self.agent.note_fault.remote(fault["index"]))
        chaos.carry_out(
            fault,
            slow_down=self.ctx.slow_down,
            inject_gpu_fault=lambda xid: ray.get(
                self.agent.inject_gpu_fault.remote(self._gpu_for_probe(), xid)
            ),
            drop_replicas=lambda: ray.get(self.agent.wipe.remote(fault["at_step"])),
            storage_outage=lambda seconds: ray.get(
                self.supervisor.storage_outage.remote(seconds, self._who())
            ),
            kill_supervisor=lambda: ray.kill(self.supervisor, no_restart=True),
            corrupt_shards=lambda: ray.get(
                self.agent.corrupt_shards.remote(self.rank, fault["following"])
            ),
            fill_shm=lambda seconds: ray.get(self.agent.fill_shm.remote(seconds)),
            kill_job_on_node=self._kill_job_on_node,
            poison_model=self.ctx.poison,
        )

    def _kill_job_on_node(self) -> None:
        """Chaos kill_node, scope "job": the agent kills the job's processes here and
        itself; this rank waits (10 s at most) until the agent is gone, then dies too."""
        self.agent.kill_job_here.remote(os.getpid())
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                ray.get(self.agent.ping.remote(), timeout=1.0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return
            time.sleep(0.02)  # the agent is still dying: ask again

    def _gpu_for_probe(self) -> int:
        return self.gpu_index if self.gpu_index is not None else self.ctx.local_rank

    def preflight_matmul(self, size: int, repeats: int, slow_factor: float = 1.0) -> dict:
        try:
            seconds = preflight.time_matmul(self.device, size, repeats, slow_factor)
        except Exception as e:
            return {"node_id": self.node_id, "error": f"matmul: {type(e).__name__}: {e}"}
        return {"node_id": self.node_id, "matmul_s": seconds}

    def preflight_allreduce(
        self, rendezvous: dict[str, Any], key: str, pair_rank: int, timeout_s: float
    ) -> dict:
        try:
            seconds, group = preflight.time_pair_allreduce(
                rendezvous,
                key,
                pair_rank,
                self.backend,
                self.device,
                rendezvous.get("gloo_host") or self.node_ip,
                timeout_s,
            )
        except Exception as e:
            return {"node_id": self.node_id, "error": f"all-reduce: {type(e).__name__}: {e}"}
        self._preflight_groups.append(group)  # never torn down on the training thread
        return {"node_id": self.node_id, "allreduce_s": seconds}

    def quiesce(self, timeout_s: float = 30.0) -> bool:
        """Hand over every snapshot in flight, then forget the reserved slots: the stores
        are about to be renumbered (elastic resize). Call between generations only."""
        done = self.pipeline.drain(timeout=timeout_s)
        self._forget_slots()
        return done

    def _forget_slots(self) -> None:
        self.pipeline.forget()

    def stacks(self) -> dict[str, Any]:
        """Every thread's Python stack, for a hang report (served by another actor thread)."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        text = []
        for ident, frame in frames.items():
            text.append(f"Thread {names.get(ident, ident)}:")
            text.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "via": "sys._current_frames",
            "text": "\n".join(text),
        }

    def _beat(self) -> dict[str, Any]:
        ctx = self.ctx
        return heartbeat.beat(
            self.rank,
            self.generation,
            ctx.progress if ctx else None,
            self._collective_since(),
            ctx.copy_wait if ctx else None,
            self._gpu_for_probe() if ctx else self.gpu_index,
            self._timings,
            vars(self.pipeline.stats).copy(),
            self._train_thread,
        )

    def _collective_since(self) -> float | None:
        since = self.group.pending_since()
        return None if since is None else time.time() - (time.monotonic() - since)

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            # Wake at a step's end (fresh compute times) or after the interval.
            self._stepped.wait(HEARTBEAT_INTERVAL_S)
            self._stepped.clear()
            if self._stop.wait(HEARTBEAT_MIN_GAP_S):
                return
            if self.rank is None or self.agent is None:
                continue  # an idle spare has nothing to report yet
            # Into the ring, for the agent to read (no call), else by a call. If the agent
            # is gone the call fails; the supervisor notices the silence.
            with contextlib.suppress(Exception):
                beat = self._beat()
                with contextlib.suppress(Exception):
                    if self.pipeline.write_beat(heartbeat.encode(beat)):
                        continue
                self.agent.heartbeat.remote(self.rank, beat)


def _output_dir(spec: dict[str, Any]) -> str | None:
    """ctx.output_dir: the spec's (the driver fills it in for a one-machine cluster), else
    under the durable tier's URI."""
    if spec.get("output_dir"):
        return spec["output_dir"]
    uri = spec["checkpoint"]["persist"].get("uri")
    return f"{uri.rstrip('/')}/{spec['name']}/output" if uri else None


def _process_started() -> float:
    """This process's start (wall clock), before Python and torch were imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])  # to the 10 ms (/proc/stat's btime: whole s)
        return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # no /proc: __init__'s start
        return time.time()


def _warm_up() -> None:
    """Pay the one-time costs of a fresh process now, not during a recovery: building the
    first DistributedDataParallel imports torch._dynamo (1.4 s measured here)."""
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1), process_group=local_group())

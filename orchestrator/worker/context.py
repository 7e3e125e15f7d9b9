"""The train context: the API the user's train loop sees.

    def train_loop(ctx):
        model = ctx.prepare_model(build(ctx.device))
        opt = torch.optim.AdamW(model.parameters())
        ctx.register(model=model, optimizer=opt)
        for step in ctx.steps():          # resumes after the last committed step
            loss = ...                    # data indexed by (step, rank)
            ctx.report(loss=loss.item(), samples=64)

On a recovery the loop is unwound (``ctx.steps()`` or a collective raises) and the worker
calls ``train_loop(ctx)`` again in the same process; ``ctx.steps()`` then restores every
registered object, the RNG states and the step counter from the last committed snapshot.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stalwart.ckpt import dtensor
from stalwart.ckpt.dcp_format import CheckpointMismatch
from stalwart.ckpt.fsdp import sharded_views
from stalwart.ckpt.pipeline import SnapshotPipeline
from stalwart.ckpt.ring_pipeline import RingPipeline
from stalwart.ckpt.sharded import rank_local_view
from stalwart.ckpt.skeleton import UnsafeState, format_path
from stalwart.ckpt.snapshot import Snapshot, nested_digest, state_digest
from stalwart.orchestrator.worker.collective import ElasticGroup, GroupAborted, make_ddp, solo_group
from stalwart.orchestrator.worker.copy_wait import CopyWait
from stalwart.orchestrator.worker.divergence import DivergenceGuard, named_parameters
from stalwart.orchestrator.worker.exactness import unregistered
from stalwart.orchestrator.worker.restore import ReshardSource, init_from, restore_objects
from stalwart.orchestrator.worker.stateful import stateful

RECENT_STEPS = 32


class RestoreFailed(RuntimeError):
    """This rank could not restore committed step `step` from its source: the copy's
    failure (gone, late, missing, corrupt), never the train loop's."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"cannot restore committed step {step}: {reason}")
        self.step = step


class LossNotFinite(ArithmeticError):
    """The loss this rank reported for `step` is NaN or infinite (health.loss_guard): the
    step is not checkpointed, and the job rolls back to its last committed step."""

    def __init__(self, step: int, value: float):
        super().__init__(f"the loss at step {step} was {value}")
        self.step = step


class RecoveryInterrupt(GroupAborted):
    """Raised out of ``ctx.steps()`` when the supervisor starts a recovery."""


class CheckpointStateError(TypeError):
    """A registered object's state_dict() holds a value a checkpoint cannot restore."""


KEEPABLE = (
    "tensors, numbers, strings, containers, numpy arrays, scalars and generators, datetimes, "
    "paths, UUIDs, decimals, fractions and members of enums"
)


def _unsafe_message(e: UnsafeState) -> str:
    """The user's view of UnsafeState: which registered object, where in its state_dict()."""
    path = e.path
    if len(path) >= 2 and path[0] == "objects":
        where = f"ctx.register({path[1]}=...): {path[1]}.state_dict(){format_path(path[2:])}"
    else:
        where = f"the checkpointed state{format_path(path)}"
    return (
        f"{where} is {e.what}. A checkpoint keeps {KEEPABLE}: convert the value in "
        "state_dict()/load_state_dict(), or leave it out of them"
    )


@dataclass
class Progress:
    """What the worker's heartbeat reports. Written by the training thread only."""

    step: int = 0  # steps completed
    metrics: dict[str, float] = field(default_factory=dict)
    samples: float = 0.0  # trained into the model: restored with a step (ctx.progress)
    tokens: float = 0.0
    processed_samples: float = 0.0  # this process's throughput: never rolled back
    processed_tokens: float = 0.0
    compute_seconds: float = 0.0  # last step's time in the loop body minus collective waits
    collective_seconds: float = 0.0  # last step's time waiting in collectives
    # (step, compute seconds, cycle seconds) of recent steps, for straggler detection
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    step_started_at: float | None = None
    first_step_done_at: float | None = None
    setup_done_at: float | None = None  # the loop reached ctx.steps()
    fetched_at: float | None = None  # the snapshot arrived from the store
    restored_at: float | None = None
    restored_step: int | None = None


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_rng_to_tensor(random.getstate()),
        "numpy": _numpy_rng_to_tensor(np.random.get_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def apply_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_rng_to_tensor(state: tuple) -> tuple:
    # Snapshots hold tensors and plain values only; numpy's key array becomes a tensor.
    kind, keys, pos, has_gauss, cached = state
    return (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _python_rng_to_tensor(state: tuple) -> tuple:
    # 625 ints as one tensor, not 625 objects for the snapshot to walk on every step.
    version, internal, gauss = state
    return (version, torch.tensor(internal, dtype=torch.int64), gauss)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class TrainContext:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        node_id: str,
        device: torch.device,
        total_steps: int,
        every_steps: int,
        seed: int,
        config: dict[str, Any],
        group: ElasticGroup,
        pipeline: SnapshotPipeline | RingPipeline,
        on_fault: Callable[[dict[str, Any]], None],
        on_step: Callable[[], None] = lambda: None,
        distributed: bool | None = None,
        divergence_every: int = 0,
        on_warning: Callable[[str], None] = lambda message: None,
        output_dir: str | None = None,
        loss_guard: bool = True,
        init_from: str | None = None,
        open_reader: Callable[[str], tuple[Any, str]] | None = None,
        copy_wait: CopyWait | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.distributed = world_size > 1 if distributed is None else distributed
        self.local_rank = local_rank
        self.node_id = node_id
        self.device = device
        self.total_steps = total_steps
        self.seed = seed
        self.config = dict(config)
        self.group = group
        self.generation = 0
        self._every = every_steps
        self._pipeline = pipeline
        self._fetch: Callable[[int], Snapshot | None] = lambda step: None
        self._on_fault = on_fault
        self._on_step = on_step
        self._objects: dict[str, Any] = {}  # name -> what the loop registered
        self._views: dict[str, Any] = {}  # name -> what is checkpointed for it
        self._retired: list[torch.optim.Optimizer] = []  # see begin_generation
        self._unguard: dict[str, Callable[[], None]] = {}  # name -> removes its GPU guard
        self._ddp: dict[int, torch.nn.Module] = {}
        self._restore_step: int | None = None
        self._faults: list[dict[str, Any]] = []
        self._interrupt: str | None = None
        self._slow = 1.0  # chaos: compute time multiplier
        self.progress = Progress()
        self.divergence = DivergenceGuard(divergence_every, self._all_reduce_on)
        self._on_warning = on_warning
        self._output_dir = output_dir
        self._checked_exactness = False
        self._loss_guard = loss_guard
        self._step_loss: float | None = None  # the loss reported during the current step
        self._init_from = init_from  # checkpoint.init_from: a DCP checkpoint to start from
        self._open_reader = open_reader
        self._resharded: ReshardSource = lambda: None
        # checkpoint.max_lag_steps: waits after a snapshot while the copies lag too far
        self.copy_wait = copy_wait

    def phase_faults(self, phase: str) -> None:
        """Carry out this generation's faults that fire `during` `phase` of a recovery
        ("rendezvous", "restore"); the generation only carries them when it is one."""
        for fault in [f for f in self._faults if f.get("during") == phase]:
            self._faults.remove(fault)
            step = self._restore_step or 0
            self._on_fault({**fault, "at": time.time(), "step": step})

    def snapshot_fault(self, step: int) -> dict[str, Any] | None:
        """A `during: snapshot` fault due as the snapshot of `step` is handed over (asked
        from the hand-over thread), taken off this generation's faults."""
        for fault in list(self._faults):
            if fault.get("during") == "snapshot" and step >= fault["at_step"]:
                self._faults = [f for f in self._faults if f is not fault]
                return {**fault, "at": time.time(), "step": step}
        return None

    def add_fault(self, fault: dict[str, Any]) -> None:
        """A fault injected into the running job (from another thread): carried out before
        the next step."""
        if fault["rank"] == self.rank:
            self._faults = [*self._faults, fault]

    # --- called by the worker between generations -------------------------------------------

    def begin_generation(
        self,
        generation: int,
        restore_step: int | None,
        faults: list[dict[str, Any]],
        local_rank: int,
        fetch: Callable[[int], Snapshot | None],
        rank: int | None = None,
        world_size: int | None = None,
        resharded: ReshardSource | None = None,
    ) -> None:
        """Set up the next call of the train loop; `fetch(step)` returns this rank's shard.
        `rank`, `world_size`: this generation's (an elastic job renumbers on a resize);
        `resharded()`: a DCP reader of the restore step's sharded state in the layout it
        was saved in, where the loop's mesh differs from it (worker/restore.py)."""
        self.generation = generation
        if rank is not None:
            self.rank, self.world_size = rank, world_size
        self.local_rank = local_rank
        self._fetch = fetch
        self._resharded = resharded or (lambda: None)
        self._restore_step = restore_step
        self._faults = [f for f in faults if f["rank"] == self.rank]
        self._interrupt = None
        # The last generation's optimizers, whose state tensors the restore copies into
        # instead of allocating the new ones' (worker/restore.py load_into); let go of
        # once restored, as before.
        self._retired = (
            [v for v in self._views.values() if isinstance(v, torch.optim.Optimizer)]
            if restore_step is not None
            else []
        )
        self._objects, self._views = {}, {}
        self.progress.recent.clear()
        self.progress.restored_at = None
        self.progress.first_step_done_at = None
        seed_all(self.seed)

    def interrupt(self, reason: str) -> None:
        self._interrupt = reason

    def slow_down(self, factor: float) -> None:
        """Chaos: make this rank's compute `factor` times slower from now on."""
        self._slow = factor

    # --- the user's API ---------------------------------------------------------------------

    def register(self, **objects: Any) -> None:
        """Objects whose state_dict()/load_state_dict() make up this rank's checkpoint.

        A sharded optimizer (ZeroRedundancyOptimizer) is checkpointed as this rank's shard
        only, and restored only into the same rank of the same world (ckpt/sharded.py). A
        sharded model (FSDP2's fully_shard, HSDP) and its optimizer are checkpointed as
        this rank's DTensor shards, keyed by parameter FQN (ckpt/fsdp.py)."""
        for name, obj in objects.items():
            self._objects[name] = stateful(name, obj)
        self._views = {
            name: rank_local_view(view) for name, view in sharded_views(self._objects).items()
        }
        for name, obj in objects.items():
            if name in self._unguard:  # registered again (a recovery re-runs the loop)
                self._unguard.pop(name)()
            guard = getattr(self._pipeline, "guard", None)
            if guard is not None and isinstance(obj, torch.optim.Optimizer):
                # On a GPU its next step waits (on the device) for the snapshot's copy.
                self._unguard[name] = guard(obj)

    @property
    def output_dir(self) -> str:
        """Where the loop saves what it keeps (the final model, from rank 0): the spec's
        `output_dir`, OUTPUT/output when the cluster is the driver's machine, else
        `checkpoint.persist.uri`/JOB/output. A local path exists once asked for; a URL
        (s3://...) is written with fsspec."""
        if self._output_dir is None:
            raise RuntimeError(
                "ctx.output_dir: this cluster is not the driver's machine and the job spec "
                "sets neither output_dir nor checkpoint.persist.uri; set output_dir to a path "
                "every node can write (or an fsspec URL)"
            )
        if "://" not in self._output_dir:
            os.makedirs(self._output_dir, exist_ok=True)
        return self._output_dir

    @property
    def process_group(self) -> torch.distributed.ProcessGroup:
        """This generation's torch ProcessGroup (also torch.distributed's default group), for
        libraries that take one, e.g.
        ``ZeroRedundancyOptimizer(params, optimizer_class=AdamW, process_group=ctx.process_group)``.
        Build what holds it inside the train loop: a recovery brings a new group and calls
        the loop again. Every collective on it (torch.distributed's functions, a DDP built
        on it) is released by a recovery's abort, as ctx.all_reduce is."""
        if not self.distributed:
            return solo_group()
        return self.group.process_group

    def prepare_model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Move `module` to ctx.device and wrap it for data parallelism over the job's group.

        Returns a DistributedDataParallel whose gradient all-reduce survives recoveries.
        With one worker (and a world that cannot grow) the module is returned as is.
        """
        module = module.to(self.device)
        if not self.distributed:
            return module
        return make_ddp(module, self.group, self.device, **ddp_kwargs)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce `tensor` in place over the ranks ("sum", "mean", "max", "min")."""
        ops = {
            "sum": torch.distributed.ReduceOp.SUM,
            "mean": torch.distributed.ReduceOp.SUM,
            "max": torch.distributed.ReduceOp.MAX,
            "min": torch.distributed.ReduceOp.MIN,
        }
        if op not in ops:
            raise ValueError(f"ctx.all_reduce op: expected one of {sorted(ops)}, got {op!r}")
        if self.distributed:
            self.group.all_reduce(tensor, ops[op])
        if op == "mean":
            tensor.div_(self.world_size)
        return tensor

    def _all_reduce_on(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        """ctx.all_reduce on `group` (a mesh dimension's), or on every rank for None."""
        if group is None:
            return self.all_reduce(tensor, op)
        ops = {"max": torch.distributed.ReduceOp.MAX, "min": torch.distributed.ReduceOp.MIN}
        torch.distributed.all_reduce(tensor, ops[op], group=group)
        return tensor

    def report(self, **metrics: float) -> None:
        """Report scalars for this step (e.g. loss). `samples` and `tokens` are summed."""
        p = self.progress
        for key in ("samples", "tokens"):
            if key in metrics:
                n = float(metrics.pop(key))
                setattr(p, key, getattr(p, key) + n)
                setattr(p, f"processed_{key}", getattr(p, f"processed_{key}") + n)
        values = {k: float(v) for k, v in metrics.items()}
        if "loss" in values:
            self._step_loss = values["loss"]
        self.progress.metrics.update(values)

    def steps(self) -> Iterator[int]:
        """Yield step indices from the last committed step to the end, checkpointing as it goes."""
        if not self._objects:
            raise RuntimeError("call ctx.register(model=..., optimizer=...) before ctx.steps()")
        start = self._restore()
        if not self._checked_exactness and self.rank == 0 and self.generation == 1:
            self._checked_exactness = True  # once per job: the first generation's objects
            for message in unregistered(self._objects):
                self._on_warning(message)
        p, group = self.progress, self.group
        last_end: float | None = None
        guard = self.divergence if self.distributed else None
        for step in range(start, self.total_steps):
            self._before_step(step)
            t0 = time.perf_counter()
            waited0 = group.collective_seconds
            p.step_started_at = time.time()
            self._step_loss = None
            yield step
            loss = self._step_loss
            if self._loss_guard and loss is not None and not math.isfinite(loss):
                raise LossNotFinite(step, loss)  # before this state can be checkpointed
            if self._slow > 1:
                busy = time.perf_counter() - t0 - (group.collective_seconds - waited0)
                time.sleep((self._slow - 1) * max(0.0, busy))
            waited = group.collective_seconds - waited0
            end = time.perf_counter()
            p.collective_seconds = waited
            p.compute_seconds = max(0.0, end - t0 - waited)
            # The step's full cycle (previous step's end to this one's, snapshot included):
            # what throughput is made of.
            cycle = end - (last_end if last_end is not None else t0)
            last_end = end
            p.recent.append((step, p.compute_seconds, cycle))
            p.step = step + 1
            self._on_step()
            if guard is not None and guard.due(step + 1, step == start):
                # Before it is committed.
                guard.check(step + 1, self._objects, self.device, self.rank, self.world_size)
            if p.first_step_done_at is None:
                p.first_step_done_at = time.time()
            if (step + 1) % self._every == 0 or step + 1 == self.total_steps:
                self._snapshot(step + 1)
                if self.copy_wait is not None and step + 1 < self.total_steps:
                    self.copy_wait.after_snapshot(
                        step + 1, self.generation, start, lambda: self._interrupt is not None
                    )

    # --- internals ----------------------------------------------------------------------------

    def _snapshot(self, step: int) -> None:
        try:
            self._pipeline.submit(step, self._state(step))
        except UnsafeState as e:
            raise CheckpointStateError(_unsafe_message(e)) from None

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "objects": {name: obj.state_dict() for name, obj in self._views.items()},
            "rng": capture_rng(),
            # The counters roll back with the restore: redone steps are not counted twice.
            "counters": {"samples": self.progress.samples, "tokens": self.progress.tokens},
        }

    def _restore(self) -> int:
        self.progress.first_step_done_at = None
        if self._restore_step is None:
            # A fresh start: commit the initial state (step 0, or the step of the checkpoint
            # the job starts from), so there is always a consistent point to return to.
            self.progress.samples = self.progress.tokens = 0.0
            self.progress.setup_done_at = time.time()
            start = 0
            if self._init_from is not None:
                start = init_from(self._init_from, self._views, self._open_reader)
            self.progress.step = start
            self.progress.fetched_at = time.time()
            self._snapshot(start)
            self.progress.restored_at = time.time()
            self.progress.restored_step = None
            return start
        self.progress.setup_done_at = time.time()
        self.phase_faults("restore")
        step = self._restore_step
        try:
            snap = self._fetch(step)
        except Exception as e:
            raise RestoreFailed(step, f"fetching it failed: {type(e).__name__}: {e}") from None
        self.progress.fetched_at = time.time()
        if snap is None:
            raise RestoreFailed(step, "its source holds no such shard")
        if not snap.intact():
            raise RestoreFailed(
                step,
                "the copy is corrupt: its bytes do not match the checksum taken when it "
                "was handed over",
            )
        try:
            state = restore_objects(
                snap,
                self._objects,
                self._views,
                self.device,
                self._resharded,
                self.rank,
                self._retired,
            )
        except (dtensor.MeshChanged, CheckpointMismatch):
            raise  # the loop's layout or the checkpoint's model, not the copy
        except Exception as e:
            raise RestoreFailed(step, f"it does not load: {type(e).__name__}: {e}") from None
        finally:
            self._retired = []
        apply_rng(state["rng"])
        counters = state.get("counters")  # absent from snapshots of older versions
        if counters is not None:
            self.progress.samples = counters["samples"]
            self.progress.tokens = counters["tokens"]
        self.progress.step = state["step"]
        self.progress.restored_at = time.time()
        self.progress.restored_step = state["step"]
        return state["step"]

    def _before_step(self, step: int) -> None:
        if self._interrupt is not None:
            raise RecoveryInterrupt(self._interrupt)
        for fault in list(self._faults):
            if fault.get("during"):
                continue  # fires in its phase of a recovery (phase_faults)
            # A live fault (`stalwart chaos inject`) fires at its step or the first after.
            if fault["at_step"] == step or (fault.get("live") and step >= fault["at_step"]):
                if fault.get("live"):
                    self._faults.remove(fault)
                if fault.get("in_collective"):
                    self._arm(fault, step)
                    continue
                # The worker carries it out; the kills and hang never return.
                self._on_fault({**fault, "at": time.time(), "step": step})

    def _arm(self, fault: dict[str, Any], step: int) -> None:
        """An in_collective fault: carried out inside this rank's next collective of its
        kind, a hang before the rank issues it, a kill after."""
        self._faults = [f for f in self._faults if f is not fault]
        before = fault["kind"] == "hang"

        def fire(issued: bool) -> None:
            if issued != before:
                self._on_fault({**fault, "at": time.time(), "step": step})

        self.group.arm(fault["in_collective"], fire)

    def poison(self) -> None:
        """Chaos nan_loss: one weight of each registered module becomes NaN."""
        modules = [m for m in self._objects.values() if isinstance(m, torch.nn.Module)]
        weights = [
            next((p for p in m.parameters() if p.is_floating_point()), None) for m in modules
        ]
        weights = [w for w in weights if w is not None]
        if not weights:
            raise ValueError("chaos nan_loss: this rank registered no module with weights")
        with torch.no_grad():
            for w in weights:
                # A DTensor's own shard (the rank may hold none of it: another's does).
                local = dtensor.local_shard(w) if dtensor.is_dtensor(w) else w
                if local.numel():
                    local.view(-1)[0] = float("nan")

    def model_digest(self) -> str | None:
        """The registered model's digest: its state dict's (ckpt/snapshot.state_digest); a
        sharded model's counts its full tensors (gathered one at a time: every rank calls
        this, in the same order), so it is the digest of the same model unsharded."""
        model = self._views.get("model")
        if model is None:
            return None
        sd = model.state_dict()
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            sd = {k.removeprefix("module."): v for k, v in sd.items()}
        return state_digest(sd)

    def object_digests(self) -> dict[str, str]:
        """A digest of every registered object's state (a DDP's without `module.`): what
        `stalwart verify` and the chaos oracle compare, object by object."""
        out = {}
        for name, obj in self._views.items():
            if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                obj = obj.module
            out[name] = nested_digest(obj.state_dict())
        return out

    def params_digest(self) -> str | None:
        """The digest of the registered model's parameters only: what replicas must share
        (their buffers may differ after the last step, as under DDP's broadcast_buffers)."""
        model = self._objects.get("model")
        if model is None:
            return None
        return state_digest(dict(named_parameters({"model": model})))

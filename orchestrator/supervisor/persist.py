"""Writing committed steps to the durable tier, never on the training path nor blocking the
supervisor's control loop.

Each persisted step is a DCP checkpoint written by the node agents, every rank's file by
one node holding its shard in memory (its own node's when it can), in the agents' threads;
the supervisor only waits for the answers without blocking. When every file is written, a
thread of the supervisor writes DCP's index (``.metadata``, as DCP's coordinator would) and
the manifest (last: it is what makes the step complete, ckpt/durable.py)
and prunes storage to `keep_last` complete checkpoints. A failing target costs retries with
backoff inside each write, then a `persist_failed` event and a cool-down; the training goes
on, and the older complete checkpoints stay valid.

Fencing: every write is the job's generation's, the one running when it started. The
agents name their files for it (``__R_0.genG.distcp``) and the manifest records it. A
recovery fences the generation off (`fence`): a step it was still writing is dropped
(`persist_fenced`; at once when a node writing it is lost, `writer_lost`) and never gets
a manifest, so its files (an agent cut off by a partition may still write them after the
heal) are listed by none and pruned with their directory;
unless the step is at or below the restore step (the job's history, the same bytes
whichever generation wrote it) and every node writing it is alive: then the new generation
adopts it (``adopted_by`` in the manifest).
A manifest whose check passed before the fence is written: it was decided while its
generation ran (``committed_at`` in the manifest, before the next generation's event).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Set
from typing import Any

import ray

from stalwart.ckpt.durable import DurableError, DurableStore
from stalwart.orchestrator.spec import PersistSpec

FAILURE_COOLDOWN_S = 5.0  # after a failed attempt, the next one waits this long


class Persister:
    def __init__(
        self, spec: PersistSpec, job: str, emit: Callable[..., None], run: str | None = None
    ):
        """`run`: this run of the job (its store key), written into every manifest."""
        self.spec = spec
        self.run = run
        # DCP's metadata classes make each step's index (ckpt/dcp_format.py): imported here,
        # at the start (0.5 s), not in the first step's write, where a short job's first
        # checkpoint waited for it.
        import torch.distributed.checkpoint.metadata  # noqa: F401

        self.store = DurableStore(spec.uri, job, retries=spec.retries, backoff_s=spec.backoff_s)
        self.target = self.store.target
        self._emit = emit
        self._lock = threading.Lock()
        self.last_step: int | None = None  # the newest step persisted by this run
        self.last_at = time.time()  # when (the job's start counts as a persist)
        self._in_flight: dict[str, Any] | None = None
        self._cooldown_until = 0.0
        self.history: list[dict[str, Any]] = []
        self.failures = 0
        self.generation = 0  # the job's generation now: the one whose writes may commit

    def pinned(self, newest: int | None) -> set[int]:
        """Steps the stores must keep: the one being written and, with every_steps, the
        next steps of the grid (multiples of every_steps) up to one past `newest`."""
        with self._lock:
            out = {self._in_flight["step"]} if self._in_flight else set()
        every = self.spec.every_steps
        if every is not None:
            start = (self.last_step or 0) // every * every + every
            out.update(range(start, max(newest or 0, start) + every + 1, every))
        return out

    def resumed_from(self, step: int) -> None:
        """The job starts from durable `step`: the interval counts from there."""
        self.last_step, self.last_at = step, time.time()

    def choose(self, complete: set[int], committed: int | None, now: float) -> int | None:
        """The step to persist now, if any. `complete`: steps of which every rank's shard
        is in some live node's memory. With every_steps, the newest complete multiple of
        every_steps past the last one persisted (so checkpoints land on 10, 20, 30 ...);
        with every_seconds, once that long passed, the newest committed step."""
        with self._lock:
            if self._in_flight is not None or now < self._cooldown_until:
                return None
        last = self.last_step if self.last_step is not None else 0
        every = self.spec.every_steps
        if every is not None:
            grid = [s for s in complete if s > last and s % every == 0]
            if grid:
                return max(grid)
        if (
            self.spec.every_seconds is not None
            and now - self.last_at >= self.spec.every_seconds
            and committed is not None
            and committed > last
            and committed in complete
        ):
            return committed
        return None

    def start(
        self,
        step: int,
        world_size: int,
        assignment: dict[str, tuple[Any, list[int]]],
        faults: dict[str, dict[str, Any]] | None = None,
    ):
        """Write `step`: node -> (its agent, the ranks whose shard it writes); `faults`:
        node -> a chaos fault its agent carries out while writing."""
        faults = faults or {}
        with self._lock:
            generation = self.generation
        refs = {
            agent.persist.remote(self.target, step, ranks, faults.get(node), generation): node
            for node, (agent, ranks) in assignment.items()
            if ranks
        }
        with self._lock:
            self._in_flight = {
                "step": step,
                "world": world_size,
                "refs": refs,
                "started": time.time(),
                "phase": "shards",
                "generation": generation,
            }

    def fence(
        self, generation: int, restore_step: int | None = None, lost: Set[str] = frozenset()
    ) -> None:
        """Generation `generation` starts (after a roll back to `restore_step`; `lost`: the
        nodes lost by then): a write an older one started and has not committed yet is
        dropped, unless it is of the job's history (at or below the restore step) and
        every node writing it is alive: that one the new generation adopts (a storm of
        recoveries faster than a write would otherwise never reach storage)."""
        with self._lock:
            self.generation = max(self.generation, generation)
            job = self._in_flight
            if job is None or job.get("committing"):
                return
            if job.get("adopted_by", job["generation"]) >= generation:
                return
            writers = set(job.get("refs", {}).values())
            if restore_step is not None and job["step"] <= restore_step and not writers & lost:
                job["adopted_by"] = generation
                return
            self._in_flight = None
        restart = "" if restore_step is None else f" from step {restore_step}"
        self._dropped(job, f"generation {generation} restarts{restart}")

    def writer_lost(self, node: str) -> None:
        """`node`, lost, was writing shards of the step in flight: that write cannot complete
        (its agent is stopped) and no fence would adopt it, so it is dropped now, at the
        loss, not when the next generation starts: by then the other writers' answers (a
        failing target's retries running out) would have turned it into a `persist_failed`,
        and which came first would depend on how long the recovery took. A write whose
        shards are all written already (its manifest next) is kept."""
        with self._lock:
            job = self._in_flight
            if job is None or job.get("committing") or job.get("phase") == "manifest":
                return
            if node not in job.get("refs", {}).values():
                return
            self._in_flight = None
        self._dropped(job, f"node {node[:12]}, writing shards of it, was lost", node=node)

    def _dropped(self, job: dict[str, Any], why: str, **fields: Any) -> None:
        """The `persist_fenced` event of a write taken out of flight (`fence`, `writer_lost`)."""
        self._emit(
            "persist_fenced",
            path="durable",
            step=job["step"],
            generation=job["generation"],
            **fields,
            reason=f"step {job['step']}'s write by generation {job['generation']} dropped: "
            f"{why}; no manifest will list the files its nodes still write",
        )

    def poll(self) -> None:
        """Take the agents' answers that are in; never blocks."""
        with self._lock:
            job = self._in_flight
        if job is None or job["phase"] != "shards":
            return
        ready, _ = ray.wait(list(job["refs"]), num_returns=len(job["refs"]), timeout=0)
        if len(ready) < len(job["refs"]) or not self._current(job):
            return
        records: list[dict[str, Any]] = []  # the ranks' DCP files (DurableStore.write_rank)
        errors = {}
        for ref, node in job["refs"].items():
            try:
                records += ray.get(ref)
            except Exception as e:  # DurableError from the agent, or the agent died
                errors[node[:12]] = _cause(e)
        if errors:
            self._failed(job, "; ".join(f"node {n}: {why}" for n, why in sorted(errors.items())))
            return
        job["phase"] = "manifest"
        threading.Thread(
            target=self._finish, args=(job, records), name="stalwart-persist", daemon=True
        ).start()

    def _current(self, job: dict[str, Any]) -> bool:
        with self._lock:
            return self._in_flight is job

    def _finish(self, job: dict[str, Any], records: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._in_flight is not job:
                return  # fenced off since (`fence` said so)
            job["committing"] = True
            committed_at = time.time()
        extra = {"generation": job["generation"], "committed_at": committed_at}
        if "adopted_by" in job:
            extra["adopted_by"] = job["adopted_by"]
        if self.run:
            extra["run"] = self.run
        try:
            self.store.write_manifest(job["step"], job["world"], extra=extra, writes=records)
        except (DurableError, OSError, ValueError) as e:
            self._failed(job, _cause(e))
            return
        # The step is complete once its manifest is written: retention failing after it
        # (storage gone again) leaves older steps for the next pass, it unmakes nothing.
        kept = ""
        try:
            pruned = self.store.prune(self.spec.keep_last, newest=job["step"])
        except (DurableError, OSError, ValueError) as e:
            pruned, kept = [], f"; older steps not pruned yet: {_cause(e)}"
        seconds = time.time() - job["started"]
        nbytes = sum(r["record"]["nbytes"] for r in records)
        entry = {"step": job["step"], "seconds": round(seconds, 3), "bytes": nbytes}
        with self._lock:
            self.history.append(entry)
            self.last_step, self.last_at = job["step"], time.time()
            if self._in_flight is job:
                self._in_flight = None
        self._emit(
            "persisted",
            **entry,
            uri=self.store.describe(),
            pruned=pruned,
            reason=f"step {job['step']} on {self.store.describe()} "
            f"({nbytes / 1e6:.1f} MB in {seconds:.2f} s){kept}",
        )

    def _failed(self, job: dict[str, Any], why: str) -> None:
        with self._lock:
            self.failures += 1
            if self._in_flight is job:
                self._in_flight = None
            self._cooldown_until = time.time() + FAILURE_COOLDOWN_S
        self._emit(
            "persist_failed",
            step=job["step"],
            reason=f"step {job['step']} not persisted to {self.store.describe()}: {why}; "
            f"the older complete checkpoints stay valid, next try in {FAILURE_COOLDOWN_S:g} s",
        )

    def idle(self) -> bool:
        with self._lock:
            return self._in_flight is None

    def wait(self, timeout_s: float) -> bool:
        """Wait (polling) until no step is being written; False if it still is."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            self.poll()
            time.sleep(0.05)  # waiting on agents' writes, bounded by the deadline
        return True

    def outage(self, seconds: float, agents: list[Any]) -> None:
        """Chaos storage_unavailable: the target fails for every writer for `seconds`."""
        self.store.fail_for(seconds)
        for agent in agents:
            agent.storage_outage.remote(self.target, seconds)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "uri": self.store.describe(),
                "run": self.run,
                "persisted": [h["step"] for h in self.history],
                "last_step": self.last_step,
                "failures": self.failures,
                "bytes": sum(h["bytes"] for h in self.history),
            }


def _cause(e: BaseException) -> str:
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return f"{type(e).__name__}: {e}"[:400]

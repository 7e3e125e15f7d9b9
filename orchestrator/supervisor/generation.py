"""A process-group generation: one rendezvous and one `run()` call per rank, from the start (or
a recovery) to the end (or the next recovery).

Every rank always has a pending `run()` call: when its process dies, Ray fails the call
within milliseconds, which is how a dead worker is detected. A recovery releases the
survivors (`release`): their collectives fail, their loops unwind and `run()` returns
`interrupted`, so the same processes join the next generation.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import ray

from stalwart.health.classify import classify_death
from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.pool import ActorGone, WorkerPool, actor_error_text

if TYPE_CHECKING:
    import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 1800.0
# A worker's outcome -> the failure it stands for (others are communication errors).
OUTCOME_KINDS = {
    "user_error": FailureKind.USER_ERROR,
    "oom": FailureKind.OOM,
    "restore_failed": FailureKind.RESTORE_FAILED,
    "loss_not_finite": FailureKind.LOSS_NOT_FINITE,
    "replica_divergence": FailureKind.REPLICA_DIVERGENCE,
}


def open_rendezvous(
    worker_infos: Iterable[Mapping[str, Any]], timeout_s: float
) -> tuple[dist.TCPStore, dict[str, Any]]:
    """A fresh TCPStore on this process, and what a worker needs to join it: its host and
    port, and gloo_host when every worker is on this machine (rendezvous and gloo then stay
    on loopback). The caller keeps the store alive while the workers use it."""
    # Here, not at the top: the supervisor starts without torch (supervisor/actor.py
    # imports it beside the workers' start).
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    out: dict[str, Any] = {}
    if {i["node_ip"] for i in worker_infos} == {host}:
        host = out["gloo_host"] = "127.0.0.1"
    # Listening on `host` alone (the node's cluster address, or loopback), not on every
    # interface as a TCPStore that binds its own socket does: a socket bound here, handed
    # over (the store owns it from then on).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(1024)
    store = dist.TCPStore(
        host,
        listener.getsockname()[1],
        None,
        True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )
    return store, {**out, "host": host, "port": store.port}


class Generation:
    def __init__(self, spec: JobSpec, pool: WorkerPool, emit: Callable[..., None]):
        self.spec = spec
        self.pool = pool
        self._emit = emit
        self.number = 0
        self.futures: dict[Any, int] = {}  # run() ref -> rank
        self.finished: dict[int, dict[str, Any]] = {}  # rank -> its outcome
        self.restore_tiers: dict[str, int] = {}  # this generation's restores, per tier
        self.restored_remotely: dict[int, str] = {}  # rank -> tier, for other nodes' memory
        self._store = None

    def start(
        self,
        restore_step: int | None,
        sources: Mapping[int, tuple[Any, int, str | None]],
        reshard_from: dict[str, Any] | None,
        faults: list[dict[str, Any]],
    ) -> None:
        """Generation n+1: a fresh rendezvous, then every rank's run(), restoring
        `restore_step` from `sources` (rank -> (agent or durable target, whose shard, tier))
        and carrying `faults`; `reshard_from`: where the old layout's shards are after a
        resize (Checkpoints.reshard_from)."""
        self.number += 1
        gen = self.number
        pool = self.pool
        rendezvous = {
            "timeout_s": self.spec.failure.rendezvous_timeout_s,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        }
        if self.spec.max_workers > 1:
            # A fresh store (and port) per generation: nothing of a broken generation can
            # leak into the next one's rendezvous.
            self._store, joined = open_rendezvous(
                pool.worker_info.values(), self.spec.failure.rendezvous_timeout_s
            )
            rendezvous.update(joined)
        local = pool.local_ranks()
        # Each node's ranks, in node order (torchrun's GROUP_RANK, LOCAL_WORLD_SIZE).
        by_node: dict[str, list[int]] = {}
        for rank in sorted(pool.workers):
            by_node.setdefault(pool.worker_info[rank]["node_id"], []).append(rank)
        rendezvous["nodes"] = list(by_node.values())
        self.futures = {}
        self.finished = {}
        # Where this generation's ranks restore from: counts per tier, and the ranks that
        # restore from another node's memory (a lost node's ranks).
        self.restore_tiers = dict(Counter(t for _, _, t in sources.values() if t))
        self.restored_remotely = {
            r: t for r, (_, _, t) in sources.items() if t not in (None, "memory")
        }
        for rank, worker in pool.workers.items():
            source, source_rank, _ = sources[rank]
            ref = worker.run.remote(
                gen,
                rendezvous,
                restore_step,
                source,
                faults,
                local[rank],
                rank=rank,
                world_size=pool.world,
                restore_rank=source_rank,
                reshard_from=reshard_from,
            )
            self.futures[ref] = rank
        self._emit(
            "generation",
            generation=gen,
            restore_step=restore_step,
            restore_tiers=self.restore_tiers,
            restored_remotely=self.restored_remotely,
            world_size=pool.world,
            rendezvous_port=rendezvous.get("port"),
        )
        pool.clock.launched(gen)  # the first generation's ends the cold start's launch

    def ready(self, timeout_s: float) -> list[Any]:
        """The run() calls that have returned, waiting up to `timeout_s` for the first."""
        ready, _ = ray.wait(list(self.futures), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(self.futures), num_returns=len(self.futures), timeout=0)
        return ready

    def collect(self, ref: Any, beats: Mapping[int, Mapping[str, Any]]) -> WorkerFailure | None:
        """Take a returned run() call: None when the rank finished or was interrupted, else
        its failure (a dead process: at the step its last heartbeat (`beats`) showed)."""
        rank = self.futures.pop(ref)
        now = time.time()
        try:
            out = ray.get(ref)
        except ActorGone as e:
            return WorkerFailure(
                classify_death(str(e)),
                rank,
                self.pool.node_of(rank),
                now,
                step=beats.get(rank, {}).get("step"),
                message=actor_error_text(e),
                process_lost=True,
            )
        self.finished[rank] = out
        if out["outcome"] in ("finished", "interrupted"):
            return None
        return WorkerFailure(
            OUTCOME_KINDS.get(out["outcome"], FailureKind.COMM_ERROR),
            rank,
            out["node_id"],
            now,
            step=out["step"],
            error_type=out.get("error_type"),
            message=out.get("message"),
            traceback=out.get("traceback"),
            output_tail=tuple(out.get("output_tail", ())),
        )

    @property
    def done(self) -> bool:
        """Every rank's run() returned and was collected."""
        return len(self.finished) == len(self.pool.workers) and not self.futures

    def abort_all(self, reason: str) -> None:
        for worker in self.pool.workers.values():
            worker.abort.remote(self.number, reason)

    def release(
        self, replace: set[int], reason: str, beats: Mapping[int, Mapping[str, Any]]
    ) -> tuple[list[WorkerFailure], set[int]]:
        """End this generation for a recovery: the ranks in `replace` (dead, hung, on a lost
        or cordoned node) are killed, the others aborted (their collectives fail, their
        loops unwind) and waited for up to failure.abort_timeout_s. Returns the failures
        that surfaced meanwhile and the ranks that must be replaced too (their process
        died, or they did not come back in time)."""
        pool = self.pool
        for ref, rank in list(self.futures.items()):
            if rank in replace:
                self.futures.pop(ref)
                ray.kill(pool.workers[rank], no_restart=True)
        for rank, worker in pool.workers.items():
            if rank not in replace:
                worker.abort.remote(self.number, reason)
        timeout_s = self.spec.failure.abort_timeout_s
        deadline = time.time() + timeout_s
        extra: list[WorkerFailure] = []
        also: set[int] = set()
        while self.futures and time.time() < deadline:
            ready, _ = ray.wait(
                list(self.futures), num_returns=1, timeout=max(0.0, deadline - time.time())
            )
            for ref in ready:
                f = self.collect(ref, beats)
                if f is not None:
                    extra.append(f)
                    if f.process_lost:
                        also.add(f.rank)
        stuck = sorted(self.futures.values())
        self.futures.clear()
        for rank in stuck:
            self._emit(
                "abort_timeout",
                rank=rank,
                reason=f"did not leave its train loop within failure.abort_timeout_s={timeout_s}",
            )
            also.add(rank)
        return extra, also

    def close(self) -> None:
        self._store = None

    def steps(self) -> list[int]:
        """The last step of every rank that finished this generation."""
        return [o["step"] for o in self.finished.values()]

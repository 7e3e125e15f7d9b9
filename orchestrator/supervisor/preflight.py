"""Preflight: check nodes before they train (a matmul timing on every worker and, at the start,
an all-reduce between neighbour ranks), judged by health/preflight.py; cordon the nodes that
fail and move their ranks until every rank's node passed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import ray

from stalwart.health.preflight import PreflightResult, judge_preflight
from stalwart.orchestrator.chaos.faults import FaultBook
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.generation import open_rendezvous
from stalwart.orchestrator.supervisor.pool import ActorGone, WorkerPool, actor_error_text
from stalwart.orchestrator.supervisor.resources import SchedulingError

MOVE_ATTEMPTS = 3


class Preflight:
    def __init__(
        self, spec: JobSpec, pool: WorkerPool, faults: FaultBook, emit: Callable[..., None]
    ):
        self.cfg = spec.health.preflight
        self.rendezvous_timeout_s = spec.failure.rendezvous_timeout_s
        self.pool = pool
        self.faults = faults
        self._emit = emit
        self.passed: dict[str, float] = {}  # node -> its matmul seconds
        self._store = None  # the pair all-reduces' rendezvous (kept alive while they run)

    def fresh(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` on nodes that have not passed preflight."""
        return [r for r in sorted(ranks) if self.pool.node_of(r) not in self.passed]

    def check(
        self,
        ranks: list[int],
        idle: list[tuple[Any, str]] = (),
        pairs: bool = False,
        peers: list[int] = (),
    ) -> dict[str, str]:
        """Check the nodes of `ranks` and of `idle` (rankless workers: spares, newcomers,
        with their nodes): a matmul timing on every worker and, with `pairs`, an all-reduce
        between neighbour ranks. `peers`: idle ranks on nodes that passed before, timed at
        the same moment as the reference (a shared machine's load then weighs on both sides
        alike). Returns the nodes to cordon with why; nodes that pass are remembered."""
        cfg = self.cfg
        pool = self.pool
        t0 = time.time()
        slow = self.faults.slow_at_start()
        actors = [(r, pool.workers[r]) for r in [*ranks, *peers]]
        actors += [(None, a) for a, _ in idle]
        idle_node = {id(a): n for a, n in idle}
        refs = {
            actor.preflight_matmul.remote(cfg.matmul_size, cfg.matmul_repeats, slow.get(r, 1.0)): (
                r,
                actor,
            )
            for r, actor in actors
        }
        per_actor = gather(refs, cfg.timeout_s, "matmul")
        allreduce: dict[int, dict[str, Any]] = {}
        if pairs and len(ranks) > 1:
            self._store, rendezvous = open_rendezvous(
                pool.worker_info.values(), self.rendezvous_timeout_s
            )
            for i, pairs_round in enumerate(pair_rounds(sorted(ranks))):
                refs = {}
                for a, b in pairs_round:
                    for pair_rank, r in enumerate((a, b)):
                        ref = pool.workers[r].preflight_allreduce.remote(
                            rendezvous, f"{i}-{a}-{b}", pair_rank, cfg.timeout_s
                        )
                        refs[ref] = (r, pool.workers[r])
                for (r, _), res in gather(refs, cfg.timeout_s, "all-reduce").items():
                    prev = allreduce.get(r)
                    if (
                        prev is None
                        or "error" in res
                        or res.get("allreduce_s", 0) > prev.get("allreduce_s", 0)
                    ):
                        allreduce[r] = res
        results: dict[str, dict[str, Any]] = {}
        for (r, actor), res in per_actor.items():
            node = res.get("node_id") or (
                pool.node_of(r) if r is not None else idle_node[id(actor)]
            )
            agg = results.setdefault(node, {"matmul": [], "allreduce": [], "errors": []})
            if "error" in res:
                agg["errors"].append(res["error"])
            else:
                agg["matmul"].append(res["matmul_s"])
            ar = allreduce.get(r) if r is not None else None
            if ar is not None:
                if "error" in ar:
                    agg["errors"].append(ar["error"])
                else:
                    agg["allreduce"].append(ar["allreduce_s"])
        checked = {
            node: PreflightResult(
                node,
                max(a["matmul"]) if a["matmul"] and not a["errors"] else None,
                statistics.median(a["allreduce"]) if a["allreduce"] else None,
                "; ".join(a["errors"]) or None,
            )
            for node, a in results.items()
        }
        # Without peers timed now, a later node is judged against the earlier ones' times.
        reference = (
            statistics.median(self.passed.values())
            if self.passed and not pairs and not peers
            else None
        )
        bad, reason = judge_preflight(checked, cfg.max_slowdown, reference)
        peer_nodes = {pool.node_of(r) for r in peers}
        bad = {n: why for n, why in bad.items() if n not in peer_nodes}
        for node, res in checked.items():
            if node not in bad:
                self.passed[node] = res.matmul_s
        self._emit(
            "preflight",
            nodes={
                n: {
                    "matmul_ms": _ms(r.matmul_s),
                    "allreduce_ms": _ms(r.allreduce_s),
                    "error": r.error,
                }
                for n, r in checked.items()
            },
            reference_ms=_ms(reference),
            failed=bad,
            seconds=round(time.time() - t0, 3),
            reason=reason,
        )
        return bad

    def peers_for(self, ranks: list[int]) -> list[int]:
        """Up to three idle ranks (between generations) on nodes that passed preflight."""
        return [
            r
            for r in sorted(self.pool.workers)
            if r not in ranks and self.pool.node_of(r) in self.passed
        ][:3]

    def cordon_failed(self, bad: dict[str, str]) -> None:
        now = time.time()
        for node, why in bad.items():
            self.pool.cordon(node, f"preflight: {why}", now)

    def check_and_move(self, ranks: list[int], initial: bool) -> None:
        """Preflight `ranks` (at the start: every rank with neighbour all-reduces, and the
        spares); cordon failing nodes and move their ranks until every rank's node passed.
        Raises SchedulingError when that keeps failing."""
        if not self.cfg.enabled or not ranks:
            return
        pool = self.pool
        idle = [(a, n) for a, _, n in pool.spares] if initial else []
        peers = [] if initial else self.peers_for(ranks)
        bad = self.check(ranks, idle, pairs=initial, peers=peers)
        for _attempt in range(MOVE_ATTEMPTS):
            if not bad:
                return
            self.cordon_failed(bad)
            # Only off the nodes the cordon took: one it skipped (the nodes left could not
            # hold the job) has nowhere to move to, and waiting for room would be in vain.
            cordoned = pool.bad_nodes()
            bad = {n: why for n, why in bad.items() if n in cordoned}
            if not bad:
                return
            pool.restart_spares_on(bad)
            movers = [r for r in ranks if pool.node_of(r) in bad]
            moved = pool.move(movers)
            self.faults.moved_off(moved)  # the slow node the fault stood for is cordoned
            if not moved:
                return
            ranks = moved
            bad = self.check(moved, peers=self.peers_for(moved))
        raise SchedulingError(
            f"preflight kept failing after moving ranks {MOVE_ATTEMPTS} times: {bad}"
        )

    def check_spares(self) -> None:
        """Take the spares that became ready (the start does not wait for them); one on a
        node that has not passed is checked now, off a recovery's path, and started again
        elsewhere if its node fails."""
        known = len(self.pool.spares)
        self.pool.check_spares()
        fresh = [(a, n) for a, _, n in self.pool.spares[known:] if n not in self.passed]
        if not fresh or not self.cfg.enabled:
            return
        # No peers: the ranks are training; the node is judged against the passed ones.
        bad = self.check([], fresh)
        if bad:
            self.cordon_failed(bad)
            self.pool.restart_spares_on(bad)

    def check_newcomers(self, newcomers: list[tuple[Any, str]]) -> dict[str, str]:
        """Check idle workers (with their nodes) about to become ranks, on nodes that have
        not passed; the nodes that fail are cordoned. Returns them."""
        fresh = [(a, n) for a, n in newcomers if n not in self.passed]
        if not fresh or not self.cfg.enabled:
            return {}
        bad = self.check([], fresh, peers=self.peers_for([]))
        if bad:
            self.cordon_failed(bad)
        return bad


def gather(refs: dict[Any, tuple], timeout_s: float, what: str) -> dict[tuple, dict]:
    """Each call's answer by its key; an error entry for one that failed or did not finish."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    out = {}
    for ref, key in refs.items():
        if ref not in ready:
            out[key] = {"error": f"{what} did not finish within {timeout_s} s"}
            continue
        try:
            out[key] = ray.get(ref)
        except ActorGone as e:
            out[key] = {"error": f"{what}: worker died: {actor_error_text(e)[:300]}"}
    return out


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None


def pair_rounds(ranks: list[int]) -> list[list[tuple[int, int]]]:
    """Neighbour pairs in rounds where no rank is in two pairs at once: (0,1), (2,3), ...
    then (1,2), (3,4), ..., and (last, first) to close the ring for an even number above
    two (an odd ring does not fit in two rounds). Every rank is in at least one pair (with
    two or more ranks)."""
    n = len(ranks)
    if n < 2:
        return []
    first = [(ranks[i], ranks[i + 1]) for i in range(0, n - 1, 2)]
    second = [(ranks[i], ranks[i + 1]) for i in range(1, n - 1, 2)]
    if n > 2 and n % 2 == 0:
        second.append((ranks[-1], ranks[0]))
    return [r for r in (first, second) if r]

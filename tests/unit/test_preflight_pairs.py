"""orchestrator/worker/probes.py: all-reduce pair rounds and the CPU matmul timing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from stalwart.orchestrator.supervisor.preflight import pair_rounds
from stalwart.orchestrator.worker import probes as preflight
from stalwart.orchestrator.worker.probes import time_matmul

CPU = torch.device("cpu")


def ranks_of(n: int) -> list[int]:
    """`n` rank numbers in an order that is not sorted, so "neighbours" means list order."""
    return [(7 * i + 3) % 11 for i in range(n)]


@pytest.mark.parametrize("n", range(10))
def test_pair_rounds(n):
    ranks = ranks_of(n)
    assert len(set(ranks)) == n
    rounds = pair_rounds(ranks)
    pairs = [p for rnd in rounds for p in rnd]
    if n < 2:
        assert rounds == []
        return
    assert 1 <= len(rounds) <= 2
    for rnd in rounds:
        assert rnd, "no empty rounds"
        in_round = [r for pair in rnd for r in pair]
        assert len(in_round) == len(set(in_round)), f"a rank twice in round {rnd}"
    # Every rank is in a pair, and pairs are neighbours in the given order (ring-wise).
    assert {r for pair in pairs for r in pair} == set(ranks)
    pos = {r: i for i, r in enumerate(ranks)}
    for a, b in pairs:
        assert pos[b] == (pos[a] + 1) % n, f"({a}, {b}) are not neighbours"
    assert len(pairs) == len(set(pairs)), "a pair twice"
    # The chain is covered: every rank is paired with the next one.
    for i in range(n - 1):
        assert (ranks[i], ranks[i + 1]) in pairs
    if n > 2 and n % 2 == 0:
        assert (ranks[-1], ranks[0]) in pairs  # the ring is closed
        assert len(pairs) == n


def test_pair_rounds_examples():
    assert pair_rounds([0, 1]) == [[(0, 1)]]
    assert pair_rounds([0, 1, 2]) == [[(0, 1)], [(1, 2)]]
    assert pair_rounds([0, 1, 2, 3]) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert pair_rounds([5, 9, 2, 4, 7]) == [[(5, 9), (2, 4)], [(9, 2), (4, 7)]]


def test_pair_rounds_does_not_change_its_input():
    ranks = [3, 1, 2, 0]
    pair_rounds(ranks)
    assert ranks == [3, 1, 2, 0]


def test_time_matmul_on_cpu_is_positive_and_restores_threads():
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 3
    torch.set_num_threads(wanted)
    try:
        t = time_matmul(CPU, 64, 5)
        assert isinstance(t, float)
        assert t > 0
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_time_matmul_runs_on_one_thread_and_restores_threads_on_error(monkeypatch):
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 3
    seen = []

    def boom(*args):
        seen.append(torch.get_num_threads())
        raise RuntimeError("matmul failed")

    monkeypatch.setattr(preflight, "_time_matmul", boom)
    torch.set_num_threads(wanted)
    try:
        with pytest.raises(RuntimeError, match="matmul failed"):
            time_matmul(CPU, 64, 5)
        assert seen == [1]
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_slow_factor_makes_the_matmul_slower():
    fast = time_matmul(CPU, 64, 5, slow_factor=1.0)
    slow = time_matmul(CPU, 64, 5, slow_factor=4.0)
    assert slow > 2 * fast, (fast, slow)


def test_a_busy_machine_does_not_make_a_cpu_node_read_slow():
    """On a CPU the matmul is timed by the thread's CPU time: processes competing for the
    cores (a local cluster's other nodes importing torch) leave it where it was, far under
    the 3x that cordons a node (it read 3x by the wall clock in a suite run; a 512 matmul,
    longer than a scheduler's slice, reads about 4x by the wall clock under these hogs)."""
    quiet = time_matmul(CPU, 512, 3)
    n = 2 * (os.cpu_count() or 2)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        busy = time_matmul(CPU, 512, 3)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait(timeout=10)
    assert busy < 2 * quiet, (quiet, busy)

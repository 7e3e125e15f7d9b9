"""orchestrator/supervisor/preflight.py check_spares: the start does not wait for the spares;
one that becomes ready on a node that has not passed is checked then (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.supervisor.preflight import Preflight

pytestmark = pytest.mark.timeout(10)


class _Pool:
    def __init__(self, ready: list[tuple[str, str]]):
        self.spares: list[tuple[str, int, str]] = [("old", 4, "passed")]
        self._ready = ready  # (actor, node) that check_spares finds ready
        self.cordoned: list[str] = []
        self.restarted: list[set[str]] = []

    def check_spares(self) -> None:
        self.spares += [(actor, 5, node) for actor, node in self._ready]

    def cordon(self, node: str, reason: str, now: float) -> None:
        self.cordoned.append(node)

    def restart_spares_on(self, nodes) -> None:
        self.restarted.append(set(nodes))


def _preflight(pool: _Pool, verdict: dict[str, str]) -> tuple[Preflight, list]:
    spec = validate({"name": "j", "entrypoint": "m:f", "workers": 4, "steps": 10})
    pre = Preflight(spec, pool, SimpleNamespace(), print)
    pre.passed = {"passed": 0.01}
    calls = []

    def check(ranks, idle=(), pairs=False, peers=()):
        calls.append((list(ranks), list(idle), list(peers)))
        return verdict

    pre.check = check
    return pre, calls


def test_a_spare_on_a_passed_node_is_not_checked_again():
    pre, calls = _preflight(_Pool([("s1", "passed")]), {})
    pre.check_spares()
    assert calls == []


def test_a_late_spare_on_a_fresh_node_is_checked_alone_and_moved_if_it_fails():
    pool = _Pool([("s1", "passed"), ("s2", "fresh")])
    pre, calls = _preflight(pool, {"fresh": "matmul 5x slower"})
    pre.check_spares()
    # Only the new spare on the fresh node, with no peers: the ranks are training.
    assert calls == [([], [("s2", "fresh")], [])]
    assert pool.cordoned == ["fresh"]
    assert pool.restarted == [{"fresh"}]

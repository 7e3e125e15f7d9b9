"""orchestrator/supervisor/preflight.py: after a failed preflight, ranks move only off the
nodes the cordon took (a skipped cordon leaves them nowhere to go)."""

from __future__ import annotations

from types import SimpleNamespace

from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.supervisor.preflight import Preflight


class _Pool:
    def __init__(self, room: bool):
        self.room = room
        self.cordoned: set[str] = set()
        self.spares: list = []
        self.moves: list[list[int]] = []

    def node_of(self, rank: int) -> str:
        return "slow" if rank < 2 else "ok"

    def cordon(self, node: str, reason: str, now: float) -> None:
        if self.room:  # else: skipped, the nodes left could not hold the job
            self.cordoned.add(node)

    def bad_nodes(self) -> set[str]:
        return set(self.cordoned)

    def restart_spares_on(self, nodes) -> None:
        pass

    def move(self, ranks: list[int]) -> list[int]:
        self.moves.append(ranks)
        return ranks


def _preflight(pool: _Pool) -> Preflight:
    spec = validate({"name": "j", "entrypoint": "m:f", "workers": 4, "steps": 10})
    pre = Preflight(spec, pool, SimpleNamespace(moved_off=lambda ranks: None), print)
    verdicts = iter([{"slow": "matmul 5x slower"}, {}])
    pre.check = lambda ranks, idle=(), pairs=False, peers=(): next(verdicts)
    pre.peers_for = lambda ranks: []
    return pre


def test_ranks_move_off_a_cordoned_node():
    pool = _Pool(room=True)
    _preflight(pool).check_and_move([0, 1, 2, 3], initial=True)
    assert pool.moves == [[0, 1]]


def test_ranks_stay_on_a_node_whose_cordon_was_skipped():
    pool = _Pool(room=False)
    _preflight(pool).check_and_move([0, 1, 2, 3], initial=True)
    assert pool.moves == []  # no wait for room that cannot come

"""worker/divergence.py: when the replicas' parameters differ, the guard names the ranks
that differ from the majority (one more all-reduce, an all-gather of the differing
tensors' fingerprints), and the error carries the step, the tensors and those ranks.
Four ranks as threads over an in-process all-reduce."""

from __future__ import annotations

import threading

import pytest
import torch

from stalwart.orchestrator.worker.divergence import DivergenceGuard, ReplicaDivergence

pytestmark = pytest.mark.timeout(30)

WORLD = 4


class _Reducer:
    """all_reduce(tensor, op, group) across WORLD threads: each contributes, all get the
    result."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(WORLD)
        self._lock = threading.Lock()
        self._parts: list[torch.Tensor] = []
        self.calls = 0

    def __call__(self, tensor: torch.Tensor, op: str, group) -> torch.Tensor:
        assert group is None
        with self._lock:
            self._parts.append(tensor.clone())
        self._barrier.wait()
        stacked = torch.stack(self._parts)
        out = {"max": stacked.max(0).values, "min": stacked.min(0).values, "sum": stacked.sum(0)}
        tensor.copy_(out[op])
        if self._barrier.wait() == 0:
            self._parts.clear()
            self.calls += 1
        self._barrier.wait()
        return tensor


def _run(models: list[torch.nn.Module]) -> tuple[list, _Reducer]:
    reducer = _Reducer()
    results: list = [None] * WORLD

    def rank(r: int) -> None:
        guard = DivergenceGuard(5, reducer)
        try:
            guard.check(40, {"model": models[r]}, torch.device("cpu"), r, WORLD)
        except ReplicaDivergence as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return results, reducer


def _models() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    models = []
    for _ in range(WORLD):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        m.load_state_dict(base.state_dict())
        models.append(m)
    return models


def test_identical_replicas_pass_with_two_reductions_only():
    results, reducer = _run(_models())
    assert results == [None] * WORLD and reducer.calls == 2


def test_the_rank_that_drifted_is_named_on_every_rank():
    models = _models()
    with torch.no_grad():
        models[3][1].bias[0] += 1e-3  # one element of one tensor on rank 3
    results, reducer = _run(models)
    assert reducer.calls == 3  # max, min, and the gather of the differing tensor
    for e in results:
        assert isinstance(e, ReplicaDivergence)
        assert (e.step, e.tensors, e.outliers) == (40, ["model.1.bias"], [3])
        assert "rank(s) 3 differ from the other 3; model.1.bias" in str(e)
        assert "silent data corruption" in str(e)

"""The supervisor and the node agents start without torch (2 s of CPU each, on the nodes
where the job's workers import it at the same moment); the workers' actor class forwards
the whole control API of the TrainWorker it builds in the worker's process."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "module",
    ["stalwart.orchestrator.supervisor.actor", "stalwart.orchestrator.agent.actor"],
)
def test_the_control_plane_imports_without_torch(module):
    # And stays without it through what a node agent does to each snapshot it takes in.
    code = (
        f"import sys, numpy, {module}\n"
        "from stalwart.ckpt.snapshot import payload_checksum\n"
        "from stalwart.ckpt.hashed_io import flat_bytes\n"
        "payload_checksum(numpy.arange(20, dtype=numpy.uint8))\n"
        "flat_bytes(numpy.arange(20, dtype=numpy.uint8))\n"
        "print('torch' in sys.modules)"
    )
    assert _python(code).stdout.strip() == "False", f"{module} imports torch"


def test_the_worker_actor_forwards_every_public_method():
    from stalwart.orchestrator.worker.actor import TrainWorker
    from stalwart.orchestrator.worker.remote import METHODS, WorkerActor

    public = {
        name
        for name, fn in inspect.getmembers(TrainWorker, inspect.isfunction)
        if not name.startswith("_")
    }
    assert set(METHODS) == public
    assert all(callable(getattr(WorkerActor, name)) for name in METHODS)


def test_a_lazy_module_imports_on_first_use_and_keeps_what_it_read():
    from stalwart.ckpt.lazy import LazyModule

    lazy = LazyModule("json")
    assert lazy.dumps({"a": 1}) == '{"a": 1}'
    assert "dumps" in vars(lazy)  # the next read is a plain attribute


def test_is_tensor_while_another_thread_is_importing_torch(monkeypatch):
    # sys.modules holds torch from the start of its import: a node agent's ring thread
    # checked a payload while its persist thread imported torch, read torch.Tensor from the
    # half-made module and died (every rank of the node then waited for a free slot).
    import types

    import numpy

    from stalwart.ckpt.lazy import is_tensor

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert is_tensor(numpy.zeros(3)) is False


def test_a_node_agent_of_a_persisting_job_imports_torch_at_its_start(tmp_path):
    # Its DCP writes need torch: imported beside the workers' start, not at the first
    # durable step (2 s of CPU there let a fast job run 35 steps past the step it wrote).
    code = (
        "import sys, time\n"
        "from stalwart.orchestrator.agent.actor import NodeAgent\n"
        f"lean = NodeAgent('n', 'k', shm_root={str(tmp_path)!r}, lease_s=None)\n"
        "print('torch' in sys.modules)\n"
        f"NodeAgent('n', 'k2', shm_root={str(tmp_path)!r}, lease_s=None, durable=True)\n"
        "deadline = time.monotonic() + 90\n"
        "while not hasattr(sys.modules.get('torch'), 'save') and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(hasattr(sys.modules.get('torch'), 'save'))"
    )
    out = _python(code)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter (nothing imported yet)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=True
    )


@pytest.mark.parametrize("collecting", [True, False])
def test_a_rank_imports_torch_with_the_collector_paused_and_freezes_what_it_built(collecting):
    # A rank's start (and a replacement's) imports torch and torch._dynamo (every torch.optim
    # optimizer imports it): with the collector paused, ~20 % less CPU. One collection then
    # (where the collector was on), the collector is as it was found afterwards, and what
    # the imports built is out of its later passes.
    code = (
        "import gc, sys\n"
        f"gc.enable() if {collecting} else gc.disable()\n"
        "from stalwart.orchestrator.worker.remote import import_train_worker\n"
        "before = gc.get_freeze_count()\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: seen.append(phase))\n"
        "cls = import_train_worker()\n"
        "print(cls.__name__, 'torch._dynamo' in sys.modules, gc.isenabled(), len(seen),\n"
        "      gc.get_freeze_count() - before > 50_000)"
    )
    out = _python(code).stdout.split()
    # len(seen): a collection's start and stop, once, or none
    assert out == ["TrainWorker", "True", str(collecting), "2" if collecting else "0", "True"]

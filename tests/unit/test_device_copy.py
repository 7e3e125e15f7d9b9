"""ckpt/device_copy.py on a fake CUDA: the order of the copies, events and waits, the guard
that keeps the optimizer off the parameters until the copy read them, the two alternating
pinned buffers, and bench/gpu_check.py's refusal without CUDA.

The fake's training stream runs everything at once (as the host does); its side streams run
their work only when something has to wait for it (an event's synchronize(), a stream
waiting on one of their events). A copy thus runs at the latest moment the real device may
run it, and reads its source then: a step that changed a parameter before the copy was
waited for shows in the snapshot.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from stalwart.ckpt.device_copy import AsyncCapture
from stalwart.ckpt.skeleton import UnsafeState
from stalwart.ckpt.snapshot import SnapshotBuffer

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
WAIT = 10.0


class FakeStream:
    def __init__(self, name: str, immediate: bool):
        self.name, self.immediate = name, immediate
        self.queue: list[tuple] = []


class FakeEvent:
    def __init__(self, name: str):
        self.name = name
        self.stream: FakeStream | None = None
        self.done = False


class FakeCuda:
    """The DeviceApi on CPU. A tensor is "on the GPU" when on_device says so (by default:
    floating point with at least one dimension: parameters, moments, running statistics;
    Adam's step counters, the RNG state and integer counters stay "on the host")."""

    def __init__(self, on_device=None):
        self.on_device = on_device or (lambda t: t.is_floating_point() and t.dim() > 0)
        self.lock = threading.RLock()
        self.log: list[tuple] = []
        self.training = FakeStream("training", immediate=True)
        self.sides: list[FakeStream] = []
        self.events = 0
        self.allocations = 0
        self.copied: list[torch.Tensor] = []  # every source a side stream was given
        self.recorded: list[tuple[torch.Tensor, str]] = []

    def is_device(self, t):
        return self.on_device(t)

    def current_stream(self, device):
        return self.training

    def new_stream(self, device):
        self.sides.append(FakeStream(f"side{len(self.sides)}", immediate=False))
        return self.sides[-1]

    def new_event(self):
        self.events += 1
        return FakeEvent(f"e{self.events}")

    def record(self, event, stream):
        with self.lock:
            self.log.append(("record", event.name, stream.name))
            event.stream, event.done = stream, stream.immediate
            if not stream.immediate:
                stream.queue.append(("event", event))

    def wait_event(self, stream, event):
        with self.lock:
            self.log.append(("wait", stream.name, event.name))
            if stream.immediate:  # what the training stream does next comes after the event
                self._run_until(event)
            else:  # the training stream's events are complete when recorded
                assert event.done and event.stream.immediate

    def copy(self, stream, dsts, srcs):
        with self.lock:
            assert not stream.immediate, "a copy issued on the training stream"
            self.log.append(("copy", stream.name, len(srcs)))
            self.copied += srcs
            stream.queue.append(("copy", list(dsts), list(srcs)))

    def record_stream(self, t, stream):
        self.recorded.append((t, stream.name))

    def synchronize(self, event):
        with self.lock:
            self.log.append(("synchronize", event.name, threading.current_thread().name))
            self._run_until(event)

    def query(self, event):
        return event.done

    def pinned(self, nbytes):
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def _run_until(self, event):
        assert event.stream is not None, f"{event.name} was never recorded"
        while not event.done:
            op = event.stream.queue.pop(0)
            if op[0] == "copy":
                torch._foreach_copy_(op[1], op[2])  # reads the sources now
                self.log.append(("copy_run", event.stream.name))
            else:
                op[1].done = True

    def index(self, entry: tuple, start: int = 0) -> int:
        return self.log.index(entry, start)

    def ops(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[0] == kind]


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def state_of(model, optimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }


def reference(step: int, state) -> str:
    return SnapshotBuffer().capture(step, state).digest()


def test_the_guard_keeps_the_next_step_out_of_the_snapshot():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    opt.register_step_post_hook(lambda *a: api.log.append(("stepped",)))
    train(model, opt, 2)
    state = state_of(model, opt, 2)
    want = reference(2, state)

    pending = cap.capture(2, state)
    assert not pending.ready()  # issued, not run: capture() returned without waiting
    assert api.ops("synchronize") == []
    [issued, waited, copy, done] = api.log[-4:]
    assert issued == ("record", "e1", "training")  # after this step's work
    assert waited == ("wait", "side0", "e1")  # the side stream waits for it ...
    assert copy[:2] == ("copy", "side0")  # ... before its copies
    assert done == ("record", "e2", "side0")

    train(model, opt, 1, seed=2)  # the next forward changes BatchNorm's statistics in place,
    # the step the parameters and moments: the fence came first, on the device
    fence = api.index(("wait", "training", "e2"))
    assert api.index(("copy_run", "side0"), fence) < api.index(("stepped",), fence)
    assert api.ops("synchronize") == []  # the training thread never waited on the host

    snap = pending.wait()
    assert snap.digest() == want
    assert snap.metas == SnapshotBuffer().capture(2, state).metas
    bn = model[1]
    assert cap.stats.cloned_bytes == (bn.running_mean.numel() + bn.running_var.numel()) * 4


def test_without_the_guard_the_next_step_corrupts_the_snapshot():
    """The check above can fail: with neither the guard nor clones, the deferred copy reads
    the parameters after the next step changed them."""
    api = FakeCuda()
    cap = AsyncCapture(api, unguarded="trust")
    model, opt = make_model()
    train(model, opt, 2)
    state = state_of(model, opt, 2)
    want = reference(2, state)
    pending = cap.capture(2, state)
    train(model, opt, 1, seed=2)
    assert cap.stats.cloned_bytes == 0
    assert pending.wait().digest() != want


def test_unguarded_tensors_are_cloned_at_capture_time():
    api = FakeCuda()
    cap = AsyncCapture(api)  # no guard: every "GPU" tensor is cloned on the training stream
    model, opt = make_model()
    train(model, opt, 2)
    state = state_of(model, opt, 2)
    want = reference(2, state)
    pending = cap.capture(2, state)
    train(model, opt, 1, seed=2)
    assert api.ops("wait")[-1] == ("wait", "side0", "e1")  # no fence without a guard
    assert pending.wait().digest() == want
    on_gpu = [t for t in _tensors(state) if api.on_device(t)]
    assert cap.stats.cloned_bytes == sum(t.numel() * t.element_size() for t in on_gpu)


def test_every_source_is_kept_from_the_caching_allocator():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    train(model, opt, 1)
    cap.capture(1, state_of(model, opt, 1)).release()
    assert api.copied and len(api.recorded) == len(api.copied)
    for (t, stream), src in zip(api.recorded, api.copied, strict=True):
        assert t is src and stream == "side0"


def test_cpu_tensors_are_copied_at_once_and_gpu_ones_on_the_side_stream():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    train(model, opt, 1)
    state = state_of(model, opt, 1)
    pending = cap.capture(1, state)
    snap = pending._snapshot  # before the copy ran: the host part is there already
    sync = SnapshotBuffer().capture(1, state)
    raw, want = snap.payload.numpy(), sync.payload.numpy()
    for m, t in zip(snap.metas, _tensors(state), strict=True):
        part = slice(m.offset, m.offset + m.nbytes)
        if not api.on_device(t):
            assert (raw[part] == want[part]).all()
    n_gpu = sum(1 for t in _tensors(state) if api.on_device(t))
    assert api.ops("copy") == [("copy", "side0", n_gpu)]
    assert pending.wait().digest() == sync.digest()


def _tensors(state):
    from stalwart.ckpt.snapshot import _split

    out: list[torch.Tensor] = []
    _split(state, out, set())
    return out


def test_a_state_without_gpu_tensors_takes_the_plain_path():
    api = FakeCuda(on_device=lambda t: False)
    cap = AsyncCapture(api)
    state = {"w": torch.arange(10.0), "n": torch.tensor(3), "note": "x"}
    pending = cap.capture(0, state)
    assert pending.ready()
    assert api.log == [] and api.sides == []  # no stream, no event, no copy
    assert pending.wait().digest() == reference(0, state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_every_capture_is_synchronous():
    cap = AsyncCapture()
    assert cap.api is None
    state = {"w": torch.randn(100), "opt": {"m": [torch.ones(3, 3)]}}
    with cap.capture(5, state) as snap:
        assert snap.digest() == reference(5, state)
    assert cap.free_buffers() == 2


def test_two_buffers_alternate_and_a_third_capture_waits_for_a_release():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    train(model, opt, 1)
    first = cap.capture(1, state_of(model, opt, 1))
    train(model, opt, 1)
    second = cap.capture(2, state_of(model, opt, 2))
    ptr = [p.wait().payload.data_ptr() for p in (first, second)]
    assert ptr[0] != ptr[1]
    assert cap.free_buffers() == 0

    train(model, opt, 1)
    state = state_of(model, opt, 3)
    want = reference(3, state)
    got: list = []
    third = threading.Thread(target=lambda: got.append(cap.capture(3, state)))
    third.start()
    third.join(0.2)
    assert third.is_alive() and len(api.ops("copy")) == 2  # the first buffer is still held
    first_digest = first.wait().digest()
    first.release()
    third.join(WAIT)
    assert not third.is_alive()
    [pending] = got
    snap = pending.wait()
    assert snap.payload.data_ptr() == ptr[0]  # the released buffer, reused
    assert snap.digest() == want != first_digest
    assert cap.stats.wait_seconds > 0.1
    with pytest.raises(RuntimeError, match="released"):
        first.wait()
    second.release()
    pending.release()
    assert api.allocations == 2


def test_buffers_and_views_are_made_once_per_layout():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    views = []
    for step in range(6):
        train(model, opt, 1, seed=step)
        state = state_of(model, opt, step)
        with cap.capture(step, state) as snap:
            assert snap.digest() == reference(step, state)
        views.append([id(s.views) for s in cap._slots])
    assert api.allocations == 2
    assert views[-1] == views[1]
    bigger = {**state_of(model, opt, 6), "extra": torch.randn(1000)}
    with cap.capture(6, bigger) as snap:
        assert snap.digest() == reference(6, bigger)
    assert api.allocations == 3


def test_a_consumer_thread_hands_over_while_training_goes_on():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    cap.guard(opt)
    handles: list = []
    got: dict[int, str] = {}
    ready = threading.Semaphore(0)

    def consumer() -> None:
        for _ in range(8):
            ready.acquire()
            pending = handles.pop(0)
            with pending as snap:
                got[snap.step] = snap.digest()

    thread = threading.Thread(target=consumer, name="consumer")
    thread.start()
    want = {}
    for step in range(8):
        train(model, opt, 1, seed=step)
        state = state_of(model, opt, step)
        want[step] = reference(step, state)
        handles.append(cap.capture(step, state))
        ready.release()
    thread.join(WAIT)
    assert got == want
    assert {e[2] for e in api.ops("synchronize")} == {"consumer"}


def test_a_removed_guard_no_longer_fences():
    api = FakeCuda()
    cap = AsyncCapture(api)
    model, opt = make_model()
    remove = cap.guard(opt)
    train(model, opt, 1)
    cap.capture(1, state_of(model, opt, 1))
    remove()
    train(model, opt, 1)
    assert not any(e[:2] == ("wait", "training") for e in api.log)


def test_a_state_the_allow_list_refuses_issues_nothing():
    api = FakeCuda()
    cap = AsyncCapture(api)
    with pytest.raises(UnsafeState):
        cap.capture(0, {"w": torch.ones(4), "lock": threading.Lock()})
    assert api.log == [] and cap.free_buffers() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_says_there_is_no_cuda():
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py"], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0], done.stderr

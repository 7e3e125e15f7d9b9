"""orchestrator/chaos/actions.py: the process tree, the raylet check and fault dispatch
(no killing)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from stalwart.orchestrator.chaos import actions as chaos
from stalwart.orchestrator.chaos.actions import carry_out, descendants, raylet_of_this_worker
from stalwart.orchestrator.spec import GpuXid, Slow

T = TypeVar("T")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def parent_of(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def wait_until(probe: Callable[[], T], ok: Callable[[T], bool], deadline_s: float = 10.0) -> T:
    """Probe until `ok` holds (processes need a moment to fork and exec) or the deadline
    passes; returns the last probe either way, for the test to judge."""
    deadline = time.monotonic() + deadline_s
    seen = probe()
    while not ok(seen) and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = probe()
    return seen


def commands(pids: list[int]) -> list[str]:
    return sorted(" ".join(cmdline(p)) for p in pids)


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in reversed(descendants(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=10)


def test_descendants_finds_a_shells_children():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30"])
    try:
        found = wait_until(
            lambda: descendants(proc.pid), lambda f: commands(f) == ["sleep 30", "sleep 30"]
        )
        assert len(found) == 2
        assert len(set(found)) == 2
        for pid in found:
            assert cmdline(pid) == ["sleep", "30"]
            assert parent_of(pid) == proc.pid
        assert proc.pid not in found
        assert os.getpid() not in found
    finally:
        kill_tree(proc)


def test_descendants_of_a_tree_lists_parents_before_their_children():
    # outer sh -> (inner sh -> sleep, sleep), sleep
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 31 & sleep 31' & sleep 30"])
    try:
        want = ["sh -c sleep 31 & sleep 31", "sleep 30", "sleep 31", "sleep 31"]
        found = wait_until(lambda: descendants(proc.pid), lambda f: commands(f) == want)
        assert commands(found) == want
        # kill_node kills in reverse: every process must come after its parent.
        for i, pid in enumerate(found):
            ppid = parent_of(pid)
            assert ppid == proc.pid or ppid in found[:i]
    finally:
        kill_tree(proc)


def test_descendants_of_a_childless_process_is_empty():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert descendants(proc.pid) == []
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_raylet_of_this_worker_refuses_a_parent_that_is_not_a_raylet():
    ppid = os.getppid()
    name = cmdline(ppid)[0]
    with pytest.raises(RuntimeError) as info:
        raylet_of_this_worker()
    message = str(info.value)
    assert f"pid {ppid}, {name})" in message
    assert "is not a raylet" in message


def test_raylet_of_this_worker_accepts_a_raylet_parent(monkeypatch):
    # A process whose command is .../raylet, standing in for this worker's parent.
    proc = subprocess.Popen(["/opt/ray/core/src/ray/raylet/raylet", "30"], executable="sleep")
    try:
        argv = wait_until(lambda: cmdline(proc.pid), bool)  # exec'd
        assert argv[0].endswith("/raylet")
        monkeypatch.setattr(chaos.os, "getppid", lambda: proc.pid)
        assert raylet_of_this_worker() == proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def slow_down(self, factor: float) -> None:
        self.calls.append(("slow_down", factor))

    def inject_gpu_fault(self, xid: int) -> None:
        self.calls.append(("inject_gpu_fault", xid))

    def carry_out(self, fault: dict) -> None:
        carry_out(fault, slow_down=self.slow_down, inject_gpu_fault=self.inject_gpu_fault)


def test_slow_fault_slows_down_by_its_factor():
    rec = Recorder()
    rec.carry_out(Slow(kind="slow", rank=1, at_step=3, factor=2.5).model_dump())
    assert rec.calls == [("slow_down", 2.5)]


def test_gpu_xid_fault_injects_its_xid():
    rec = Recorder()
    rec.carry_out(GpuXid(kind="gpu_xid", rank=0, at_step=7, xid=79).model_dump())
    assert rec.calls == [("inject_gpu_fault", 79)]


def test_unknown_fault_kind_is_an_error():
    rec = Recorder()
    with pytest.raises(ValueError, match="unknown chaos fault kind 'melt_gpu'"):
        rec.carry_out({"kind": "melt_gpu", "rank": 0, "at_step": 1})
    assert rec.calls == []

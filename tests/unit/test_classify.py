"""health/classify.py: what an exception or a process death says about its cause."""

from __future__ import annotations

import pytest

from stalwart.health.classify import classify_death, classify_exception
from stalwart.health.observations import FailureKind

# Ray's text for an actor whose process was SIGKILLed: it guesses at OOM but does not know.
RAY_SIGKILL = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
    "file. There are some potential root causes. (1) The process is killed by SIGKILL by OOM "
    "killer due to high memory usage. (2) ray stop --force is called. (3) The worker is "
    "crashed unexpectedly due to SIGSEGV or other unexpected errors. The worker may have been "
    "killed due to OOM."
)
# Ray's memory monitor, which did kill the worker for memory.
RAY_MEMORY_MONITOR = (
    "Task was killed due to the node running low on memory. Memory on the node (IP: "
    "10.0.0.3, ID: 5f1c) where the task (actor ID: 9a2b) was running was 61.2GB / 64.0GB "
    "(0.956), which exceeds the memory usage threshold of 0.95. Ray killed this worker "
    "(ID: 77aa) because it was the most recently scheduled task."
)

# --- exceptions -------------------------------------------------------------------------------


@pytest.mark.parametrize("error_type", ["OutOfMemoryError", "MemoryError"])
@pytest.mark.parametrize("comm", [False, True])
def test_oom_types(error_type, comm):
    assert classify_exception(error_type, "", comm) is FailureKind.OOM


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)",
        "CUDA error: out of memory",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes; "
        "out of memory",
    ],
)
def test_oom_text_in_any_exception(message):
    assert classify_exception("RuntimeError", message) is FailureKind.OOM


def test_oom_text_wins_over_comm_markers():
    message = "NCCL error: unhandled cuda error, NCCL version 2.21: CUDA out of memory"
    assert classify_exception("DistBackendError", message, True) is FailureKind.OOM


@pytest.mark.parametrize(
    "message",
    [
        "Connection reset by peer",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer",
        "Connection refused",
        "Broken pipe",
        "NCCL communicator was aborted on rank 1",
        "Socket Timeout",
        "Timed out waiting 1800000ms for recv operation to complete",
        "ProcessGroup aborted",
    ],
)
def test_comm_markers_with_a_comm_error_type(message):
    assert classify_exception("RuntimeError", message, comm_error_type=True) is (
        FailureKind.COMM_ERROR
    )


@pytest.mark.parametrize(
    "message",
    ["Connection reset by peer", "NCCL communicator was aborted", "Timed out", "gloo"],
)
def test_comm_markers_without_a_comm_error_type_are_user_errors(message):
    # A user's own exception mentioning a transport word is still the user's.
    assert classify_exception("ValueError", message) is FailureKind.USER_ERROR
    assert classify_exception("RuntimeError", message, comm_error_type=False) is (
        FailureKind.USER_ERROR
    )


def test_marker_in_the_type_name_counts_for_a_comm_type():
    assert classify_exception("ProcessGroupGlooError", "", True) is FailureKind.COMM_ERROR


def test_comm_type_without_markers_is_a_user_error():
    message = "mat1 and mat2 shapes cannot be multiplied"
    assert classify_exception("RuntimeError", message, True) is FailureKind.USER_ERROR


@pytest.mark.parametrize(
    ("error_type", "message"),
    [("ValueError", "bad batch"), ("KeyError", "'labels'"), ("ZeroDivisionError", "")],
)
def test_plain_user_errors(error_type, message):
    assert classify_exception(error_type, message) is FailureKind.USER_ERROR


def test_markers_are_case_sensitive():
    assert classify_exception("RuntimeError", "connection reset", True) is FailureKind.USER_ERROR


# --- process deaths ---------------------------------------------------------------------------


def test_ray_sigkill_oom_guess_is_a_worker_death():
    assert "OOM" in RAY_SIGKILL
    assert classify_death(RAY_SIGKILL) is FailureKind.WORKER_DIED


def test_ray_memory_monitor_kill_is_oom():
    assert classify_death(RAY_MEMORY_MONITOR) is FailureKind.OOM


@pytest.mark.parametrize("message", ["", "actor died", "SIGSEGV", "out of memory?"])
def test_other_deaths_are_worker_deaths(message):
    assert classify_death(message) is FailureKind.WORKER_DIED

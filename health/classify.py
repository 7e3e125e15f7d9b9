"""Failure classification: what an exception or a process death says about its cause."""

from __future__ import annotations

from stalwart.health.observations import FailureKind

# Transport failures of a collective, as gloo and NCCL word them.
COMM_MARKERS = (
    "Connection reset",
    "Connection closed",
    "Connection refused",
    "Broken pipe",
    "gloo",
    "NCCL",
    "Socket Timeout",
    "Timed out",
    "ProcessGroup",
)

OOM_TYPES = frozenset({"OutOfMemoryError", "MemoryError"})
OOM_MARKERS = ("CUDA out of memory", "out of memory")


def classify_exception(error_type: str, message: str, comm_error_type: bool = False) -> FailureKind:
    """Classify an exception raised in a worker's train loop.

    `comm_error_type`: the exception's type is one a collective raises (RuntimeError,
    DistBackendError, the group's abort), so transport wording in it means a comm error.
    """
    text = f"{error_type}: {message}"
    if error_type in OOM_TYPES or any(m in text for m in OOM_MARKERS):
        return FailureKind.OOM
    if comm_error_type and any(m in text for m in COMM_MARKERS):
        return FailureKind.COMM_ERROR
    return FailureKind.USER_ERROR


def classify_death(message: str) -> FailureKind:
    """Classify a worker process that died, from Ray's actor-death text.

    Ray's text for any SIGKILLed actor *guesses* at OOM ("may have been killed due to
    OOM"); only the memory monitor's own report ("running low on memory") is taken as one.
    """
    if "running low on memory" in message:
        return FailureKind.OOM
    return FailureKind.WORKER_DIED

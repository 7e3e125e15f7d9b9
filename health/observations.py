"""What the supervisor saw, as frozen facts. Policies read these; nothing mutates them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureKind(enum.Enum):
    WORKER_DIED = "worker_died"  # the rank's process is gone (SIGKILL, OOM killer, crash)
    USER_ERROR = "user_error"  # the train loop raised an exception of its own
    COMM_ERROR = "comm_error"  # a collective failed (peer gone, connection reset)


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure as the supervisor saw it."""

    kind: FailureKind
    rank: int
    node: str | None
    at: float  # when the supervisor observed it
    step: int | None = None  # last step the rank completed, if known
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    injected_at: float | None = None  # when a chaos fault fired, if this was one


@dataclass(frozen=True)
class Budget:
    """What recovery may still spend."""

    restarts_used: int
    max_restarts: int | None  # None: unlimited
    user_errors_seen: int
    user_error_retries: int

    @property
    def restarts_left(self) -> int | None:
        if self.max_restarts is None:
            return None
        return max(0, self.max_restarts - self.restarts_used)

"""The job's event log: an append-only list of JSON-able dicts, read by offset."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._clock = clock
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener` with every event emitted from now on (after it is logged). A
        listener that raises is logged and skipped: it cannot lose an event for the log."""
        self._listeners.append(listener)

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        if {"ts", "type", "seq"} & fields.keys():
            raise ValueError(f"event fields may not be named ts, type or seq: {sorted(fields)}")
        event = {"ts": round(self._clock(), 6), "type": type_, **fields}
        with self._lock:
            event["seq"] = len(self._events)
            self._events.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", type_)
        return event

    def since(self, offset: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events[offset:])

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._events if e["type"] == type_]

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

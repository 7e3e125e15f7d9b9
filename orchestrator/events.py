"""The job's event log: an append-only sequence of JSON-able dicts, read by offset.

The driver streams it to OUTPUT/events.jsonl as it goes; the supervisor keeps only the
newest `keep` events (a month-long run writes a throughput event every second, and every
hang's stacks), so a driver that falls that far behind is told how many it missed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


EVENTS_KEPT = 20_000  # in the supervisor's memory, at most (about 10 MB)


class EventLog:
    def __init__(self, clock: Callable[[], float] = time.time, keep: int = EVENTS_KEPT):
        self._events: list[dict[str, Any]] = []
        self._first = 0  # the seq of _events[0]: older ones were let go
        self._keep = keep
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
            event["seq"] = self._first + len(self._events)
            self._events.append(event)
            if len(self._events) > self._keep + self._keep // 4:
                # Amortized: let the oldest quarter go at once.
                drop = len(self._events) - self._keep
                del self._events[:drop]
                self._first += drop
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", type_)
        return event

    def since(self, offset: int) -> list[dict[str, Any]]:
        """Events numbered `offset` on (those still kept)."""
        with self._lock:
            return list(self._events[max(offset - self._first, 0) :])

    def missed(self, offset: int) -> int:
        """How many events from `offset` on are no longer kept."""
        with self._lock:
            return max(self._first - offset, 0)

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._events if e["type"] == type_]

    def __len__(self) -> int:
        """Events emitted in all (kept or not)."""
        with self._lock:
            return self._first + len(self._events)

"""The lines the ranks printed (worker/output.py ships them), kept for the driver.

A bounded window in memory: the driver takes the lines as they come (`since`) and keeps
them all under OUTPUT/logs/; a driver that falls behind by more than the window is told
how many it missed.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

MAX_LINES = 20_000
BATCH_LINES = 2_000  # lines handed over per poll at most


class OutputLog:
    def __init__(self, max_lines: int = MAX_LINES):
        self._lines: deque[dict[str, Any]] = deque(maxlen=max_lines)
        self._next = 0
        self._lock = threading.Lock()

    def add(self, lines: list[dict[str, Any]]) -> None:
        with self._lock:
            for line in lines:
                self._lines.append({**line, "seq": self._next})
                self._next += 1

    def since(self, seq: int, limit: int = BATCH_LINES) -> dict[str, Any]:
        """Lines numbered `seq` and later (at most `limit`); `next`: where to ask next;
        `missed`: lines that left the window before they were asked for."""
        with self._lock:
            oldest = self._lines[0]["seq"] if self._lines else self._next
            start = max(seq, oldest)
            first = start - oldest
            lines = list(itertools.islice(self._lines, first, first + limit))
            return {
                "lines": lines,
                "next": start + len(lines),
                "missed": max(0, oldest - seq),
                "more": start + len(lines) < self._next,
            }

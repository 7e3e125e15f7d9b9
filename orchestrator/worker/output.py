"""What a train loop prints, on its way to the user's terminal and the run directory.

Ray runs the workers with ``log_to_driver=False`` (its own prefixes and messages would
swamp the progress view), so a loop's ``print`` and ``logging`` went nowhere the user
looks. The worker replaces ``sys.stdout`` and ``sys.stderr`` with tees: each write still
reaches the original stream (Ray's worker log file), and each completed line is tagged
with the time, rank, generation and stream and shipped in batches to the node's agent, at
most every `interval_s`, never piling calls up (a batch waits while the last one is in
flight); the agent hands them to the supervisor with its report (one call per node, not
per rank). The driver writes them under OUTPUT/logs/ and shows rank 0's live. A forked
child (a DataLoader worker) prints to the original streams only.

``logging`` handlers write to ``sys.stderr`` as it is when they are created, and the
last-resort handler to the current one, so a loop's logging is captured too. Output of
native code to file descriptors 1 and 2 is not (it stays in Ray's worker log).

At most `max_lines` lines wait to be shipped; beyond that the oldest are dropped and a
line says how many. A line longer than MAX_LINE_CHARS is cut.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

MAX_LINE_CHARS = 8192
TAIL_LINES = 20  # a failing rank's last lines, shown beside its traceback


class _Tee(io.TextIOBase):
    def __init__(self, original: Any, stream: str, capture: OutputCapture):
        self._original = original
        self._stream = stream
        self._capture = capture
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        # buffer, errors, reconfigure(line_buffering=True), ...: the original stream's.
        return getattr(self._original, name)

    @property
    def encoding(self) -> str:
        return getattr(self._original, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._original.fileno()

    def write(self, text: str) -> int:
        # A closed original stream: the copy still goes to the supervisor.
        with contextlib.suppress(OSError, ValueError):
            self._original.write(text)
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._capture.add(self._stream, line)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._original.flush()

    def flush_partial(self) -> None:
        with self._lock:
            partial, self._partial = self._partial, ""
        if partial:
            self._capture.add(self._stream, partial)


class OutputCapture:
    """`tag()` -> (rank, generation) of the lines written now; `send(lines)` ships a batch
    (returns an ObjectRef, or None when there is nobody to send to)."""

    def __init__(
        self,
        tag: Callable[[], tuple[int | None, int]],
        send: Callable[[list[dict[str, Any]]], Any],
        interval_s: float = 0.5,
        max_lines: int = 5000,
        arrived: Callable[[Any, float], bool] | None = None,
    ):
        self._tag = tag
        self._send = send
        self._arrived = arrived or _arrived
        self._interval_s = interval_s
        self._lines: deque[dict[str, Any]] = deque()
        self._max_lines = max_lines
        self._dropped = 0
        self._tail: dict[int | None, deque[str]] = {}
        self._lock = threading.Lock()  # the lines waiting
        self._ship_lock = threading.Lock()
        self._in_flight: Any = None
        self._tees: list[_Tee] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stalwart-output", daemon=True)

    def install(self) -> None:
        """Tee sys.stdout and sys.stderr from now on, and start shipping."""
        originals = sys.stdout, sys.stderr
        out, err = _Tee(sys.stdout, "out", self), _Tee(sys.stderr, "err", self)
        self._tees = [out, err]
        sys.stdout, sys.stderr = out, err

        def in_child() -> None:
            # A forked child (a DataLoader worker) has no shipping thread, and a lock held
            # at the fork would stay held: it prints to the original streams (Ray's log).
            sys.stdout, sys.stderr = originals

        os.register_at_fork(after_in_child=in_child)
        self._thread.start()

    def add(self, stream: str, line: str) -> None:
        rank, generation = self._tag()
        line = line.rstrip("\r")
        if "\r" in line:  # a progress bar redrawing itself: its last state
            line = line.rsplit("\r", 1)[1]
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + " [... cut]"
        record = {"ts": time.time(), "rank": rank, "gen": generation, "stream": stream}
        with self._lock:
            self._lines.append({**record, "line": line})
            if len(self._lines) > self._max_lines:
                self._lines.popleft()
                self._dropped += 1
            self._tail.setdefault(rank, deque(maxlen=TAIL_LINES)).append(line)

    def tail(self, rank: int | None) -> list[str]:
        """The last lines `rank` printed (for a failure's report)."""
        with self._lock:
            return list(self._tail.get(rank, ()))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Ship what is waiting now and wait for it (before a failure is reported)."""
        for tee in self._tees:
            tee.flush_partial()
        self._ship(wait_s=timeout_s)

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._ship(wait_s=0.0)

    def _ship(self, wait_s: float) -> None:
        with self._ship_lock:  # the loop's thread and a flush: one shipper at a time
            if self._in_flight is not None:
                if not self._arrived(self._in_flight, wait_s):
                    return  # the last batch is still on its way: this one waits
                self._in_flight = None
            with self._lock:
                batch, dropped = list(self._lines), self._dropped
                self._lines.clear()
                self._dropped = 0
            if not batch:
                return
            if dropped:
                batch.insert(
                    0,
                    {
                        **{k: batch[0][k] for k in ("ts", "rank", "gen")},
                        "stream": "err",
                        "line": f"[stalwart: {dropped} lines dropped, output too fast]",
                    },
                )
            try:
                ref = self._send(batch)
            except Exception:  # the agent is gone: the lines stay in Ray's worker log
                return
            if ref is None:  # nobody to send to yet: the lines wait (still bounded)
                with self._lock:
                    self._lines.extendleft(reversed(batch[1:] if dropped else batch))
                    self._dropped += dropped
                return
            self._in_flight = ref
            if wait_s and self._arrived(ref, wait_s):
                self._in_flight = None


def _arrived(ref: Any, wait_s: float) -> bool:
    """Whether the batch sent as `ref` was taken (or failed: the agent is gone, and its
    lines with it), waiting up to `wait_s`."""
    ready, _ = ray.wait([ref], timeout=wait_s)
    if ready:
        with contextlib.suppress(Exception):
            ray.get(ready[0])
    return bool(ready)

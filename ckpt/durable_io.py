"""The durable tier's I/O against one fsspec file system (ckpt/durable.py lays the
checkpoints out on top of it): each operation retried with exponential backoff on OSError
(ENOSPC included) until `DurableError` names the path and the last error; files written
whole or not at all under their final name on a local file system (a hidden temp name in
the same directory, fsync, rename, fsync of the directory), written to the final name and
removed again on failure elsewhere (an object store's puts are atomic); and the chaos
outage (`fail_for`), which makes every operation fail for a while.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec.implementations.local import LocalFileSystem

from stalwart.ckpt.manifest import DurableError

log = logging.getLogger("stalwart.ckpt.durable")

_T = TypeVar("_T")


class StorageIO:
    """`show(path)` is how a message names a path (the URL on an object store); `clock`
    and `sleep` are injectable (tests drive them); `retries` is how many times a failed
    operation is retried, after backoff_s, 2*backoff_s, 4*backoff_s, ..."""

    def __init__(
        self,
        fs: Any,
        show: Callable[[str], str],
        retries: int,
        backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        self._show = show
        self.retries = retries
        self.backoff_s = backoff_s
        self._clock = clock
        self._sleep = sleep
        self._down_until: float | None = None
        self._down_for = 0.0

    def fail_for(self, seconds: float) -> None:
        """Chaos: every operation fails with OSError for the next `seconds`."""
        self._down_for = seconds
        self._down_until = self._clock() + seconds

    def _check_up(self) -> None:
        if self._down_until is not None:
            if self._clock() < self._down_until:
                raise OSError(f"storage unavailable (injected by chaos for {self._down_for:g} s)")
            self._down_until = None

    def retry(self, what: str, path: str, op: Callable[[], _T], missing_ok: bool = False) -> _T:
        """Run `op`, retrying OSError with backoff. With missing_ok, FileNotFoundError is
        not an I/O failure: it propagates at once for the caller to handle."""
        last: OSError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                self._check_up()
                return op()
            except OSError as e:
                if missing_ok and isinstance(e, FileNotFoundError):
                    raise
                last = e
            log.warning(
                "%s %s failed (attempt %d of %d): %s",
                what,
                self._show(path),
                attempt + 1,
                self.retries + 1,
                last,
            )
        raise DurableError(
            f"{what} {self._show(path)} failed after {self.retries + 1} attempts: {last}"
        ) from last

    def write(self, path: str, produce: Callable[[Any], _T]) -> _T:
        """One attempt at writing `path` with `produce(file)`; never leaves a partial file
        under the final name on a local file system."""
        directory, name = posixpath.split(path)
        if self.local:
            os.makedirs(directory, exist_ok=True)
            tmp = posixpath.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
            try:
                with open(tmp, "wb") as f:
                    result = produce(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(directory)
            return result
        self.fs.makedirs(directory, exist_ok=True)
        try:
            with self.fs.open(path, "wb") as f:
                return produce(f)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(path)
            raise

    def put(self, what: str, path: str, data: bytes) -> None:
        """Write a small file whole, retried: atomically on a local file system, one put
        elsewhere."""
        if self.local:
            self.retry(what, path, lambda: self.write(path, lambda f: f.write(data)))
            return

        def put() -> None:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe(path, data)

        self.retry(what, path, put)


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (best effort: not every platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

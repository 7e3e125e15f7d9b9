"""The ranks' printed lines in the run directory: OUTPUT/logs/rank-<R>.log, one per rank
across generations, and reading them back (`stalwart logs`).

A line on disk: ``<ISO time> gen <G> <out|err> | <text>``. Lines of a worker that had no
rank yet (a spare starting up) go to spare.log; Ray's own messages to the driver (a worker
it saw die, a node it marked dead) go to ray.log instead of the terminal.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

_LINE = re.compile(r"^(\S+) gen (\d+) (out|err) \| (.*)$")


def _stamp(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).isoformat(timespec="milliseconds")


def live_prefix(line: dict[str, Any]) -> str:
    """How a line shows in `stalwart run`'s terminal."""
    rank = "spare" if line.get("rank") is None else f"rank {line['rank']}"
    return f"[{rank} gen {line.get('gen', 0)}]"


class RunLogs:
    """Appends the lines the driver receives to OUTPUT/logs/."""

    def __init__(self, out: Path):
        self.folder = out / "logs"
        self._files: dict[str, TextIO] = {}
        # The driver's follower and Ray's error listener (ray.log) write from two threads.
        self._lock = threading.Lock()

    def _file(self, name: str) -> TextIO:
        f = self._files.get(name)
        if f is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = (self.folder / name).open("a", encoding="utf-8")
        return f

    def write(self, lines: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            self._write(lines)

    def _write(self, lines: Iterable[dict[str, Any]]) -> None:
        touched = set()
        for line in lines:
            name = "spare.log" if line.get("rank") is None else f"rank-{line['rank']}.log"
            self._file(name).write(
                f"{_stamp(line['ts'])} gen {line.get('gen', 0)} {line['stream']} | {line['line']}\n"
            )
            touched.add(name)
        for name in touched:
            self._files[name].flush()

    def note(self, text: str, name: str = "ray.log") -> None:
        """A message of the driver's own (Ray's, kept out of the terminal)."""
        with self._lock:
            f = self._file(name)
            for line in text.rstrip("\n").split("\n"):
                f.write(f"{_stamp(time.time())} gen 0 err | {line}\n")
            f.flush()

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


class LogError(ValueError):
    pass


def log_files(run_dir: Path, rank: int | None = None) -> list[Path]:
    """The rank logs of a run directory (one rank's with `rank`)."""
    folder = run_dir / "logs"
    if not run_dir.is_dir():
        raise LogError(f"{run_dir}: no such run directory")
    if not folder.is_dir():
        raise LogError(
            f"{run_dir}: no logs/ folder (a run of a stalwart older than its logs, or a job "
            "that printed nothing)"
        )
    if rank is not None:
        path = folder / f"rank-{rank}.log"
        if not path.is_file():
            have = sorted(p.name for p in folder.glob("*.log"))
            raise LogError(f"{path}: rank {rank} printed nothing (there are: {', '.join(have)})")
        return [path]
    return sorted(folder.glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1]))


def parse_line(text: str) -> tuple[str, int, str, str] | None:
    """A line on disk: (its ISO time, generation, stream, what was printed); None for a
    line not in that form."""
    m = _LINE.match(text)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3), m.group(4))


def _parse(path: Path, text: str) -> tuple[str, str]:
    parsed = parse_line(text)
    rank = path.stem.removeprefix("rank-")
    if parsed is None:
        return "", f"[rank {rank}] {text}"
    stamp, gen, _, printed = parsed
    return stamp, f"[rank {rank} gen {gen}] {printed}"


def merged(paths: list[Path], offsets: dict[Path, int] | None = None) -> Iterator[str]:
    """The lines of `paths` in time order, each with its rank and generation; with
    `offsets`, only what was appended since (the offsets are advanced)."""
    rows: list[tuple[str, int, str]] = []
    for i, path in enumerate(paths):
        start = offsets.get(path, 0) if offsets is not None else 0
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        if offsets is not None:
            offsets[path] = start + len(complete)
        # Lines end in "\n" only: splitlines() would also cut at \x0b, \x1c, \u2028, ...
        for raw in complete.decode("utf-8", "replace").split("\n")[:-1]:
            stamp, shown = _parse(path, raw)
            rows.append((stamp, i, shown))
    rows.sort(key=lambda r: (r[0], r[1]))
    for _, _, shown in rows:
        yield shown

"""Reading a run directory (the --run-dir of `stalwart run`): RUN_DIR/events.jsonl (required)
and RUN_DIR/result.json (optional: a run killed mid-way has none). What cannot be read is a
`ReportError` whose message names the file, why, and what was expected there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.orchestrator.observe.analysis import num


class ReportError(Exception):
    """The run directory cannot be reported on (the message says which file and why)."""


@dataclass
class RunData:
    run_dir: Path
    events: list[dict[str, Any]]
    result: dict[str, Any] | None
    skipped_lines: list[int] = field(default_factory=list)  # 1-based numbers of bad lines
    warnings: list[str] = field(default_factory=list)


def load_run(run_dir: str | Path) -> RunData:
    """Read events.jsonl (malformed lines are skipped and counted; none parsing is an error)
    and result.json (absent is allowed; unreadable is an error)."""
    run = Path(run_dir)
    if not run.exists():
        raise ReportError(f"{run}: no such run directory (expected the --run-dir of stalwart run)")
    if not run.is_dir():
        raise ReportError(f"{run}: not a directory (expected the --run-dir of stalwart run)")
    path = run / "events.jsonl"
    if not path.exists():
        raise ReportError(
            f"{path}: missing (expected one JSON event per line, written by stalwart run)"
        )
    try:
        events, skipped = _read_events(path)
    except OSError as e:
        raise ReportError(f"{path}: cannot read it ({_reason(e)})") from e
    if not events:
        if skipped:
            raise ReportError(
                f"{path}: none of its {len(skipped)} line(s) is a JSON event with a numeric ts "
                f"and a type (first bad line: {skipped[0]})"
            )
        raise ReportError(f"{path}: empty (expected one JSON event per line)")
    events.sort(key=lambda e: (e["ts"], num(e.get("seq")) or 0))
    notes = []
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        notes.append(
            f"{path.name}: skipped {len(skipped)} malformed line(s) (line {shown}); "
            "expected a JSON object with ts and type on each line"
        )
    result = None
    rpath = run / "result.json"
    if rpath.exists():
        try:
            result = json.loads(rpath.read_text(encoding="utf-8"))
        except OSError as e:
            raise ReportError(f"{rpath}: cannot read it ({_reason(e)})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportError(f"{rpath}: not valid JSON ({e}); expected the run's summary") from e
        if not isinstance(result, dict):
            raise ReportError(f"{rpath}: expected a JSON object (the run's summary)")
    else:
        notes.append("no result.json: the run did not finish")
    return RunData(run, events, result, skipped, notes)


def _read_events(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The events of a JSON-lines file, and the numbers of the lines that are not one."""
    events: list[dict[str, Any]] = []
    skipped: list[int] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                skipped.append(number)
                continue
            ts = num(event.get("ts")) if isinstance(event, dict) else None
            if ts is None or not isinstance(event.get("type"), str):
                skipped.append(number)
                continue
            event["ts"] = ts
            events.append(event)
    return events, skipped


def _reason(e: OSError) -> str:
    """An OSError's reason without the path the message already names."""
    if e.errno is not None and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__

"""Reading a submitted job's log without reading all of it each time.

The driver's log holds its `STALWART_STATUS {json}` records (a progress snapshot every few
seconds) and, at the end, `STALWART_RESULT {json}`. A job that trains for days writes a
long log: `stalwart status` (and `--watch`, every second or two) reads only its tail
through Ray's log API (`/api/v0/logs/file?submission_id=...&node_id=...&lines=N`), more of
it only when the newest record is further back; `stalwart logs -f` reads it once, as it
grows, through the Jobs API's stream (`JobSubmissionClient.tail_job_logs`), and falls back
to polling from the offset it reached if the stream breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

STATUS_PREFIX = "STALWART_STATUS "
RESULT_PREFIX = "STALWART_RESULT "
STATUS_TAIL_LINES = 500  # the driver's records are a few lines apart; user output between
MAX_TAIL_LINES = 128_000  # past this, the whole log


def parse_status(text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The newest progress record and the result record in `text` (None: not there)."""
    progress = result = None
    for line in text.splitlines():
        if line.startswith(STATUS_PREFIX):
            progress = _json_or_none(line[len(STATUS_PREFIX) :]) or progress
        elif line.startswith(RESULT_PREFIX):
            result = _json_or_none(line[len(RESULT_PREFIX) :]) or result
    return progress, result


def tail(
    address: str,
    headers: dict[str, str],
    submission_id: str,
    node_id: str,
    lines: int,
    timeout_s: float,
) -> str | None:
    """The last `lines` lines of the job's driver log on `node_id` (the driver's node),
    from Ray's log API; None when the cluster does not serve it (the caller reads the
    whole log instead)."""
    import requests

    try:
        r = requests.get(
            f"{address}/api/v0/logs/file",
            params={
                "submission_id": submission_id,
                "node_id": node_id,
                "lines": lines,
                "timeout": int(timeout_s),
            },
            headers=headers,
            timeout=timeout_s,
        )
    except requests.exceptions.RequestException:
        return None
    return r.text if r.status_code == 200 else None


def newest_status(
    read_tail: Callable[[int], str | None], read_all: Callable[[], str]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """parse_status of the shortest tail of the log that holds a record (a job that has
    printed none yet, or a cluster without the log API: the whole log)."""
    lines = STATUS_TAIL_LINES
    while lines <= MAX_TAIL_LINES:
        text = read_tail(lines)
        if text is None:
            break
        progress, result = parse_status(text)
        if progress is not None or result is not None or text.count("\n") < lines - 1:
            return progress, result
        lines *= 4
    return parse_status(read_all())


def stream(client: Any, submission_id: str) -> Iterator[str]:
    """The job's log lines from its start, as they are written, until it ends, through
    the Jobs API's websocket (each byte read once). Raises RuntimeError or OSError if the
    stream breaks (the caller goes on by polling)."""
    import aiohttp

    loop = asyncio.new_event_loop()
    chunks = client.tail_job_logs(submission_id)
    rest = ""
    try:
        while True:
            try:
                chunk = loop.run_until_complete(chunks.__anext__())
            except StopAsyncIteration:
                break
            except aiohttp.ClientError as e:
                raise RuntimeError(f"the log stream broke: {e}") from None
            *lines, rest = (rest + chunk).split("\n")
            yield from lines
        if rest:
            yield rest
    finally:
        with contextlib.suppress(Exception):  # closing a broken stream may raise again
            loop.run_until_complete(chunks.aclose())
        loop.close()


def _json_or_none(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

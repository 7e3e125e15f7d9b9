"""orchestrator/job_logs.py: `stalwart status` reads the shortest tail of a submitted
job's log that holds its newest record (the whole log only where the cluster has no log
API or the job printed none), and `logs -f` reads the stream once, line by line, with a
broken stream reported for the caller to poll from where it got to."""

from __future__ import annotations

import json

import pytest

from stalwart.orchestrator.job_logs import (
    RESULT_PREFIX,
    STATUS_PREFIX,
    STATUS_TAIL_LINES,
    newest_status,
    stream,
)

pytestmark = pytest.mark.timeout(30)


def _log(user_lines_after: int) -> list[str]:
    return [
        STATUS_PREFIX + json.dumps({"step": 1}),
        STATUS_PREFIX + json.dumps({"step": 2}),
        *(f"[rank 0 gen 1] line {i}" for i in range(user_lines_after)),
    ]


class _Reader:
    def __init__(self, lines: list[str], has_api: bool = True) -> None:
        self.lines, self.has_api = lines, has_api
        self.tails: list[int] = []
        self.whole = 0

    def tail(self, n: int) -> str | None:
        if not self.has_api:
            return None
        self.tails.append(n)
        return "\n".join(self.lines[-n:]) + "\n"

    def all(self) -> str:
        self.whole += 1
        return "\n".join(self.lines) + "\n"


def test_the_newest_record_near_the_end_is_read_from_one_short_tail():
    r = _Reader(_log(10))
    assert newest_status(r.tail, r.all) == ({"step": 2}, None)
    assert (r.tails, r.whole) == ([STATUS_TAIL_LINES], 0)


def test_a_record_further_back_is_found_in_longer_tails_not_the_whole_log():
    r = _Reader(_log(3 * STATUS_TAIL_LINES) + ["filler"] * 100_000)
    assert newest_status(r.tail, r.all) == ({"step": 2}, None)
    assert r.whole == 0 and r.tails[0] == STATUS_TAIL_LINES and len(r.tails) == 5


def test_the_result_is_read_with_the_progress_before_it():
    lines = [*_log(2), RESULT_PREFIX + json.dumps({"status": "succeeded"})]
    r = _Reader(lines)
    assert newest_status(r.tail, r.all) == ({"step": 2}, {"status": "succeeded"})


def test_a_short_log_without_records_and_a_cluster_without_the_log_api():
    r = _Reader(["[rank 0 gen 1] starting"])
    assert newest_status(r.tail, r.all) == (None, None)
    assert r.whole == 0  # the tail was the whole log
    old = _Reader(_log(1), has_api=False)
    assert newest_status(old.tail, old.all) == ({"step": 2}, None) and old.whole == 1


class _Client:
    def __init__(self, chunks: list[str], error: Exception | None = None) -> None:
        self.chunks, self.error = chunks, error

    async def tail_job_logs(self, submission_id: str):
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


def test_the_stream_is_cut_into_lines_across_chunks():
    client = _Client(["a\nb", "c\n", "d\ne"])
    assert list(stream(client, "raysubmit_1")) == ["a", "bc", "d", "e"]


def test_a_broken_stream_raises_after_the_whole_lines_it_had():
    import aiohttp

    client = _Client(["a\nb"], aiohttp.ClientConnectionError("reset"))
    got = []
    with pytest.raises(RuntimeError, match="the log stream broke"):
        for line in stream(client, "raysubmit_1"):
            got.append(line)
    assert got == ["a"]  # "b" was not whole: the poll goes on from before it

"""The ranks' printed lines: captured in the worker (worker/output.py), kept by the
supervisor (supervisor/output.py), written and read back in the run directory
(observe/logs.py, `stalwart logs`)."""

from __future__ import annotations

import logging
import sys

import pytest
from click.testing import CliRunner

from stalwart.orchestrator.cli import main
from stalwart.orchestrator.observe.logs import RunLogs, live_prefix, log_files, merged
from stalwart.orchestrator.supervisor.output import OutputLog
from stalwart.orchestrator.worker.output import TAIL_LINES, OutputCapture

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def capture():
    """An installed capture (installed by the test itself: pytest swaps sys.stdout between
    a test's setup and its call)."""
    sent: list[list[dict]] = []
    state = {"rank": 3, "gen": 1}
    arrived = {"now": True}

    def send(lines):
        sent.append(lines)
        return len(sent)  # a stand-in for the ObjectRef of the call

    cap = OutputCapture(
        tag=lambda: (state["rank"], state["gen"]),
        send=send,
        interval_s=3600,
        arrived=lambda ref, wait_s: arrived["now"],
    )
    cap.arrived = arrived
    saved: list = []

    def install():
        saved.extend([sys.stdout, sys.stderr])
        cap.install()
        return cap, sent, state

    yield install
    if saved:
        sys.stdout, sys.stderr = saved
    cap.close()


def _lines(sent):
    return [(x["rank"], x["gen"], x["stream"], x["line"]) for batch in sent for x in batch]


def test_print_and_logging_are_captured_line_by_line_with_rank_and_generation(capture):
    cap, sent, state = capture()
    print("hello", end="")
    print(" world")
    print("two\nlines")
    handler = logging.StreamHandler()  # binds sys.stderr now: the tee
    log = logging.getLogger("user-loop")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("from logging")
    finally:
        log.removeHandler(handler)
    state["gen"] = 2
    print("after a recovery")
    print("unterminated", end="")
    cap.flush()
    assert _lines(sent) == [
        (3, 1, "out", "hello world"),
        (3, 1, "out", "two"),
        (3, 1, "out", "lines"),
        (3, 1, "err", "from logging"),
        (3, 2, "out", "after a recovery"),
        (3, 2, "out", "unterminated"),
    ]


def test_a_progress_bar_keeps_its_last_state_and_long_lines_are_cut(capture):
    cap, sent, _ = capture()
    print("10%\r50%\r100%")
    print("x" * 20_000)
    cap.flush()
    (_, _, _, bar), (_, _, _, long) = _lines(sent)
    assert bar == "100%"
    assert len(long) < 9000 and long.endswith("[... cut]")


def test_the_tail_holds_the_last_lines_and_a_flood_is_counted_not_kept(capture):
    cap, sent, _ = capture()
    cap._max_lines = 50
    for i in range(120):
        print(f"line {i}")
    assert cap.tail(3) == [f"line {i}" for i in range(120 - TAIL_LINES, 120)]
    cap.flush()
    lines = [x[3] for x in _lines(sent)]
    assert lines[0] == "[stalwart: 70 lines dropped, output too fast]"
    assert lines[1:] == [f"line {i}" for i in range(70, 120)]


def test_the_supervisor_keeps_a_window_and_says_what_a_slow_reader_missed():
    log = OutputLog(max_lines=5)
    log.add([{"line": f"a{i}"} for i in range(3)])
    got = log.since(0)
    assert [x["line"] for x in got["lines"]] == ["a0", "a1", "a2"]
    assert (got["next"], got["missed"]) == (3, 0)
    log.add([{"line": f"b{i}"} for i in range(6)])
    got = log.since(3)
    assert [x["line"] for x in got["lines"]] == ["b1", "b2", "b3", "b4", "b5"]
    assert (got["next"], got["missed"]) == (9, 1)
    assert log.since(9)["lines"] == []
    assert [x["line"] for x in log.since(4, limit=2)["lines"]] == ["b1", "b2"]


def _line(ts, rank, gen, text, stream="out"):
    return {"ts": ts, "rank": rank, "gen": gen, "stream": stream, "line": text}


def test_run_logs_are_per_rank_across_generations_and_merge_in_time_order(tmp_path):
    logs = RunLogs(tmp_path)
    logs.write([_line(100.0, 0, 1, "r0 first"), _line(100.5, 1, 1, "r1 first")])
    logs.write([_line(101.0, 0, 2, "r0 after recovery"), _line(100.7, None, 0, "spare")])
    logs.note("(raylet) A worker died or was killed\n  paragraph")
    logs.close()
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["rank-0.log", "rank-1.log", "ray.log", "spare.log"]
    assert "gen 2 out | r0 after recovery" in (tmp_path / "logs" / "rank-0.log").read_text()
    assert [p.name for p in log_files(tmp_path)] == ["rank-0.log", "rank-1.log"]
    assert list(merged(log_files(tmp_path))) == [
        "[rank 0 gen 1] r0 first",
        "[rank 1 gen 1] r1 first",
        "[rank 0 gen 2] r0 after recovery",
    ]
    assert live_prefix(_line(0, 2, 3, "x")) == "[rank 2 gen 3]"
    assert live_prefix(_line(0, None, 1, "x")) == "[spare gen 1]"


def test_merged_with_offsets_returns_only_new_complete_lines(tmp_path):
    logs = RunLogs(tmp_path)
    logs.write([_line(1.0, 0, 1, "one")])
    offsets: dict = {}
    paths = log_files(tmp_path)
    assert list(merged(paths, offsets)) == ["[rank 0 gen 1] one"]
    assert list(merged(paths, offsets)) == []
    logs.write([_line(2.0, 0, 1, "two")])
    assert list(merged(paths, offsets)) == ["[rank 0 gen 1] two"]
    logs.close()


def test_stalwart_logs_prints_a_rank_or_all_and_names_what_is_missing(tmp_path):
    logs = RunLogs(tmp_path)
    logs.write([_line(1.0, 0, 1, "zero"), _line(2.0, 1, 1, "one")])
    logs.close()
    runner = CliRunner()
    got = runner.invoke(main, ["logs", str(tmp_path)])
    assert got.exit_code == 0 and got.output.splitlines() == [
        "[rank 0 gen 1] zero",
        "[rank 1 gen 1] one",
    ]
    got = runner.invoke(main, ["logs", str(tmp_path), "--rank", "1"])
    assert got.exit_code == 0 and got.output.splitlines() == ["[rank 1 gen 1] one"]
    got = runner.invoke(main, ["logs", str(tmp_path), "--rank", "7"])
    assert got.exit_code == 2 and "rank 7 printed nothing" in got.output
    assert "Traceback" not in got.output
    got = runner.invoke(main, ["logs", str(tmp_path / "nope")])
    assert got.exit_code == 2 and "no such run directory" in got.output


def test_a_batch_waits_while_the_last_is_in_flight_and_nothing_is_lost(capture):
    cap, sent, _ = capture()
    cap.arrived["now"] = False  # the agent does not take batch 1 yet
    print("one")
    cap.flush()
    print("two")
    cap.flush()
    assert _lines(sent) == [(3, 1, "out", "one")]  # no second call piled up
    cap.arrived["now"] = True
    print("three")
    cap.flush()
    assert [x[3] for x in _lines(sent)] == ["one", "two", "three"]


def test_lines_wait_until_there_is_an_agent_to_send_them_to():
    sent: list = []
    agent: dict = {"ref": None}

    def send(lines):
        if agent["ref"] is None:
            return None  # not placed yet: no agent
        sent.append(lines)
        return agent["ref"]

    cap = OutputCapture(lambda: (None, 0), send, interval_s=3600, arrived=lambda r, w: True)
    cap.add("out", "importing the loop")
    cap.flush()
    assert sent == []
    agent["ref"] = 1
    cap.add("out", "training")
    cap.flush()
    assert [x["line"] for batch in sent for x in batch] == ["importing the loop", "training"]


def test_the_tee_passes_other_attributes_to_the_original_stream():
    import io

    from stalwart.orchestrator.worker.output import _Tee

    cap = OutputCapture(lambda: (0, 1), lambda lines: None, interval_s=3600)
    original = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    tee = _Tee(original, "out", cap)
    tee.reconfigure(line_buffering=True)  # what scripts do: the original's method
    assert original.line_buffering and tee.buffer is original.buffer
    tee.write("kept\n")
    assert cap.tail(0) == ["kept"]

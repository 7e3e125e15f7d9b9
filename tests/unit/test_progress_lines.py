"""orchestrator/observe/progress.py: event lines and the summary for the health events."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from stalwart.orchestrator.observe.progress import ProgressView, _event_line, print_summary

NODE = "a" * 56


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"type": "node_lost", "node": NODE, "ranks": [1], "reason": "agent silent"}, "node lost"),
        ({"type": "hang", "culprits": [2], "waiting": [0], "reason": "rank 2 froze"}, "hang"),
        ({"type": "gpu_fatal", "node": NODE, "gpu": 0, "reason": "Xid 79"}, "Xid 79"),
        (
            {"type": "straggler", "rank": 3, "reason": "3.0x", "decision": "alert only"},
            "straggler rank 3: 3.0x; alert only",
        ),
        ({"type": "stacks", "stacks": {"0": {}, "1": {}}, "reason": "x"}, "stacks of 2 ranks"),
        ({"type": "cordoned", "node": NODE, "reason": "Xid 79"}, "cordoned node aaaaaaaaaaaa"),
        ({"type": "resized", "old": 4, "new": 3, "reason": "no room"}, "world 4 -> 3 ranks"),
        ({"type": "preflight", "failed": {NODE: "slow"}, "reason": "node slow"}, "preflight"),
    ],
)
def test_health_events_get_a_line(event, expected):
    line = _event_line({"ts": 0.0, **event})
    assert line is not None and expected in line.plain


def test_passed_preflight_and_throughput_are_quiet():
    assert _event_line({"ts": 0.0, "type": "preflight", "failed": {}, "reason": "ok"}) is None
    assert _event_line({"ts": 0.0, "type": "throughput", "steps_per_s": 3.0}) is None


def test_live_line_shows_cordons_and_slowest_ranks():
    console = Console(file=io.StringIO(), width=200)
    view = ProgressView(console, "job")
    view._last = {
        "state": "RUNNING",
        "total_steps": 10,
        "step": 5,
        "failures": 0,
        "committed_step": 4,
        "cordoned": 1,
        "slowest": [(2, 2.5), (0, 1.0)],
    }
    text = view._render().plain
    assert "cordoned 1" in text and "slowest r2 2.5x" in text and "r0" not in text


def test_summary_lists_cordons_stragglers_and_resizes():
    out = io.StringIO()
    result = {
        "name": "job",
        "status": "succeeded",
        "steps_completed": 10,
        "total_steps": 10,
        "wall_seconds": 1.0,
        "failures": [],
        "lost_steps_total": 0,
        "cordoned": [{"node": NODE, "reason": "Xid 79"}],
        "stragglers": [{"rank": 1, "score": 3.0, "action": "replace"}],
        "resizes": [{"from": 4, "to": 3}, {"from": 3, "to": 4}],
        "output": "runs/x",
    }
    print_summary(Console(file=out, width=300), result)
    text = out.getvalue()
    assert "aaaaaaaaaaaa" in text and "rank 1 (3.0x, replace)" in text and "4->3, 3->4" in text


def test_status_line_shows_rate_goodput_and_failures():
    from stalwart.orchestrator.observe.progress import status_line

    p = {
        "state": "RUNNING",
        "total_steps": 100,
        "step": 50,
        "failures": 2,
        "committed_step": 49,
        "goodput": 0.934,
        "steps_per_s": 12.5,
        "loss": 2.5,
        "slowest": [(3, 2.1)],
    }
    text = status_line("job", p, None, 200).plain
    assert "50/100" in text and "12.50 steps/s" in text and "goodput 93%" in text
    assert "failures 2" in text and "ckpt 49" in text and "slowest r3 2.1x" in text
    # A rate measured by the caller wins over the supervisor's last interval.
    assert "3.00 steps/s" in status_line("job", p, 3.0, 200).plain
    # Before the first throughput interval: no rate, no goodput.
    bare = status_line("job", {**p, "goodput": None, "steps_per_s": None}, None, 200).plain
    assert "- steps/s" in bare and "goodput" not in bare


def test_summary_states_goodput():
    out = io.StringIO()
    result = {
        "name": "job",
        "status": "succeeded",
        "steps_completed": 10,
        "total_steps": 10,
        "wall_seconds": 10.0,
        "goodput": 0.9512,
        "failures": [],
        "lost_steps_total": 0,
        "output": "runs/x",
    }
    print_summary(Console(file=out, width=300), result)
    text = " ".join(out.getvalue().split())
    assert "95.1% of the time since training began was productive" in text
    assert "over the whole job, start-up included" in text

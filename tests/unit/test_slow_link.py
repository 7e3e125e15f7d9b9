"""health/slow_link.py and supervisor/links.py: a slow link names its node from the round
trips of its report requests; a busy machine's hiccups and the supervisor's own slow link
name none."""

from __future__ import annotations

import random

import pytest

from stalwart.health.slow_link import LinkConfig, link_scores, window_rtt
from stalwart.orchestrator.supervisor.links import JUDGE_EVERY_S, LinkWatch

pytestmark = pytest.mark.timeout(30)

CFG = LinkConfig(threshold=3.0, window=15, consecutive_windows=2, min_excess_s=0.02)


def _healthy(rng: random.Random, n: int) -> list[float]:
    """A loopback round trip of a few ms, as a busy two-core machine gives them."""
    return [0.002 + rng.expovariate(1 / 0.002) for _ in range(n)]


def _nodes(rng: random.Random, **slow: list[float]) -> dict[str, list[float]]:
    out = {n: _healthy(rng, CFG.span) for n in ("node-a", "node-b", "node-c")}
    out.update(slow)
    return out


def test_a_delayed_node_is_named_and_the_others_are_not():
    rng = random.Random(1)
    delayed = [0.2 + s for s in _healthy(rng, CFG.span)]  # 200 ms on every packet it sends
    report, reason = link_scores(_nodes(rng, **{"node-b": delayed}), CFG)
    assert report.flagged == ("node-b",), reason
    assert report.scores["node-b"] > 20 and report.rtt_s["node-b"] >= 0.2
    assert "node node-b's round trips take 2" in reason and "consecutive windows" in reason


def test_a_lossy_node_is_named_by_its_retransmissions():
    """5 % of packets lost: a round trip in five crosses the lossy link with a packet lost,
    and waits out TCP's 200 ms retransmission timeout."""
    rng = random.Random(2)
    lossy = _healthy(rng, CFG.span)
    for i in (2, 6, 9, 17, 21, 25):  # three a window: the longest of each is left out
        lossy[i] += 0.2
    report, reason = link_scores(_nodes(rng, **{"node-c": lossy}), CFG)
    assert report.flagged == ("node-c",), reason


def test_one_hiccup_a_window_on_a_busy_node_is_not_a_slow_link():
    rng = random.Random(3)
    busy = _healthy(rng, CFG.span)
    busy[4] += 0.5  # a scheduling stall in the first window...
    busy[20] += 0.3  # ...and one in the second: each is its window's longest
    report, reason = link_scores(_nodes(rng, **{"node-a": busy}), CFG)
    assert report.flagged == (), reason
    assert reason.startswith("no slow link")


def test_one_slow_window_is_not_enough():
    rng = random.Random(4)
    late = _healthy(rng, CFG.window) + [0.2 + s for s in _healthy(rng, CFG.window)]
    report, _ = link_scores(_nodes(rng, **{"node-a": late}), CFG)
    assert report.flagged == ()
    assert report.scores["node-a"] > 3  # the latest window is slow: its score says so


def test_every_node_slow_at_once_is_the_supervisors_link_and_names_none():
    rng = random.Random(5)
    slow = {n: [0.2 + s for s in _healthy(rng, CFG.span)] for n in ("a", "b", "c", "d")}
    report, _ = link_scores(slow, CFG)
    assert report.flagged == ()


def test_two_nodes_suffice_and_a_node_without_enough_round_trips_is_not_judged():
    rng = random.Random(6)
    two = {"a": _healthy(rng, CFG.span), "b": [0.3] * CFG.span, "new": [0.3] * 3}
    report, _ = link_scores(two, CFG)
    assert report.flagged == ("b",) and "new" not in report.scores
    report, reason = link_scores({"a": [0.3] * CFG.span}, CFG)
    assert report.flagged == () and "nothing to compare" in reason
    assert report.rtt_s == {"a": 0.3}  # one node's round trip is still a gauge


def test_a_small_absolute_excess_is_noise_not_a_slow_link():
    """1 ms against 0.2 ms is five times, and nothing a job would notice."""
    nodes = {"a": [0.0002] * CFG.span, "b": [0.0002] * CFG.span, "c": [0.001] * CFG.span}
    report, _ = link_scores(nodes, CFG)
    assert report.flagged == () and report.scores["c"] == 5.0


def test_window_rtt_leaves_out_the_longest():
    assert window_rtt([0.01, 0.01, 1.0]) == pytest.approx(0.01)
    assert window_rtt([0.5]) == 0.5 and window_rtt([]) == 0.0


def test_the_watch_flags_once_clears_after_a_calm_span_and_forgets_a_lost_node():
    watch = LinkWatch(CFG)
    t = 1000.0

    def feed(n: int, slow_b: bool) -> None:
        for _ in range(n):
            watch.round_trip("a", 0.002)
            watch.round_trip("b", 0.25 if slow_b else 0.002)
            watch.round_trip("c", 0.003)

    feed(CFG.span, slow_b=True)
    new, cleared, reason = watch.judge(t)
    assert (new, cleared) == (["b"], []), reason
    assert watch.judge(t + JUDGE_EVERY_S / 2) is None  # between verdicts
    feed(CFG.window, slow_b=True)
    assert watch.judge(t + 1 * JUDGE_EVERY_S)[:2] == ([], [])  # still slow: no news
    feed(CFG.span - 1, slow_b=False)
    assert watch.judge(t + 2 * JUDGE_EVERY_S)[:2] == ([], [])  # healthy, calm span not yet
    assert "b" in watch.flagged
    feed(1, slow_b=False)
    assert watch.judge(t + 3 * JUDGE_EVERY_S)[:2] == ([], ["b"])
    feed(CFG.span, slow_b=True)
    assert watch.judge(t + 4 * JUDGE_EVERY_S)[0] == ["b"]  # slow again: news again
    watch.forget("b")
    for _ in range(CFG.span):  # answers of its arriving after it was declared lost
        watch.round_trip("b", 0.9)
    assert "b" not in watch.flagged and "b" not in watch.judge(t + 5 * JUDGE_EVERY_S)[0]
    assert "b" not in watch.report.rtt_s  # and no gauge for it either


def test_a_watch_switched_off_keeps_nothing():
    watch = LinkWatch(CFG, enabled=False)
    for _ in range(CFG.span):
        watch.round_trip("a", 0.002)
        watch.round_trip("b", 1.0)
    assert watch.judge(0.0) is None and watch.flagged == {}

"""orchestrator/events.py: the append-only event log."""

from __future__ import annotations

import threading

from stalwart.orchestrator.events import EventLog


def test_emit_returns_event_with_ts_type_seq_and_fields(clock):
    log = EventLog(clock)
    clock.now = 12.0
    ev = log.emit("job_started", workers=4, name="q")
    assert ev == {"ts": 12.0, "type": "job_started", "workers": 4, "name": "q", "seq": 0}


def test_seq_numbers_count_up(clock):
    log = EventLog(clock)
    evs = [log.emit("tick", i=i) for i in range(5)]
    assert [e["seq"] for e in evs] == [0, 1, 2, 3, 4]
    assert len(log) == 5


def test_ts_follows_fake_clock_and_is_rounded(clock):
    log = EventLog(clock)
    clock.now = 100.0
    a = log.emit("a")
    clock.advance(0.25)
    b = log.emit("b")
    clock.now = 1.123456789
    c = log.emit("c")
    assert (a["ts"], b["ts"], c["ts"]) == (100.0, 100.25, 1.123457)


def test_since(clock):
    log = EventLog(clock)
    for t in ("a", "b", "c", "d"):
        log.emit(t)
    assert [e["type"] for e in log.since(0)] == ["a", "b", "c", "d"]
    assert [e["type"] for e in log.since(2)] == ["c", "d"]
    assert [e["seq"] for e in log.since(3)] == [3]
    assert log.since(4) == []
    assert log.since(99) == []


def test_since_offset_is_the_seq_of_the_next_event(clock):
    log = EventLog(clock)
    log.emit("a")
    log.emit("b")
    offset = len(log)
    log.emit("c")
    new = log.since(offset)
    assert [e["type"] for e in new] == ["c"]
    assert new[0]["seq"] == offset


def test_since_returns_a_copy(clock):
    log = EventLog(clock)
    log.emit("a")
    got = log.since(0)
    got.append({"type": "forged"})
    got.clear()
    assert len(log) == 1
    assert log.since(0)[0]["type"] == "a"


def test_of_type(clock):
    log = EventLog(clock)
    log.emit("state", to="RUNNING")
    log.emit("failure", rank=1)
    log.emit("state", to="RECOVERING")
    states = log.of_type("state")
    assert [e["to"] for e in states] == ["RUNNING", "RECOVERING"]
    assert [e["seq"] for e in states] == [0, 2]
    assert log.of_type("failure")[0]["rank"] == 1
    assert log.of_type("nothing") == []


def test_empty_log(clock):
    log = EventLog(clock)
    assert len(log) == 0
    assert log.since(0) == []
    assert log.of_type("x") == []


def test_concurrent_emits_get_unique_dense_seq(clock):
    log = EventLog(clock)
    n_threads, per_thread = 8, 200
    start = threading.Barrier(n_threads)

    def work(k):
        start.wait(timeout=10)
        for i in range(per_thread):
            log.emit("e", thread=k, i=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    events = log.since(0)
    assert len(events) == n_threads * per_thread
    assert [e["seq"] for e in events] == list(range(n_threads * per_thread))


def test_a_long_run_keeps_a_bounded_window_and_says_what_a_reader_missed(clock):
    log = EventLog(clock, keep=100)
    for i in range(1000):
        log.emit("throughput", i=i)
    assert len(log) == 1000  # numbered on, whatever is kept
    kept = log.since(0)
    assert 100 <= len(kept) <= 125
    assert kept[-1]["seq"] == 999 and [e["seq"] for e in kept] == list(range(kept[0]["seq"], 1000))
    assert log.missed(0) == kept[0]["seq"]
    assert log.missed(990) == 0 and [e["i"] for e in log.since(990)] == list(range(990, 1000))

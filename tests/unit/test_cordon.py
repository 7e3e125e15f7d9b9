"""health/cordon.py: cordoned nodes with a TTL (or until uncordoned) and the flapping rule."""

from __future__ import annotations

import pytest

from stalwart.health.cordon import Cordon, CordonList, flapping_nodes

# --- CordonList -------------------------------------------------------------------------------


def test_new_list_is_empty(clock):
    cl = CordonList(ttl_s=60.0)
    assert cl.active(clock()) == {}
    assert not cl.is_cordoned("node-a", clock())
    assert cl.expire(clock()) == []


def test_cordon_returns_the_cordon_with_its_deadline(clock):
    cl = CordonList(ttl_s=60.0)
    c = cl.cordon("node-a", "Xid 79", clock())
    assert c == Cordon("node-a", "Xid 79", clock.now, clock.now + 60.0)
    assert cl.is_cordoned("node-a", clock())
    assert not cl.is_cordoned("node-b", clock())
    assert cl.active(clock()) == {"node-a": c}


def test_ttl_cordon_lapses_at_the_deadline(clock):
    cl = CordonList(ttl_s=60.0)
    cl.cordon("node-a", "slow", clock())
    clock.advance(59.5)
    assert cl.is_cordoned("node-a", clock())
    assert cl.expire(clock()) == []
    clock.advance(0.5)
    assert not cl.is_cordoned("node-a", clock())  # inactive even before expire() runs
    assert cl.active(clock()) == {}


def test_expire_drops_and_returns_lapsed_cordons_once(clock):
    cl = CordonList(ttl_s=10.0)
    a = cl.cordon("node-a", "r1", clock())
    clock.advance(5.0)
    b = cl.cordon("node-b", "r2", clock())
    clock.advance(5.0)  # node-a's deadline exactly
    assert cl.expire(clock()) == [a]
    assert cl.expire(clock()) == []
    assert cl.active(clock()) == {"node-b": b}
    clock.advance(100.0)
    assert cl.expire(clock()) == [b]
    assert cl.active(clock()) == {}


def test_cordon_without_ttl_lasts_until_uncordoned(clock):
    cl = CordonList(ttl_s=None)
    c = cl.cordon("node-a", "lost", clock())
    assert c.until is None
    clock.advance(10**9)
    assert cl.expire(clock()) == []
    assert cl.is_cordoned("node-a", clock())
    assert cl.uncordon("node-a") == c
    assert not cl.is_cordoned("node-a", clock())


def test_uncordon_unknown_node_is_none(clock):
    cl = CordonList(ttl_s=60.0)
    assert cl.uncordon("node-x") is None
    cl.cordon("node-a", "r", clock())
    assert cl.uncordon("node-x") is None
    assert cl.is_cordoned("node-a", clock())


def test_uncordon_before_the_ttl(clock):
    cl = CordonList(ttl_s=60.0)
    c = cl.cordon("node-a", "r", clock())
    assert cl.uncordon("node-a") == c
    assert cl.uncordon("node-a") is None
    assert not cl.is_cordoned("node-a", clock())
    clock.advance(120.0)
    assert cl.expire(clock()) == []  # nothing left to expire


def test_cordoning_again_refreshes_reason_and_deadline(clock):
    cl = CordonList(ttl_s=60.0)
    cl.cordon("node-a", "first", clock())
    clock.advance(50.0)
    second = cl.cordon("node-a", "second", clock())
    clock.advance(20.0)  # past the first deadline, before the second
    assert cl.is_cordoned("node-a", clock())
    assert cl.active(clock()) == {"node-a": second}
    assert cl.active(clock())["node-a"].reason == "second"


def test_ttl_applies_per_node(clock):
    cl = CordonList(ttl_s=30.0)
    cl.cordon("node-a", "r", clock())
    clock.advance(20.0)
    cl.cordon("node-b", "r", clock())
    clock.advance(15.0)
    assert sorted(cl.active(clock())) == ["node-b"]


def test_cordon_is_frozen(clock):
    c = CordonList(ttl_s=1.0).cordon("node-a", "r", clock())
    with pytest.raises(AttributeError):
        c.until = None


# --- flapping_nodes ---------------------------------------------------------------------------

NOW = 10_000.0


def test_no_history_no_flapping():
    assert flapping_nodes([], NOW, 600.0, 3) == ([], "no flapping node")


def test_node_at_the_threshold_flaps():
    history = [("node-a", NOW - 500), ("node-a", NOW - 100), ("node-a", NOW)]
    nodes, reason = flapping_nodes(history, NOW, 600.0, 3)
    assert nodes == ["node-a"]
    assert reason == "node node-a failed 3 times in 600 s (threshold 3)"


def test_below_the_threshold_does_not_flap():
    history = [("node-a", NOW - 10), ("node-a", NOW)]
    assert flapping_nodes(history, NOW, 600.0, 3)[0] == []


def test_failures_outside_the_window_do_not_count():
    history = [("node-a", NOW - 600.5), ("node-a", NOW - 300), ("node-a", NOW)]
    assert flapping_nodes(history, NOW, 600.0, 3)[0] == []


def test_window_edge_is_inclusive():
    history = [("node-a", NOW - 600.0), ("node-a", NOW - 300), ("node-a", NOW)]
    assert flapping_nodes(history, NOW, 600.0, 3)[0] == ["node-a"]


def test_counts_are_per_node():
    history = [
        ("node-a", NOW - 1),
        ("node-b", NOW - 2),
        ("node-a", NOW - 3),
        ("node-c", NOW - 4),
        ("node-b", NOW - 5),
    ]
    nodes, reason = flapping_nodes(history, NOW, 600.0, 2)
    assert nodes == ["node-a", "node-b"]
    assert reason.split("; ") == [
        "node node-a failed 2 times in 600 s (threshold 2)",
        "node node-b failed 2 times in 600 s (threshold 2)",
    ]


def test_threshold_one_flaps_on_any_recent_failure():
    assert flapping_nodes([("node-a", NOW - 5)], NOW, 60.0, 1)[0] == ["node-a"]
    assert flapping_nodes([("node-a", NOW - 61)], NOW, 60.0, 1)[0] == []


def test_flapping_accepts_any_iterable_and_shortens_ids():
    long_id = "e" * 40
    gen = ((long_id, NOW - i) for i in range(4))
    nodes, reason = flapping_nodes(gen, NOW, 600.0, 4)
    assert nodes == [long_id]
    assert reason.startswith(f"node {'e' * 12} failed 4 times")


def test_flapping_with_the_clock(clock):
    history = []
    for _ in range(3):
        history.append(("node-a", clock()))
        clock.advance(250.0)
    # Failures at t, t+250, t+500; now is t+750: the first fell out of a 600 s window.
    assert flapping_nodes(history, clock(), 600.0, 3)[0] == []
    assert flapping_nodes(history, clock(), 750.0, 3)[0] == ["node-a"]

"""ckpt/replicas.choose_stride: how far apart the copies to peers are."""

from __future__ import annotations

import pytest

from stalwart.ckpt.replicas import choose_stride


def test_slow_steps_send_every_snapshot():
    stride, why = choose_stride(steps_per_s=2.0, every=1, current=1, max_per_s=4, duty=0.1)
    assert stride == 1
    assert why == "at most 4 rounds/s at 2.00 steps/s"


def test_fast_steps_are_thinned_to_the_rate_cap():
    assert choose_stride(30.0, every=1, current=1, max_per_s=4, duty=0.1)[0] == 8
    # A multiple of the snapshot interval, so copies land on snapshots every rank has.
    assert choose_stride(30.0, every=5, current=5, max_per_s=4, duty=0.1)[0] == 10


def test_an_expensive_round_is_thinned_to_the_duty():
    # 250 MB shards: a round takes 0.9 s; at 0.5 steps/s with duty 0.1 that is every 5th step.
    stride, why = choose_stride(0.5, every=1, current=1, max_per_s=4, duty=0.1, round_s=0.9)
    assert stride == 5
    assert why == (
        "a round of copies takes 0.900 s; at 0.50 steps/s every 5 steps keeps the sender "
        "busy <= 10% of the time"
    )
    # The sender's busy share at that stride is within the duty.
    assert 0.9 * 0.5 / stride <= 0.1


def test_a_cheap_round_changes_nothing():
    stride, _ = choose_stride(2.0, every=1, current=1, max_per_s=4, duty=0.1, round_s=0.01)
    assert stride == 1


@pytest.mark.parametrize(
    ("current", "wanted", "expected"),
    [
        (4, 5, 4),  # within a factor of 2: unchanged (measuring under 4 gives about 4-5)
        (4, 7, 4),
        (4, 8, 8),  # doubled: follow
        (4, 2, 2),  # halved: follow
        (4, 3, 4),
        (1, 2, 2),
    ],
)
def test_the_stride_moves_only_by_a_factor_of_two(current, wanted, expected):
    # round_s chosen so the cost alone asks for `wanted` steps at 1 step/s, duty 0.5.
    round_s = 0.5 * wanted - 0.25
    assert choose_stride(1.0, 1, current, max_per_s=100, duty=0.5, round_s=round_s)[0] == (expected)


def test_no_rate_measured_keeps_the_stride():
    # A window without a step says nothing about the rate: the stride stays (it flapped
    # between 20 and 1 when a 1 s window of 1 s steps saw none).
    stride, why = choose_stride(0.0, every=1, current=20, max_per_s=4, duty=0.1, round_s=3.0)
    assert (stride, why) == (20, "no step rate measured")


# --- a bounded lag (checkpoint.max_lag_steps) ----------------------------------------------------


def test_a_bounded_lag_sends_copies_as_far_apart_as_the_bound_allows():
    from stalwart.ckpt.replicas import bounded_stride

    assert bounded_stride(every=1, max_lag=2) == 2
    assert bounded_stride(every=1, max_lag=0) == 1  # every step, before the next one
    assert bounded_stride(every=2, max_lag=5) == 4  # on the snapshots' grid
    assert bounded_stride(every=5, max_lag=2) == 5  # snapshots rarer than the bound
    with pytest.raises(ValueError):
        bounded_stride(every=1, max_lag=-1)


@pytest.mark.parametrize("max_lag", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("every", [1, 2, 3])
def test_the_gate_keeps_the_commit_within_the_bound_at_every_snapshot(max_lag, every):
    """After snapshot s, training goes on only once the step lag_gate names has its copies:
    a step on the stride's grid within max_lag of s (or the restore point, committed), so a
    node lost during the next step redoes <= max_lag + 1. Each copy has the steps between
    its snapshot and the one that needs it to get there."""
    from stalwart.ckpt.replicas import bounded_stride, lag_gate

    stride = bounded_stride(every, max_lag)
    for start in (0, 6, 12):
        for s in range(start, start + 40, every):  # snapshots: every `every` steps
            need = lag_gate(s, max_lag, stride, start)
            if need is None:
                assert s - start <= max_lag, (s, start)
                continue
            assert need % stride == 0 and start < need <= s, (s, need)
            assert s - need <= max_lag, (s, need)
            if need < s:
                assert s - need >= max_lag - stride + 1  # its time to reach the peers


def test_the_gate_names_nothing_before_the_generations_start():
    from stalwart.ckpt.replicas import lag_gate

    assert lag_gate(12, 2, 2, start=10) is None  # the restore point (10) is committed
    assert lag_gate(13, 2, 2, start=10) == 12
    assert lag_gate(5, 0, 1, start=0) == 5  # synchronous: this very step

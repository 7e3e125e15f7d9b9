"""health/preflight.py: judging per-node matmul and all-reduce timings before training."""

from __future__ import annotations

import pytest

from stalwart.health.preflight import PreflightResult, judge_preflight

MAX = 3.0


def results(**matmul: float | None) -> dict[str, PreflightResult]:
    return {n: PreflightResult(n, s) for n, s in matmul.items()}


def test_no_results_pass():
    assert judge_preflight({}, MAX) == ({}, "0 node(s) passed preflight")


def test_healthy_nodes_pass():
    bad, reason = judge_preflight(results(a=0.10, b=0.11, c=0.095, d=0.12), MAX)
    assert bad == {}
    assert reason == "4 node(s) passed preflight"


def test_single_node_without_reference_passes():
    assert judge_preflight(results(a=5.0), MAX) == ({}, "1 node(s) passed preflight")


def test_error_is_cordoned():
    res = results(a=0.1, b=0.1)
    res["c"] = PreflightResult("c", None, error="CUDA error: no kernel image")
    bad, reason = judge_preflight(res, MAX)
    assert bad == {"c": "preflight failed: CUDA error: no kernel image"}
    assert reason == "node c: preflight failed: CUDA error: no kernel image"


def test_error_with_a_time_is_still_cordoned():
    res = {"a": PreflightResult("a", 0.1, error="allreduce failed"), **results(b=0.1)}
    bad, _ = judge_preflight(res, MAX)
    assert bad == {"a": "preflight failed: allreduce failed"}


def test_unfinished_matmul_is_cordoned():
    bad, _ = judge_preflight(results(a=0.1, b=None), MAX)
    assert bad == {"b": "preflight failed: did not finish"}


def test_failed_nodes_do_not_count_as_peers():
    # b failed; a alone has no peer to compare with, and a huge time does not matter.
    res = {"a": PreflightResult("a", 10.0), "b": PreflightResult("b", 0.001, error="boom")}
    bad, _ = judge_preflight(res, MAX)
    assert set(bad) == {"b"}


@pytest.mark.parametrize("n_nodes", [2, 3, 4, 8])
def test_five_times_slower_node_is_flagged(n_nodes):
    res = results(**{f"n{i}": 0.1 for i in range(n_nodes - 1)}, slow=0.5)
    bad, reason = judge_preflight(res, MAX)
    assert list(bad) == ["slow"]
    assert bad["slow"] == (
        "matmul took 500.0 ms, 5.0x its peers' 100.0 ms (health.preflight.max_slowdown=3.0)"
    )
    assert reason == f"node slow: {bad['slow']}"


def test_with_two_nodes_only_the_slow_one_is_flagged():
    # Leave-one-out: the fast node's reference is the slow one, which does not flag it.
    bad, _ = judge_preflight(results(fast=0.1, slow=0.5), MAX)
    assert list(bad) == ["slow"]


@pytest.mark.parametrize("factor", [1.0, 2.0, 2.9, 3.0])
def test_within_max_slowdown_is_not_flagged(factor):
    bad, _ = judge_preflight(results(a=0.25, b=0.25, c=0.25 * factor), MAX)
    assert bad == {}


def test_just_over_max_slowdown_is_flagged():
    bad, _ = judge_preflight(results(a=0.25, b=0.25, c=0.25 * 3.01), MAX)
    assert list(bad) == ["c"]


def test_max_slowdown_is_a_parameter():
    res = results(a=0.1, b=0.1, c=0.25)
    assert judge_preflight(res, 3.0)[0] == {}
    assert list(judge_preflight(res, 2.0)[0]) == ["c"]


def test_reference_for_a_single_replacement_node():
    bad, reason = judge_preflight(results(new=0.5), MAX, reference_s=0.1)
    assert list(bad) == ["new"]
    assert "5.0x its peers' 100.0 ms" in bad["new"]
    assert reason.startswith("node new: matmul took 500.0 ms")


def test_replacement_node_within_reference_passes():
    bad, reason = judge_preflight(results(new=0.12), MAX, reference_s=0.1)
    assert bad == {}
    assert reason == "1 node(s) passed preflight"


def test_reference_overrides_the_peer_median():
    # Both are equally slow against the job's healthy nodes, so both are flagged.
    bad, _ = judge_preflight(results(a=0.5, b=0.5), MAX, reference_s=0.1)
    assert sorted(bad) == ["a", "b"]


def test_zero_reference_flags_nothing():
    assert judge_preflight(results(a=0.0, b=0.5), MAX)[0] == {}
    assert judge_preflight(results(new=0.5), MAX, reference_s=0.0)[0] == {}


def test_slow_allreduce_is_flagged():
    res = {
        "a": PreflightResult("a", 0.1, allreduce_s=0.010),
        "b": PreflightResult("b", 0.1, allreduce_s=0.011),
        "c": PreflightResult("c", 0.1, allreduce_s=0.080),
    }
    bad, _ = judge_preflight(res, MAX)
    assert list(bad) == ["c"]
    assert bad["c"].startswith("allreduce took 80.0 ms, ")
    assert "health.preflight.max_slowdown=3.0" in bad["c"]


def test_allreduce_is_not_judged_against_the_matmul_reference():
    # reference_s is a matmul time; the all-reduce has no peer here, so it is not judged.
    res = {"new": PreflightResult("new", 0.1, allreduce_s=50.0)}
    assert judge_preflight(res, MAX, reference_s=0.1)[0] == {}


def test_nodes_without_allreduce_are_left_out_of_its_median():
    res = {
        "a": PreflightResult("a", 0.1, allreduce_s=0.01),
        "b": PreflightResult("b", 0.1),
        "c": PreflightResult("c", 0.1, allreduce_s=0.05),
    }
    bad, _ = judge_preflight(res, MAX)
    assert list(bad) == ["c"]


def test_slow_matmul_and_allreduce_reasons_are_joined():
    res = {
        "a": PreflightResult("a", 0.1, allreduce_s=0.01),
        "b": PreflightResult("b", 0.1, allreduce_s=0.01),
        "c": PreflightResult("c", 0.6, allreduce_s=0.05),
    }
    bad, _ = judge_preflight(res, MAX)
    assert list(bad) == ["c"]
    matmul_why, allreduce_why = bad["c"].split("; ")
    assert matmul_why.startswith("matmul took 600.0 ms, 6.0x")
    assert allreduce_why.startswith("allreduce took 50.0 ms, 5.0x")


def test_reason_lists_nodes_sorted_and_shortened():
    long_id = "d" * 40
    res = {
        "zz": PreflightResult("zz", None, error="x"),
        long_id: PreflightResult(long_id, None),
        "aa": PreflightResult("aa", 0.1),
    }
    bad, reason = judge_preflight(res, MAX)
    assert set(bad) == {"zz", long_id}
    assert reason == (
        f"node {'d' * 12}: preflight failed: did not finish; node zz: preflight failed: x"
    )

"""worker/shard_fetch.py: a replacement's shard fetched from the moment its generation starts,
handed to the restore once; a failure is raised at the restore, as a fetch's always was."""

from __future__ import annotations

import threading

import pytest

from stalwart.orchestrator.worker.shard_fetch import Prefetch

pytestmark = pytest.mark.timeout(30)


def test_the_fetch_starts_before_the_restore_asks_and_is_handed_over_once():
    started, release, calls = threading.Event(), threading.Event(), []

    def fetch(step: int) -> str:
        calls.append(step)
        started.set()
        assert release.wait(10)
        return f"shard of {step}"

    pre = Prefetch(fetch, 40)
    assert started.wait(10), "the fetch did not start until asked"
    release.set()
    assert pre.get(40) == "shard of 40"
    assert pre.arrived_at is not None and pre.arrived_at >= pre.started_at
    # A second ask (the buffer is the first restore's) and another step fetch anew.
    assert pre.get(40) == "shard of 40" and pre.get(41) == "shard of 41"
    assert calls == [40, 40, 41]


def test_a_fetch_that_failed_is_raised_at_the_restore():
    def fetch(step: int) -> str:
        raise ConnectionError(f"peer gone while sending step {step}")

    pre = Prefetch(fetch, 7)
    with pytest.raises(ConnectionError, match="step 7"):
        pre.get(7)


def test_a_source_without_the_shard_is_none_at_the_restore():
    assert Prefetch(lambda step: None, 3).get(3) is None

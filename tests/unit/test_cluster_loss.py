"""orchestrator/chaos/cluster_loss.py: the check that a job whose cluster was lost resumed
from the newest step on storage."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(30)


def test_the_resume_check_reads_the_newest_step_on_storage():
    from stalwart.orchestrator.chaos.cluster_loss import resumed_check

    lost = [{"type": "throughput", "step": 193}, {"type": "persisted", "step": 160}]
    resumed = [{"type": "resume", "step": 180}]
    ok = resumed_check(180, lost, resumed)  # the log ended before the write of 180 did
    assert ok.ok and ok.detail.startswith("step 180 (the newest") and "13 steps redone" in ok.detail
    assert not resumed_check(200, lost, resumed).ok
    # `--resume auto` that found nothing says so with a step of None: started over.
    over = [{"type": "resume", "step": None}]
    assert resumed_check(None, lost, over).ok
    bad = resumed_check(180, lost, over)
    assert not bad.ok and bad.detail == "storage held step 180, but the job started over"

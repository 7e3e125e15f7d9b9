"""`stalwart status`: a running job's live line and progress snapshot by name, an ended
job's summary from its run directory, and clear errors otherwise."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.component.conftest import small_spec, stalwart_cli

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]


def _wait_for_running(events_file, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if events_file.exists():
            for line in events_file.read_text().splitlines():
                e = json.loads(line)
                if e["type"] == "throughput" and e["step"] >= 5:
                    return
        time.sleep(0.2)
    raise AssertionError(f"the job did not reach step 5 within {timeout_s} s")


def test_status_of_a_running_job_then_of_its_run_directory(run, ray_address, tmp_path):
    spec = small_spec(
        name="ct-status",
        workers=2,  # what is shown does not depend on the world's size
        steps=100_000,  # cancelled once checked
        chaos__faults=[{"kind": "kill_worker", "rank": 1, "at_step": 3}],
    )
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=run(spec)), daemon=True)
    job.start()
    _wait_for_running(tmp_path / "run0" / "events.jsonl", timeout_s=120)

    out = stalwart_cli("status", "ct-status", "-o", "json", address=ray_address)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["state"] in ("RUNNING", "RECOVERING") and p["total_steps"] == 100_000
    assert p["failures"] == 1 and p["step"] > 0
    assert {"goodput", "steps_per_s", "slowest", "committed_step"} <= p.keys()

    # No --address, no RAY_ADDRESS: the cluster `run` on this machine drives the job on
    # (its registry), never another Ray that happens to run here.
    text = stalwart_cli("status", "ct-status")
    assert text.returncode == 0, text.stderr
    assert "ct-status" in text.stdout and "/100000" in text.stdout
    assert "steps/s" in text.stdout and "failures 1" in text.stdout

    import ray

    ray.get_actor("stalwart-ct-status", namespace="stalwart").cancel.remote()
    job.join(timeout=120)
    assert box["result"]["status"] == "cancelled", box["result"]["error"]
    assert 0 < box["result"]["goodput"] <= 1

    ended = stalwart_cli("status", "ct-status", address=ray_address)
    assert ended.returncode == 2
    assert "no running stalwart job named 'ct-status'" in ended.stderr

    unknown = stalwart_cli("status", "ct-status")  # its driver has ended: not registered
    assert unknown.returncode == 2 and "is driven by `stalwart run` on this" in unknown.stderr

    summary = stalwart_cli("status", str(tmp_path / "run0"))
    assert summary.returncode == 130, summary.stderr  # the run was cancelled
    assert "ct-status cancelled" in summary.stdout and "goodput" in summary.stdout

    empty = tmp_path / "not-a-run"
    empty.mkdir()
    missing = stalwart_cli("status", str(empty))
    assert missing.returncode == 2 and "the run has not ended" in missing.stderr

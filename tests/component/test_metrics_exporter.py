"""The supervisor's Prometheus exporter on a real job with a real failure: scraped over
HTTP while the job runs, on loopback only."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.component.conftest import events_of, small_spec
from tests.component.prometheus import free_port

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

SAMPLE = re.compile(r"^([a-z_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$")


def _parse(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def _get(parsed: dict, metric: str, **labels: str) -> float | None:
    for (n, lab), v in parsed.items():
        if n == metric and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            return v
    return None


def test_exporter_serves_the_jobs_metrics_while_it_runs_and_recovers(run):
    port = free_port()
    spec = small_spec(
        name="metrics-ct",
        steps=150,  # ~15 s: scrapes before, during and well after the recovery
        metrics={"port": port},
        chaos__faults=[{"kind": "kill_worker", "rank": 1, "at_step": 20}],
    )
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=run(spec)), daemon=True)
    job.start()
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes = []
    deadline = time.monotonic() + 240
    while job.is_alive() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                scrapes.append(_parse(r.read().decode()))
        except (urllib.error.URLError, ConnectionError):
            pass  # not started yet, or already gone with the supervisor
        job.join(timeout=0.5)  # one scrape every half second while the job runs
    job.join(timeout=10)
    result = box["result"]
    assert result["status"] == "succeeded", result["error"]
    assert result["metrics_url"] == url
    [exporter] = events_of(result, "metrics_exporter")
    assert exporter["port"] == port and exporter["host"] == "127.0.0.1"
    assert len(scrapes) >= 5, "the exporter answered fewer than 5 scrapes"
    last = scrapes[-1]
    job_label = {"train_job": "metrics-ct"}
    # The failure and its recovery, as counted from the job's events.
    assert _get(last, "stalwart_failures_total", kind="worker_died", **job_label) == 1
    assert _get(last, "stalwart_recoveries_total", outcome="recovered", **job_label) == 1
    assert _get(last, "stalwart_recovery_duration_seconds_count", **job_label) == 1
    for phase in ("detect", "replace", "rendezvous", "restore"):
        assert _get(last, "stalwart_recovery_phase_duration_seconds_count", phase=phase) == 1
    # Progress: the step grows across scrapes except once, back to the restore point after
    # the kill at step 20 (never to 0); training was seen running.
    steps = [_get(s, "stalwart_step") for s in scrapes if _get(s, "stalwart_step") is not None]
    drops = [(a, b) for a, b in itertools.pairwise(steps) if b < a]
    assert len(drops) <= 1 and all(b > 0 and a <= 21 for a, b in drops), steps
    assert steps[-1] >= 60, steps
    assert any(_get(s, "stalwart_job_state", state="RUNNING") == 1 for s in scrapes)
    assert _get(last, "stalwart_total_steps") == 150
    assert _get(last, "stalwart_samples_total") > 0
    assert _get(last, "stalwart_train_metric", name="loss") is not None
    assert _get(last, "stalwart_step_duration_seconds_count") > 0
    for rank in range(4):
        assert _get(last, "stalwart_heartbeat_age_seconds", rank=str(rank)) is not None
    wall = _get(last, "stalwart_wall_seconds_total")
    productive = _get(last, "stalwart_productive_seconds_total")
    assert wall > 0 and 0 < productive < wall
    # Never a per-step series.
    assert not any('step="' in lab for s in scrapes for (_, lab) in s)


def test_exporter_is_not_reachable_from_outside_loopback_by_default(run):
    port = free_port()
    # Two ranks: where the exporter listens does not depend on the world's size.
    spec = small_spec(name="metrics-lo", workers=2, steps=60, metrics={"port": port})
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=run(spec)), daemon=True)
    job.start()
    outside = _outside_address()
    reached_loopback = refused_outside = False
    deadline = time.monotonic() + 120
    while job.is_alive() and time.monotonic() < deadline and not refused_outside:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).close()
            reached_loopback = True
        except (urllib.error.URLError, ConnectionError):
            job.join(timeout=0.2)
            continue
        with socket.socket() as s:
            s.settimeout(5)
            refused_outside = s.connect_ex((outside, port)) != 0
        break
    job.join(timeout=120)
    assert box["result"]["status"] == "succeeded"
    assert reached_loopback and refused_outside


def _outside_address() -> str:
    """This machine's address on its default route (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the interface
        addr = s.getsockname()[0]
    assert not addr.startswith("127."), addr
    return addr

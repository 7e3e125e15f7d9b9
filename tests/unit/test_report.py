"""orchestrator/observe/ (rundir.py, analysis.py, rank_times.py, figures.py, figures_costs.py,
report.py) and `stalwart report`: the numbers behind the figures on small synthetic event lists,
the files written for a real run's events (tests/unit/data/report_run, a trimmed run with two
killed workers, a slowed rank and durable checkpoints), a synthetic 2,000-rank run, and the
errors for unreadable run directories."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from stalwart.orchestrator.cli import main
from stalwart.orchestrator.observe.analysis import goodput, median_step_time, redone_steps, timeline
from stalwart.orchestrator.observe.figures import FIGURES
from stalwart.orchestrator.observe.rank_times import heatmap, median_of_others
from stalwart.orchestrator.observe.report import build_report
from stalwart.orchestrator.observe.rundir import ReportError, load_run

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parent / "data" / "report_run"
PNGS = [f for f, _ in FIGURES]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def ev(ts: float, type_: str, **fields) -> dict:
    return {"ts": ts, "type": type_, **fields}


def state(ts: float, old: str, new: str) -> dict:
    return ev(ts, "state", old=old, new=new, reason="test")


def write_run(path: Path, events: list[dict], result: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if result is not None:
        (path / "result.json").write_text(json.dumps(result))
    return path


# --- goodput ----------------------------------------------------------------------------------

# Start at 100: 10 s of start-up, RUNNING at 110, a recovery at 130 (4 s in RECOVERING, 5.5 s
# from the failure to the first step after the restore), SUCCEEDED at 160.
SYNTHETIC = [
    state(100.0, "PENDING", "SCHEDULING"),
    state(110.0, "SCHEDULING", "RUNNING"),
    ev(111.0, "throughput", step=2, steps_per_s=2.0),
    ev(112.0, "throughput", step=4, steps_per_s=2.0),
    ev(129.0, "throughput", step=40, steps_per_s=4.0),
    ev(130.0, "fault_injected", kind="kill_worker", rank=1, at_step=41, step=41, at=129.9),
    ev(
        130.1,
        "decision",
        action="replace",
        ranks=[1],
        failures=[{"kind": "worker_died", "rank": 1, "step": 42}],
    ),
    state(130.1, "RUNNING", "RECOVERING"),
    state(134.1, "RECOVERING", "RUNNING"),
    ev(
        135.0,
        "recovered",
        generation=2,
        restore_step=35,
        recovered_after_s=[5.5],
        detected_after_s=[0.2],
        decided_after_s=[0.0],
        phases_s={"abort": 1.0, "replace": 2.0},
    ),
    state(160.0, "RUNNING", "SUCCEEDED"),
    ev(161.0, "metrics_exporter", url="late event after the end"),
]


def test_goodput_splits_the_wall_time():
    g = goodput(SYNTHETIC, redone=6)
    # median step time: median of 1/2, 1/2, 1/4 = 0.5 s; 6 redone steps = 3 s
    assert g.step_time_s == pytest.approx(0.5)
    assert g.wall_s == pytest.approx(60.0)  # first event to SUCCEEDED, not the late event
    assert g.startup_s == pytest.approx(10.0)
    # the recovery's own measure (5.5 s), not only its RECOVERING state (4 s)
    assert g.recovering_s == pytest.approx(5.5)
    assert g.redone_s == pytest.approx(3.0)
    assert g.productive_s == pytest.approx(50.0 - 5.5 - 3.0)
    assert g.whole_job == pytest.approx(41.5 / 60.0)
    # the exporter's view: since the first RUNNING
    assert g.since_running == pytest.approx(41.5 / 50.0)
    assert not g.from_exporter
    parts = g.startup_s + g.recovering_s + g.redone_s + g.productive_s
    assert parts == pytest.approx(g.wall_s)


def test_goodput_follows_the_exporters_number_when_result_json_has_it():
    # result.json's goodput is the exporter's productive / wall since RUNNING (50 s here):
    # 0.87 -> 43.5 s productive; the redone time is what recovering (5.5 s) leaves: 1 s.
    g = goodput(SYNTHETIC, redone=6, exporter=0.87)
    assert g.from_exporter
    assert g.since_running == 0.87
    assert g.productive_s == pytest.approx(43.5)
    assert g.redone_s == pytest.approx(1.0)
    assert g.whole_job == pytest.approx(43.5 / 60.0)  # the same seconds over the whole wall
    parts = g.startup_s + g.recovering_s + g.redone_s + g.productive_s
    assert parts == pytest.approx(g.wall_s)
    # No redone steps: the exporter's productive is the time not recovering (result.json's
    # rounding to 4 digits does not show up as redone time)...
    g = goodput(SYNTHETIC, redone=0, exporter=0.88996)
    assert g.redone_s == 0.0
    assert g.productive_s == pytest.approx(44.5)
    assert g.since_running == 0.88996
    # ... but a number that does not fit the events is drawn as it is, not hidden.
    g = goodput(SYNTHETIC, redone=0, exporter=0.5)
    assert g.productive_s == pytest.approx(25.0)
    assert g.redone_s == pytest.approx(19.5)


def test_redone_steps_are_estimated_from_the_events_without_result_json():
    # newest step seen before the recovery: 42 (the failed rank's), restored: 35
    assert redone_steps(SYNTHETIC) == 7
    assert goodput(SYNTHETIC).redone_steps == 7
    assert goodput(SYNTHETIC).redone_s == pytest.approx(3.5)


def test_goodput_of_a_job_that_never_ran_or_has_no_states():
    never = [state(0.0, "PENDING", "SCHEDULING"), state(5.0, "SCHEDULING", "FAILED")]
    g = goodput(never)
    assert g.whole_job == 0.0
    assert g.since_running is None
    assert g.startup_s == pytest.approx(5.0)
    assert g.productive_s == 0
    stateless = goodput([ev(0.0, "throughput", step=1, steps_per_s=1.0)])
    assert not stateless.known
    assert stateless.whole_job is None
    assert goodput([]).whole_job is None
    assert goodput([], exporter=0.5).since_running is None


def test_goodput_of_a_run_that_ends_while_recovering():
    events = [
        state(0.0, "PENDING", "RUNNING"),
        state(10.0, "RUNNING", "RECOVERING"),
        ev(12.0, "generation", generation=2),
    ]
    g = goodput(events, redone=0)
    assert g.wall_s == pytest.approx(12.0)
    assert g.recovering_s == pytest.approx(2.0)
    assert g.productive_s == pytest.approx(10.0)


def test_median_step_time_ignores_intervals_without_progress():
    events = [
        ev(0, "throughput", steps_per_s=0.0),
        ev(1, "throughput", steps_per_s=None),
        ev(2, "throughput", steps_per_s=5.0),
    ]
    assert median_step_time(events) == pytest.approx(0.2)
    assert median_step_time([]) is None


# --- timeline and heatmap -------------------------------------------------------------------


def test_timeline_ties_faults_to_recoveries():
    tl = timeline(SYNTHETIC)
    assert tl.t0 == 100.0
    assert tl.end == pytest.approx(60.0)
    assert tl.first_running == pytest.approx(10.0)
    assert [m.label for m in tl.markers] == ["kill_worker r1 @41"]
    assert tl.markers[0].t == pytest.approx(29.9)  # the fault's own time, not its event's
    [rec] = tl.recoveries
    assert rec.outcome == "recovered"
    assert rec.label == "kill_worker r1"
    assert rec.start == pytest.approx(29.9)
    assert rec.duration == pytest.approx(5.5)  # recovered_after_s, from the fault
    assert rec.generation == 2
    assert rec.restore_step == 35
    assert rec.phases == {"abort": 1.0, "replace": 2.0, "detect": 0.2, "decide": 0.0}
    assert tl.steps == [2, 4, 40]
    assert not tl.has_loss  # old-format throughput events: no loss


def test_timeline_marks_failures_that_were_not_injected():
    events = [
        state(0.0, "PENDING", "RUNNING"),
        ev(
            5.0,
            "decision",
            action="replace",
            ranks=[2],
            failures=[
                {"kind": "oom", "rank": 2, "step": 9},
                {"kind": "comm_error", "rank": 0, "step": 9},  # a symptom: left out
            ],
        ),
        state(5.0, "RUNNING", "RECOVERING"),
        ev(
            7.0,
            "recovered",
            generation=2,
            restore_step=8,
            recovered_after_s=[2.5],
            detected_after_s=[None],
            decided_after_s=[0.1],
            phases_s={"abort": 0.3},
        ),
        ev(8.0, "straggler", rank=3, score=2.7),
        ev(9.0, "cordoned", node="abcdef0123456789"),
        ev(9.5, "gpu_fatal", node="abcdef0123456789", gpu=0),
        ev(10.0, "persisted", step=10, seconds=0.4, bytes=2_000_000),
        ev(11.0, "persist_failed", step=20),
    ]
    tl = timeline(events)
    assert [(m.kind, m.label) for m in tl.markers] == [
        ("failure", "oom r2"),
        ("straggler", "straggler r3 2.7x"),
        ("cordon", "cordon abcdef01"),
        ("gpu", "gpu_fatal abcdef01 gpu 0"),
    ]
    [rec] = tl.recoveries
    assert rec.label == "oom r2"
    assert rec.end == pytest.approx(7.0)
    assert rec.start == pytest.approx(4.5)  # recovered minus recovered_after_s
    assert not rec.detect_known
    assert "detect" not in rec.phases
    assert tl.persisted == [{"t": 10.0, "step": 10, "seconds": 0.4, "bytes": 2_000_000.0}]
    assert tl.persist_failed == [{"t": 11.0, "step": 20}]


def test_timeline_recovery_that_gives_up():
    events = [
        state(0.0, "PENDING", "RUNNING"),
        ev(3.0, "fault_injected", kind="hang", rank=0, step=5, at=2.5),
        ev(6.0, "decision", action="fail", failures=[{"kind": "hung", "rank": 0}]),
        state(6.5, "RUNNING", "FAILED"),
    ]
    [rec] = timeline(events).recoveries
    assert rec.outcome == "gave up"
    assert rec.start == pytest.approx(2.5)
    assert rec.end == pytest.approx(6.5)


def test_timeline_tolerates_odd_events():
    events = [
        ev(0.0, "throughput"),  # no fields at all
        ev(1.0, "decision", action="replace", failures="not a list"),
        ev(2.0, "no_such_type", x=1),
        ev(3.0, "recovered", recovered_after_s="?", phases_s={"abort": "x", "replace": 0.1}),
    ]
    tl = timeline(events)
    assert tl.steps == [None]
    [rec] = tl.recoveries
    assert rec.phases == {"replace": 0.1}
    assert heatmap(events).ranks == []


def test_heatmap_columns_follow_the_throughput_intervals():
    events = [
        ev(10.0, "state", new="RUNNING"),
        ev(11.0, "throughput", rank_compute_s={"0": 0.1, "1": 0.3}),
        ev(12.0, "throughput", rank_compute_s={"0": 0.1}),
        ev(13.0, "throughput"),  # an old-format event: a blank column
        ev(14.0, "throughput", rank_compute_s={"0": 0.2, "2": 0.5}),
    ]
    hm = heatmap(events)
    assert hm.ranks == [0, 1, 2]
    assert hm.ranks_total == 3
    assert not hm.partial  # the events do not say how many ranks the job has
    assert hm.edges == [0.0, 1.0, 2.0, 3.0, 4.0]
    nan = float("nan")
    expect = [[0.1, 0.1, nan, 0.2], [0.3, nan, nan, nan], [nan, nan, nan, 0.5]]
    for row, want in zip(hm.values, expect, strict=True):
        assert row == pytest.approx(want, nan_ok=True)
    # over the other ranks' median in the column; NaN without a peer to compare with
    rel = hm.relative()
    assert rel[0] == pytest.approx([0.1 / 0.3, nan, nan, 0.2 / 0.5], nan_ok=True)
    assert rel[1] == pytest.approx([3.0, nan, nan, nan], nan_ok=True)
    assert rel[2] == pytest.approx([nan, nan, nan, 2.5], nan_ok=True)


@pytest.mark.parametrize("seed", range(20))
def test_median_of_others_is_the_leave_one_out_median(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 12)
    values = [rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(k)]  # with ties
    want = [
        statistics.median(values[:i] + values[i + 1 :]) if k > 1 else float("nan") for i in range(k)
    ]
    assert median_of_others(np.array(values)) == pytest.approx(want, nan_ok=True)


def test_heatmap_of_intervals_holding_only_some_ranks():
    # A job of more than 64 ranks logs the slowest 64 of each interval (here: 3 of 10) and
    # the job's rank count; the rank sets differ between intervals.
    events = [
        ev(0.0, "state", new="RUNNING"),
        ev(1.0, "throughput", rank_compute_s={"2": 0.3, "5": 0.2, "9": 0.2}, ranks_total=10),
        ev(2.0, "throughput", rank_compute_s={"2": 0.6, "7": 0.2, "5": 0.2}, ranks_total=10),
        ev(3.0, "throughput", rank_compute_s={}, ranks_total=10),
    ]
    hm = heatmap(events)
    assert hm.ranks == [2, 5, 7, 9]
    assert hm.ranks_total == 10
    assert hm.partial
    nan = float("nan")
    assert hm.values[hm.ranks.index(7)] == pytest.approx([nan, 0.2, nan], nan_ok=True)
    assert hm.values[hm.ranks.index(9)] == pytest.approx([0.2, nan, nan], nan_ok=True)
    rel = hm.relative()  # compared with the ranks the interval holds
    assert rel[hm.ranks.index(2)] == pytest.approx([1.5, 3.0, nan], nan_ok=True)
    assert rel[hm.ranks.index(7)] == pytest.approx([nan, 0.2 / 0.4, nan], nan_ok=True)
    # the rows asked for, in that order (the figure draws a subset)
    want = np.array([[0.2, nan, nan], [0.3, 0.6, nan]])
    assert hm.matrix([9, 2]) == pytest.approx(want, nan_ok=True)
    assert hm.relative([7]) == pytest.approx(np.array([[nan, 0.5, nan]]), nan_ok=True)


def test_heatmap_slowest_ranks_are_the_sustained_stragglers():
    rng = random.Random(1)
    columns = []
    for c in range(20):
        times = {r: 0.1 * rng.uniform(0.95, 1.05) for r in range(100)}
        if 5 <= c < 12:
            times[37] *= 2.0  # slow for seven intervals
        if c == 3:
            times[80] *= 5.0  # one odd interval: not a straggler
        times[64] *= 1.3  # a little slow all along
        columns.append({str(r): t for r, t in times.items()})
    events = [ev(float(c + 1), "throughput", rank_compute_s=v) for c, v in enumerate(columns)]
    hm = heatmap(events)
    assert hm.slowest(1) == [37]
    assert hm.slowest(2) == [37, 64]
    three = hm.slowest(3)
    assert {37, 64} < set(three) and three == sorted(three)
    assert hm.slowest(500) == list(range(100))


# --- reading the run dir ----------------------------------------------------------------------


def test_missing_dir_and_missing_or_empty_events(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(ReportError, match=r"events\.jsonl: missing"):
        load_run(tmp_path)
    (tmp_path / "events.jsonl").write_text("\n\n")
    with pytest.raises(ReportError, match=r"events\.jsonl: empty"):
        load_run(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ReportError, match="not a directory"):
        load_run(tmp_path / "file")


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    good = [json.dumps(e) for e in SYNTHETIC]
    lines = [good[0], "{not json", good[1], '"a string"', '{"type": "state"}', *good[2:]]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    run = load_run(tmp_path)
    assert run.skipped_lines == [2, 4, 5]
    assert len(run.events) == len(SYNTHETIC)
    assert any("skipped 3 malformed line(s) (line 2, 4, 5)" in w for w in run.warnings)
    assert "no result.json: the run did not finish" in run.warnings


def test_no_parsable_line_is_an_error(tmp_path):
    (tmp_path / "events.jsonl").write_text("garbage\n{also garbage\n")
    with pytest.raises(ReportError, match=r"none of its 2 line\(s\).*first bad line: 1"):
        load_run(tmp_path)


def test_unreadable_result_json_is_an_error(tmp_path):
    write_run(tmp_path, SYNTHETIC)
    (tmp_path / "result.json").write_text("{truncated")
    with pytest.raises(ReportError, match=r"result\.json: not valid JSON"):
        load_run(tmp_path)


def test_files_that_cannot_be_read_are_errors_naming_file_and_reason(tmp_path, monkeypatch):
    # (The tests run as root, where chmod 000 does not stop a read: a directory does.)
    (tmp_path / "events.jsonl").mkdir()
    with pytest.raises(ReportError, match=r"events\.jsonl: cannot read it \(Is a directory\)"):
        load_run(tmp_path)
    run = write_run(tmp_path / "run", SYNTHETIC)
    (run / "result.json").mkdir()
    with pytest.raises(ReportError, match=r"result\.json: cannot read it \(Is a directory\)"):
        load_run(run)
    (run / "result.json").rmdir()

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(
        ReportError, match=r"run/events\.jsonl: cannot read it \(Permission denied\)"
    ):
        load_run(run)


# --- the real run's report --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return build_report(DATA, out)


def test_the_test_run_is_what_the_tests_need():
    run = load_run(DATA)
    assert run.skipped_lines == []
    assert run.result is not None
    types = {e["type"] for e in run.events}
    assert {"fault_injected", "decision", "recovered", "persisted", "throughput"} <= types
    assert sum(e["type"] == "recovered" for e in run.events) >= 2
    tp = [e for e in run.events if e["type"] == "throughput"]
    assert all("loss" in e and "rank_compute_s" in e for e in tp)
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 200_000


def test_all_six_files_are_written(real_report):
    names = [p.name for p in real_report.files]
    assert names == [*PNGS, "index.html"]
    assert all(p.parent == real_report.out_dir for p in real_report.files)
    assert real_report.warnings == []


@pytest.mark.parametrize("png", PNGS)
def test_pngs_are_valid_images(real_report, png):
    path = real_report.out_dir / png
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert 10_000 < path.stat().st_size < 500_000
    image = imread(path)
    height, width = image.shape[:2]
    assert 300 <= height <= 1400
    assert 1000 <= width <= 1600


def test_the_real_run_timeline(real_report):
    run = load_run(DATA)
    tl = timeline(run.events)
    assert tl.has_loss
    done = [r for r in tl.recoveries if r.outcome == "recovered"]
    assert len(done) >= 2
    assert all(0 < r.duration < 30 for r in done)
    assert all(set(r.phases) >= {"detect", "abort", "restore", "first_step"} for r in done)
    faults = [m.label for m in tl.markers if m.kind == "fault"]
    assert any(f.startswith("kill_worker r1") for f in faults)
    assert any(f.startswith("kill_worker r2") for f in faults)
    assert tl.persisted and all(p["seconds"] is not None for p in tl.persisted)
    hm = heatmap(run.events)
    assert hm.ranks == [0, 1, 2, 3]
    g = goodput(run.events, run.result["lost_steps_total"])
    assert 0 < g.whole_job < g.since_running < 1
    assert g.wall_s == pytest.approx(run.result["wall_seconds"], abs=2.0)


def test_html_references_each_png(real_report):
    page = (real_report.out_dir / "index.html").read_text()
    for png in PNGS:
        assert f'<img src="{png}"' in page
    assert "<figcaption>" in page
    run = load_run(DATA)
    assert run.result["name"] in page


def test_html_escapes_the_job_name_and_default_out_dir(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DATA, run)
    result = json.loads((run / "result.json").read_text())
    result["name"] = "<script>alert('x')</script> $x$"
    (run / "result.json").write_text(json.dumps(result))
    report = build_report(run)
    assert report.out_dir == run / "report"
    page = (run / "report" / "index.html").read_text()
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page


def test_html_names_both_goodputs_and_takes_the_exporters_from_result_json(tmp_path, real_report):
    page = (real_report.out_dir / "index.html").read_text()
    assert "goodput, whole job (incl. start-up)" in page
    assert "goodput since RUNNING (estimated)" in page  # this result.json has no goodput
    run = tmp_path / "run"
    shutil.copytree(DATA, run)
    result = json.loads((run / "result.json").read_text())
    result["goodput"] = 0.9123
    (run / "result.json").write_text(json.dumps(result))
    build_report(run)
    page = (run / "report" / "index.html").read_text()
    assert "goodput since RUNNING (the exporter&#x27;s)</th><td>91.2%: result.json" in page
    assert "(estimated)" not in page


def test_run_without_result_json_and_old_throughput_events(tmp_path):
    # Throughput events as runs wrote them before loss and rank_compute_s: still drawn.
    run = write_run(tmp_path / "old", SYNTHETIC)
    report = build_report(run)
    assert [p.name for p in report.files] == [*PNGS, "index.html"]
    assert "no result.json: the run did not finish" in report.warnings
    page = (run / "report" / "index.html").read_text()
    assert "no result.json: the run did not finish" in page
    for png in PNGS:
        assert (run / "report" / png).read_bytes()[:8] == PNG_SIGNATURE


# --- a big job ---------------------------------------------------------------------------------


def big_run(path: Path, ranks: int = 2000, intervals: int = 90, logged: int | None = None) -> Path:
    """A synthetic run of `ranks` ranks: rank 1234 is 2.5x slow from interval 30 to 60, rank
    7 1.6x slow all along. `logged`: each throughput event holds only that many of the
    slowest ranks, and ranks_total (as the supervisor logs a job of more than 64 ranks)."""
    rng = random.Random(0)
    events = [state(1000.0, "PENDING", "SCHEDULING"), state(1005.0, "SCHEDULING", "RUNNING")]
    for c in range(intervals):
        times = {r: 0.2 * rng.uniform(0.9, 1.1) for r in range(ranks)}
        times[7] *= 1.6
        if 30 <= c < 60:
            times[1234] *= 2.5
        if logged is not None:
            times = dict(sorted(times.items(), key=lambda kv: kv[1])[-logged:])
        extra = {"ranks_total": ranks} if logged is not None else {}
        rank_times = {str(r): round(t, 6) for r, t in sorted(times.items())}
        events.append(
            ev(1006.0 + c, "throughput", step=4 * c, steps_per_s=4.0, rank_compute_s=rank_times)
            | extra
        )
    events.append(ev(1036.0, "straggler", rank=1234, score=2.5))
    events.append(state(1006.0 + intervals, "RUNNING", "SUCCEEDED"))
    result = {"name": f"big{ranks}", "status": "succeeded", "goodput": 1.0}
    return write_run(path, events, result)


@pytest.mark.parametrize("logged", [None, 64], ids=["every_rank", "64_slowest_logged"])
def test_a_2000_rank_run_draws_its_slowest_ranks_in_bounded_time_and_size(tmp_path, logged):
    run = big_run(tmp_path / "big", logged=logged)
    hm = heatmap(load_run(run).events)
    assert hm.ranks_total == 2000
    assert hm.partial == (logged is not None)
    assert max(len(cells) for cells in hm.columns) == (logged or 2000)  # kept per column
    assert {7, 1234} <= set(hm.slowest(64))
    started = time.monotonic()
    report = build_report(run)
    assert time.monotonic() - started < 60
    png = run / "report" / "step_time_heatmap.png"
    assert png in report.files
    assert png.stat().st_size < 1_500_000
    height, width = imread(png).shape[:2]
    assert 1000 <= height <= 2000  # 64 rank rows at most, not 0.5 in per rank
    assert width <= 1600


# --- the command --------------------------------------------------------------------------------


def test_cli_writes_the_report_and_prints_json(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["report", str(DATA), "--out-dir", str(out), "-o", "json"])
    assert r.exit_code == 0, r.output
    files = json.loads(r.stdout)
    assert [Path(f).name for f in files] == [*PNGS, "index.html"]
    assert all(Path(f).is_file() and Path(f).parent == out for f in files)


def test_cli_text_output_and_warnings(tmp_path):
    run = write_run(tmp_path / "run", SYNTHETIC)
    r = CliRunner().invoke(main, ["report", str(run)])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [str(run / "report" / f) for f in [*PNGS, "index.html"]]
    assert "warning: no result.json: the run did not finish" in r.stderr


@pytest.mark.parametrize("case", ["missing_dir", "no_events", "garbage", "unreadable"])
def test_cli_errors_exit_2(tmp_path, case):
    run = tmp_path / "run"
    if case != "missing_dir":
        run.mkdir()
    if case == "garbage":
        (run / "events.jsonl").write_text("[oops\n")
    if case == "unreadable":
        (run / "events.jsonl").mkdir()
    r = CliRunner().invoke(main, ["report", str(run)])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ")
    assert r.stdout == ""


def test_a_partial_column_compares_its_slowest_ranks_with_the_whole_jobs_median():
    t0 = 1000.0
    events = [
        {"ts": t0, "type": "state", "old": "SCHEDULING", "new": "RUNNING"},
        # 100 ranks, the 2 slowest logged; every rank's median is 0.1 s.
        {
            "ts": t0 + 1,
            "type": "throughput",
            "step": 10,
            "steps_per_s": 5.0,
            "rank_compute_s": {"7": 0.3, "9": 0.11},
            "compute_median_s": 0.1,
            "ranks_total": 100,
        },
        # An older event without the median: the logged ranks compare with each other.
        {
            "ts": t0 + 2,
            "type": "throughput",
            "step": 15,
            "steps_per_s": 5.0,
            "rank_compute_s": {"7": 0.3, "9": 0.1},
            "ranks_total": 100,
        },
    ]
    hm = heatmap(events)
    assert hm.partial and hm.ranks_total == 100
    first, second = hm.ratios()
    assert first == pytest.approx({7: 3.0, 9: 1.1})
    assert second == pytest.approx({7: 3.0, 9: 1 / 3})

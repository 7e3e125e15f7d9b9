"""orchestrator/report.py and `stalwart report`: the numbers behind the figures on small
synthetic event lists, the files written for a real run's events (tests/unit/data/report_run,
a trimmed run with two killed workers, a slowed rank and durable checkpoints), and the
errors for unreadable run directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from orchestrator.cli import main
from orchestrator.report import (
    FIGURES,
    ReportError,
    build_report,
    goodput,
    heatmap,
    load_run,
    median_step_time,
    redone_steps,
    timeline,
)

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

# Start at 100: 10 s of start-up, RUNNING at 110, a recovery of 4 s at 130, SUCCEEDED at 160.
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
    assert g.recovering_s == pytest.approx(4.0)
    assert g.redone_s == pytest.approx(3.0)
    assert g.productive_s == pytest.approx(50.0 - 4.0 - 3.0)
    assert g.goodput == pytest.approx(43.0 / 60.0)
    # the exporter's view: since the first RUNNING
    assert g.running_goodput == pytest.approx(43.0 / 50.0)
    parts = g.startup_s + g.recovering_s + g.redone_s + g.productive_s
    assert parts == pytest.approx(g.wall_s)


def test_redone_steps_are_estimated_from_the_events_without_result_json():
    # newest step seen before the recovery: 42 (the failed rank's), restored: 35
    assert redone_steps(SYNTHETIC) == 7
    assert goodput(SYNTHETIC).redone_steps == 7
    assert goodput(SYNTHETIC).redone_s == pytest.approx(3.5)


def test_goodput_of_a_job_that_never_ran_or_has_no_states():
    never = [state(0.0, "PENDING", "SCHEDULING"), state(5.0, "SCHEDULING", "FAILED")]
    g = goodput(never)
    assert g.goodput == 0.0
    assert g.startup_s == pytest.approx(5.0)
    assert g.productive_s == 0
    stateless = goodput([ev(0.0, "throughput", step=1, steps_per_s=1.0)])
    assert not stateless.known
    assert stateless.goodput is None
    assert goodput([]).goodput is None


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
    assert 0 < g.goodput < 1
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


# --- the command --------------------------------------------------------------------------------


def test_cli_writes_the_report_and_prints_json(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["report", str(DATA), "--output", str(out), "-o", "json"])
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


@pytest.mark.parametrize("case", ["missing_dir", "no_events", "garbage"])
def test_cli_errors_exit_2(tmp_path, case):
    run = tmp_path / "run"
    if case != "missing_dir":
        run.mkdir()
    if case == "garbage":
        (run / "events.jsonl").write_text("[oops\n")
    r = CliRunner().invoke(main, ["report", str(run)])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ")
    assert r.stdout == ""

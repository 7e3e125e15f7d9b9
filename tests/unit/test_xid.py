"""health/xid.py: the Xid table and sorting GPU readings into fatal / application / info."""

from __future__ import annotations

import pytest

from stalwart.health.xid import (
    XID_TABLE,
    GpuReading,
    GpuVerdict,
    Severity,
    classify_xid,
    judge_gpus,
)

FATAL_XIDS = [48, 62, 64, 74, 79, 95, 119, 120, 140, 143]
APPLICATION_XIDS = [13, 31, 43, 45, 68]
MAX_T = 95.0


def reading(node: str = "node-a", index: int = 0, **kw) -> GpuReading:
    return GpuReading(node, index, 1_000.0, **kw)


# --- the table --------------------------------------------------------------------------------


@pytest.mark.parametrize("xid", FATAL_XIDS)
def test_fatal_xids(xid):
    severity, text = classify_xid(xid)
    assert severity is Severity.FATAL
    assert text


@pytest.mark.parametrize("xid", APPLICATION_XIDS)
def test_application_xids(xid):
    severity, text = classify_xid(xid)
    assert severity is Severity.APPLICATION
    assert text


@pytest.mark.parametrize("xid", [0, 1, 8, 32, 63, 92, 94, 999, -1])
def test_unknown_xids_are_info(xid):
    assert classify_xid(xid) == (Severity.INFO, "not in stalwart's table: recorded only")


def test_table_holds_exactly_the_documented_codes():
    assert sorted(XID_TABLE) == sorted(FATAL_XIDS + APPLICATION_XIDS)
    assert all(isinstance(text, str) and text for _, text in XID_TABLE.values())


def test_xid_79_text():
    assert classify_xid(79) == (Severity.FATAL, "GPU has fallen off the bus")


# --- judge_gpus -------------------------------------------------------------------------------


def test_no_readings_is_healthy():
    verdict, reason = judge_gpus([], {}, MAX_T)
    assert verdict == GpuVerdict()
    assert reason == "all GPUs healthy"


def test_healthy_readings():
    readings = [reading(index=i, temperature_c=60.0, power_w=300.0) for i in range(8)]
    verdict, reason = judge_gpus(readings, {("node-a", i): 0 for i in range(8)}, MAX_T)
    assert verdict == GpuVerdict({}, {}, {})
    assert reason == "all GPUs healthy"


@pytest.mark.parametrize("xid", FATAL_XIDS)
def test_fatal_xid_reading(xid):
    verdict, reason = judge_gpus([reading("node-b", 3, xids=(xid,))], {}, MAX_T)
    assert verdict.fatal == {("node-b", 3): f"Xid {xid}: {XID_TABLE[xid][1]}"}
    assert verdict.application == {}
    assert verdict.info == {}
    assert reason == f"fatal on node node-b gpu 3: Xid {xid}: {XID_TABLE[xid][1]}"


@pytest.mark.parametrize("xid", APPLICATION_XIDS)
def test_application_xid_reading(xid):
    verdict, reason = judge_gpus([reading(index=1, xids=(xid,))], {}, MAX_T)
    assert verdict.fatal == {}
    assert verdict.application == {("node-a", 1): f"Xid {xid}: {XID_TABLE[xid][1]}"}
    assert reason.startswith("application error on node node-a gpu 1: ")


def test_unknown_xid_reading_is_info():
    verdict, reason = judge_gpus([reading(xids=(94,))], {}, MAX_T)
    assert verdict.fatal == {} and verdict.application == {}
    assert verdict.info == {("node-a", 0): "Xid 94: not in stalwart's table: recorded only"}
    assert reason.startswith("note on node node-a gpu 0: Xid 94")


def test_lost_gpu_is_fatal():
    verdict, _ = judge_gpus([reading(index=5, lost=True)], {}, MAX_T)
    assert verdict.fatal == {("node-a", 5): "GPU lost (stopped answering)"}


def test_ecc_increase_since_job_start_is_fatal():
    verdict, reason = judge_gpus([reading(ecc_uncorrected=3)], {("node-a", 0): 2}, MAX_T)
    assert verdict.fatal == {("node-a", 0): "uncorrectable ECC errors rose to 3"}
    assert "rose to 3" in reason


def test_ecc_count_already_there_at_job_start_is_not_fatal():
    verdict, reason = judge_gpus([reading(ecc_uncorrected=7)], {("node-a", 0): 7}, MAX_T)
    assert verdict.fatal == {}
    assert reason == "all GPUs healthy"


def test_ecc_count_without_a_baseline_is_not_fatal():
    # No start-of-job count for this GPU: the count is taken as old.
    verdict, _ = judge_gpus([reading(ecc_uncorrected=4)], {("node-a", 1): 0}, MAX_T)
    assert verdict.fatal == {}


def test_ecc_baseline_is_per_gpu_and_per_node():
    readings = [
        reading("node-a", 0, ecc_uncorrected=1),
        reading("node-a", 1, ecc_uncorrected=1),
        reading("node-b", 0, ecc_uncorrected=1),
    ]
    previous = {("node-a", 0): 1, ("node-a", 1): 0, ("node-b", 0): 0}
    verdict, _ = judge_gpus(readings, previous, MAX_T)
    assert set(verdict.fatal) == {("node-a", 1), ("node-b", 0)}


def test_remap_failure_is_fatal():
    verdict, _ = judge_gpus([reading(remap_failure=True)], {}, MAX_T)
    assert verdict.fatal == {("node-a", 0): "row remapping failed"}


def test_retired_pages_alone_are_not_fatal():
    verdict, _ = judge_gpus([reading(retired_pages=12)], {}, MAX_T)
    assert verdict == GpuVerdict()


def test_hot_gpu_is_only_info():
    verdict, reason = judge_gpus([reading(index=2, temperature_c=97.0)], {}, MAX_T)
    assert verdict.fatal == {} and verdict.application == {}
    assert verdict.info == {("node-a", 2): "temperature 97 C > 95 C"}
    assert reason == "note on node node-a gpu 2: temperature 97 C > 95 C"


@pytest.mark.parametrize("temperature", [95.0, 40.0, None])
def test_temperature_at_or_below_max_is_fine(temperature):
    verdict, _ = judge_gpus([reading(temperature_c=temperature)], {}, MAX_T)
    assert verdict.info == {}


def test_probe_error_is_info():
    verdict, _ = judge_gpus([reading(index=-1, error="Xid event wait failed")], {}, MAX_T)
    assert verdict.info == {("node-a", -1): "probe error: Xid event wait failed"}
    assert verdict.fatal == {}


def test_multiple_findings_on_one_gpu_are_joined():
    r = reading(
        index=4,
        lost=True,
        ecc_uncorrected=2,
        remap_failure=True,
        xids=(79, 13, 48),
        temperature_c=101.0,
        error="power: Unknown Error",
    )
    verdict, reason = judge_gpus([r], {("node-a", 4): 0}, MAX_T)
    key = ("node-a", 4)
    assert verdict.fatal == {
        key: "GPU lost (stopped answering); uncorrectable ECC errors rose to 2; "
        "row remapping failed; Xid 79: GPU has fallen off the bus; "
        "Xid 48: double-bit ECC error"
    }
    assert verdict.application == {
        key: "Xid 13: graphics engine exception (e.g. out-of-range access)"
    }
    assert verdict.info == {key: "temperature 101 C > 95 C; probe error: power: Unknown Error"}
    # One part per severity, fatal first.
    assert reason.index("fatal on") < reason.index("application error on") < reason.index("note on")


def test_two_readings_of_one_gpu_are_joined():
    readings = [reading(index=0, xids=(31,)), reading(index=0, xids=(43,))]
    verdict, _ = judge_gpus(readings, {}, MAX_T)
    assert verdict.application == {
        ("node-a", 0): "Xid 31: GPU memory page fault (illegal address); "
        "Xid 43: GPU stopped processing (reset channel)"
    }


def test_findings_kept_apart_per_gpu_and_node_and_reason_sorted():
    readings = [
        reading("node-b", 1, xids=(79,)),
        reading("node-a", 7, xids=(79,)),
        reading("node-a", 2, xids=(79,)),
        reading("node-a", 3),
    ]
    verdict, reason = judge_gpus(readings, {}, MAX_T)
    assert sorted(verdict.fatal) == [("node-a", 2), ("node-a", 7), ("node-b", 1)]
    assert [p.split(":")[0] for p in reason.split("; ")] == [
        "fatal on node node-a gpu 2",
        "fatal on node node-a gpu 7",
        "fatal on node node-b gpu 1",
    ]


def test_reason_shortens_node_ids():
    verdict, reason = judge_gpus([reading("n" * 40, 0, lost=True)], {}, MAX_T)
    assert ("n" * 40, 0) in verdict.fatal
    assert reason == f"fatal on node {'n' * 12} gpu 0: GPU lost (stopped answering)"


def test_previous_ecc_is_not_mutated():
    previous = {("node-a", 0): 1}
    judge_gpus([reading(ecc_uncorrected=5)], previous, MAX_T)
    assert previous == {("node-a", 0): 1}

"""orchestrator/spec.py: the health section and the kill_node / hang / slow / gpu_xid faults."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.spec import (
    GpuXid,
    Hang,
    KillNode,
    Slow,
    apply_overrides,
    json_schema,
    parse_override,
    validate,
)
from tests.unit.test_spec import errors_of, spec_with


def with_faults(*faults: dict) -> dict:
    return spec_with(chaos={"faults": list(faults)})


def with_health(**health) -> dict:
    return spec_with(health=health)


# --- health defaults --------------------------------------------------------------------------


def test_health_defaults():
    h = validate(spec_with()).health
    assert h.heartbeat_timeout_s == 3.0
    assert h.hang_timeout_s is None  # derived from the job's steps (health.hang)
    assert (h.hang.floor_s, h.hang.factor, h.hang.startup_s) == (20.0, 5.0, 300.0)
    assert (h.hang.busy_limit_s, h.hang.min_steps, h.hang.copies_s) == (1800.0, 5, 60.0)
    assert h.cordon_ttl_s == 3600.0
    assert h.straggler.policy == "alert"
    assert h.straggler.threshold == 2.0
    assert h.straggler.window_steps == 5
    assert h.straggler.consecutive_windows == 2
    assert h.straggler.min_excess_s == 0.005
    assert h.gpu.probe == "auto"
    assert h.gpu.interval_s == 2.0
    assert h.gpu.max_temperature_c == 95.0
    assert h.preflight.enabled is True
    assert h.preflight.matmul_size == 256
    assert h.preflight.matmul_repeats == 20
    assert h.preflight.max_slowdown == 3.0
    assert h.preflight.timeout_s == 30.0


def test_hang_defaults_match_the_policy_defaults():
    from stalwart.health.hang_timeout import HangPolicy

    assert HangPolicy(**validate(spec_with()).health.hang.model_dump()) == HangPolicy()


def test_straggler_defaults_match_the_detector_defaults():
    from stalwart.health.straggler import StragglerConfig

    s = validate(spec_with()).health.straggler
    assert (
        StragglerConfig(s.threshold, s.window_steps, s.consecutive_windows, s.min_excess_s)
        == StragglerConfig()
    )


def test_partial_health_section_keeps_other_defaults():
    h = validate(with_health(straggler={"policy": "replace"}, gpu={"probe": "fake"})).health
    assert h.straggler.policy == "replace"
    assert h.straggler.threshold == 2.0
    assert h.gpu.probe == "fake"
    assert h.hang_timeout_s is None
    assert h.preflight.enabled is True


def test_health_values_set():
    h = validate(
        with_health(
            heartbeat_timeout_s=0.5,
            hang_timeout_s=30,
            cordon_ttl_s=None,
            straggler={"policy": "none", "threshold": 2.5, "window_steps": 10},
            gpu={"probe": "none", "interval_s": 0.5, "max_temperature_c": 85},
            preflight={"enabled": False, "max_slowdown": 1.5},
        )
    ).health
    assert (h.heartbeat_timeout_s, h.hang_timeout_s, h.cordon_ttl_s) == (0.5, 30.0, None)
    assert (h.straggler.policy, h.straggler.threshold, h.straggler.window_steps) == (
        "none",
        2.5,
        10,
    )
    assert (h.gpu.probe, h.gpu.interval_s, h.gpu.max_temperature_c) == ("none", 0.5, 85.0)
    assert (h.preflight.enabled, h.preflight.max_slowdown) == (False, 1.5)


@pytest.mark.parametrize("policy", ["alert", "replace", "none"])
def test_straggler_policies(policy):
    assert validate(with_health(straggler={"policy": policy})).health.straggler.policy == policy


@pytest.mark.parametrize("probe", ["auto", "nvml", "fake", "none"])
def test_gpu_probes(probe):
    assert validate(with_health(gpu={"probe": probe})).health.gpu.probe == probe


# --- health errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [1, 1.0, 0.5, 0])
def test_straggler_threshold_must_exceed_one(threshold):
    assert errors_of(with_health(straggler={"threshold": threshold})) == [
        f"health.straggler.threshold: must be > 1.0, got {threshold!r}"
    ]


def test_straggler_threshold_just_over_one_is_fine():
    assert validate(with_health(straggler={"threshold": 1.01})).health.straggler.threshold == 1.01


def test_straggler_policy_kill_is_rejected():
    (err,) = errors_of(with_health(straggler={"policy": "kill"}))
    assert err.startswith("health.straggler.policy: ")
    assert "'alert', 'replace' or 'none'" in err
    assert err.endswith('got "kill"')


def test_gpu_probe_unknown_is_rejected():
    (err,) = errors_of(with_health(gpu={"probe": "cuda"}))
    assert err.startswith("health.gpu.probe: ")
    assert "'auto', 'nvml', 'fake' or 'none'" in err


@pytest.mark.parametrize(
    ("health", "error"),
    [
        ({"heartbeat_timeout_s": 0}, "health.heartbeat_timeout_s: must be > 0.0, got 0"),
        ({"hang_timeout_s": -1}, "health.hang_timeout_s: must be > 0.0, got -1"),
        ({"cordon_ttl_s": 0}, "health.cordon_ttl_s: must be > 0.0, got 0"),
        (
            {"straggler": {"window_steps": 0}},
            "health.straggler.window_steps: must be >= 1, got 0",
        ),
        (
            {"straggler": {"consecutive_windows": 0}},
            "health.straggler.consecutive_windows: must be >= 1, got 0",
        ),
        (
            {"straggler": {"min_excess_s": -0.001}},
            "health.straggler.min_excess_s: must be >= 0.0, got -0.001",
        ),
        ({"gpu": {"interval_s": 0}}, "health.gpu.interval_s: must be > 0.0, got 0"),
        ({"gpu": {"max_temperature_c": 0}}, "health.gpu.max_temperature_c: must be > 0.0, got 0"),
        ({"preflight": {"matmul_size": 8}}, "health.preflight.matmul_size: must be >= 16, got 8"),
        (
            {"preflight": {"matmul_repeats": 0}},
            "health.preflight.matmul_repeats: must be >= 1, got 0",
        ),
        (
            {"preflight": {"max_slowdown": 1}},
            "health.preflight.max_slowdown: must be > 1.0, got 1",
        ),
        ({"preflight": {"timeout_s": 0}}, "health.preflight.timeout_s: must be > 0.0, got 0"),
        ({"bogus": 1}, "health.bogus: unknown field"),
        ({"straggler": {"windows": 3}}, "health.straggler.windows: unknown field"),
        ({"gpu": {"xid_table": {}}}, "health.gpu.xid_table: unknown field"),
    ],
)
def test_health_errors_name_the_field_path(health, error):
    assert errors_of(with_health(**health)) == [error]


def test_several_health_errors_at_once():
    errs = errors_of(with_health(hang_timeout_s=0, straggler={"threshold": 1, "policy": "kill"}))
    assert len(errs) == 3
    assert {e.split(":")[0] for e in errs} == {
        "health.hang_timeout_s",
        "health.straggler.threshold",
        "health.straggler.policy",
    }


def test_health_section_of_the_wrong_type():
    (err,) = errors_of(spec_with(health=[1]))
    assert err.startswith("health: ")


# --- the new fault kinds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "cls"),
    [
        ({"kind": "kill_node", "rank": 1, "at_step": 5, "after_commit": True}, KillNode),
        ({"kind": "hang", "rank": 2, "at_step": 6, "after_commit": False}, Hang),
        ({"kind": "slow", "rank": 3, "at_step": 0, "factor": 4.5}, Slow),
        ({"kind": "gpu_xid", "rank": 0, "at_step": 99, "xid": 79}, GpuXid),
    ],
)
def test_new_fault_kinds_parse(fault, cls):
    (parsed,) = validate(with_faults(fault)).chaos.faults
    assert type(parsed) is cls
    assert parsed.model_dump() == {
        "after_commit": False,
        "after_persist": False,
        "during": None,
        "in_collective": None,
        "peer_of_rank": None,
        **fault,
    }


def test_slow_factor_defaults_to_three():
    (fault,) = validate(with_faults({"kind": "slow", "rank": 1, "at_step": 3})).chaos.faults
    assert fault.factor == 3.0


@pytest.mark.parametrize("factor", [1, 1.0, 0.5, 0, -2])
def test_slow_factor_must_exceed_one(factor):
    fault = {"kind": "slow", "rank": 1, "at_step": 3, "factor": factor}
    assert errors_of(with_faults(fault)) == [
        f"chaos.faults.0.factor: must be > 1.0, got {factor!r}"
    ]


def test_gpu_xid_requires_xid():
    fault = {"kind": "gpu_xid", "rank": 1, "at_step": 40}
    assert errors_of(with_faults(fault)) == ["chaos.faults.0.xid: required field is missing"]


@pytest.mark.parametrize("xid", [0, -79])
def test_gpu_xid_must_be_positive(xid):
    fault = {"kind": "gpu_xid", "rank": 1, "at_step": 40, "xid": xid}
    assert errors_of(with_faults(fault)) == [f"chaos.faults.0.xid: must be >= 1, got {xid}"]


def test_gpu_xid_one_is_the_smallest():
    fault = {"kind": "gpu_xid", "rank": 1, "at_step": 40, "xid": 1}
    assert validate(with_faults(fault)).chaos.faults[0].xid == 1


@pytest.mark.parametrize("kind", ["kill_node", "hang", "slow", "gpu_xid"])
def test_missing_fields_have_no_discriminator_tag_in_the_path(kind):
    errs = errors_of(with_faults({"kind": kind}))
    assert "chaos.faults.0.rank: required field is missing" in errs
    assert "chaos.faults.0.at_step: required field is missing" in errs
    assert all(kind not in e for e in errs)
    assert all(e.startswith("chaos.faults.0.") for e in errs)


@pytest.mark.parametrize(
    "fault",
    [
        {"kind": "kill_node", "rank": 0, "at_step": 1, "factor": 2},
        {"kind": "hang", "rank": 0, "at_step": 1, "xid": 79},
        {"kind": "gpu_xid", "rank": 0, "at_step": 1, "xid": 79, "factor": 2},
    ],
)
def test_fields_of_other_kinds_are_unknown(fault):
    (err,) = errors_of(with_faults(fault))
    assert err.startswith("chaos.faults.0.")
    assert err.endswith(": unknown field")
    assert fault["kind"] not in err


@pytest.mark.parametrize("kind", ["kill_node", "hang", "slow", "gpu_xid"])
def test_new_fault_rank_must_be_below_workers(kind):
    fault = {"kind": kind, "rank": 4, "at_step": 1}
    if kind == "gpu_xid":
        fault["xid"] = 79
    assert errors_of(with_faults(fault)) == ["chaos.faults.0.rank: must be < workers (4), got 4"]


@pytest.mark.parametrize("kind", ["kill_node", "hang", "slow"])
def test_new_fault_at_step_must_be_below_steps(kind):
    ok = {"kind": "kill_worker", "rank": 0, "at_step": 1}
    bad = {"kind": kind, "rank": 0, "at_step": 100}
    assert errors_of(with_faults(ok, bad)) == [
        "chaos.faults.1.at_step: must be < steps (100), got 100"
    ]


def test_error_in_a_later_fault_names_its_index():
    faults = [
        {"kind": "kill_node", "rank": 0, "at_step": 1},
        {"kind": "hang", "rank": 1, "at_step": 2},
        {"kind": "gpu_xid", "rank": 2, "at_step": 3},
    ]
    assert errors_of(with_faults(*faults)) == ["chaos.faults.2.xid: required field is missing"]


def test_custom_resource_named_like_a_fault_kind_keeps_its_path():
    # BUG (orchestrator/spec.py _format_error): the regex that strips the union tag
    # ('.slow', '.hang', ...) from error paths strips any path component with that name,
    # so a custom resource called "slow" loses its name in the message.
    (err,) = errors_of(spec_with(resources={"custom": {"slow": "lots"}}))
    assert err.startswith("resources.custom.slow: ")


def test_unknown_kind_lists_the_new_kinds():
    (err,) = errors_of(with_faults({"kind": "melt", "rank": 0, "at_step": 1}))
    assert err.startswith("chaos.faults.0: ")
    for kind in ("kill_worker", "kill_node", "hang", "slow", "gpu_xid"):
        assert f"'{kind}'" in err


# --- --set ------------------------------------------------------------------------------------

GPU_XID_SET = "chaos.faults=[{kind: gpu_xid, rank: 1, xid: 79, at_step: 40}]"


def test_documented_gpu_xid_override_parses():
    path, value = parse_override(GPU_XID_SET)
    assert path == ["chaos", "faults"]
    assert value == [{"kind": "gpu_xid", "rank": 1, "xid": 79, "at_step": 40}]


def test_documented_gpu_xid_override_validates():
    spec = validate(apply_overrides(spec_with(), [GPU_XID_SET]))
    (fault,) = spec.chaos.faults
    assert isinstance(fault, GpuXid)
    assert (fault.kind, fault.rank, fault.xid, fault.at_step) == ("gpu_xid", 1, 79, 40)


def test_override_replaces_existing_faults():
    data = with_faults({"kind": "kill_worker", "rank": 0, "at_step": 1})
    spec = validate(apply_overrides(data, [GPU_XID_SET]))
    assert [f.kind for f in spec.chaos.faults] == ["gpu_xid"]


def test_health_overrides_validate():
    data = apply_overrides(
        spec_with(),
        [
            "health.straggler.policy=replace",
            "health.gpu.probe=fake",
            "health.cordon_ttl_s=null",
            "health.preflight.enabled=false",
            "chaos.faults=[{kind: slow, rank: 2, at_step: 0}]",
        ],
    )
    spec = validate(data)
    assert spec.health.straggler.policy == "replace"
    assert spec.health.gpu.probe == "fake"
    assert spec.health.cordon_ttl_s is None
    assert spec.health.preflight.enabled is False
    assert spec.chaos.faults[0].factor == 3.0


def test_bad_health_override_names_the_field():
    data = apply_overrides(spec_with(), ["health.straggler.threshold=1"])
    assert errors_of(data) == ["health.straggler.threshold: must be > 1.0, got 1"]


def test_bad_fault_override_names_the_field():
    data = apply_overrides(spec_with(), ["chaos.faults=[{kind: gpu_xid, rank: 1, at_step: 4}]"])
    assert errors_of(data) == ["chaos.faults.0.xid: required field is missing"]


# --- schema -----------------------------------------------------------------------------------


def test_schema_describes_health_and_new_faults():
    schema = json_schema()
    assert "health" in schema["properties"]
    defs = schema["$defs"]
    for name in ("HealthSpec", "StragglerSpec", "GpuSpec", "PreflightSpec"):
        assert name in defs
    for name in ("KillNode", "Hang", "Slow", "GpuXid"):
        assert name in defs
    assert defs["Slow"]["properties"]["factor"]["exclusiveMinimum"] == 1
    assert defs["GpuXid"]["properties"]["xid"]["minimum"] == 1
    assert "xid" in defs["GpuXid"]["required"]


def test_after_persist_needs_a_durable_tier():
    fault = {"kind": "kill_node", "rank": 1, "at_step": 45, "after_persist": True}
    [error] = errors_of(with_faults(fault))
    assert "chaos.faults.0.after_persist" in error and "checkpoint.persist.uri" in error
    spec = with_faults(fault)
    spec["checkpoint"] = {"persist": {"uri": "/tmp/x", "every_steps": 10}}
    assert validate(spec).chaos.faults[0].after_persist is True

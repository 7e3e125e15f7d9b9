"""orchestrator/spec.py: validation messages, YAML loading, --set overrides, JSON schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from stalwart.orchestrator.spec import (
    JobSpec,
    SpecError,
    apply_overrides,
    json_schema,
    load_spec,
    parse_override,
    validate,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"

BASE = {"name": "job", "entrypoint": "pkg.mod:train", "workers": 4, "steps": 100}


def spec_with(**extra) -> dict:
    data = copy.deepcopy(BASE)
    data.update(extra)
    return data


def errors_of(data, source: str = "<spec>") -> list[str]:
    with pytest.raises(SpecError) as info:
        validate(data, source)
    assert info.value.source == source
    assert isinstance(info.value.errors, list)
    assert all(isinstance(line, str) for line in info.value.errors)
    return info.value.errors


# --- a valid spec -----------------------------------------------------------------------------


def test_minimal_spec_gets_defaults():
    spec = validate(spec_with())
    assert isinstance(spec, JobSpec)
    assert spec.workers == 4
    assert spec.steps == 100
    assert spec.resources.cpu == 1.0
    assert spec.resources.gpu == 0.0
    assert spec.resources.custom == {}
    assert spec.placement == "PACK"
    assert spec.backend == "auto"
    assert spec.checkpoint.every_steps == 1
    assert spec.failure.max_restarts == 10
    assert spec.failure.user_error_retries == 0
    assert spec.chaos.faults == []
    assert spec.config == {}


def test_spec_is_frozen():
    spec = validate(spec_with())
    with pytest.raises(ValidationError):
        spec.workers = 3


@pytest.mark.parametrize(
    ("backend", "gpu", "cuda", "expected"),
    [
        ("auto", 0, True, "gloo"),
        ("auto", 1, False, "gloo"),
        ("auto", 1, True, "nccl"),
        ("gloo", 1, True, "gloo"),
        ("nccl", 1, True, "nccl"),
    ],
)
def test_resolved_backend(backend, gpu, cuda, expected):
    spec = validate(spec_with(backend=backend, resources={"gpu": gpu}))
    assert spec.resolved_backend(cuda) == expected


def test_nccl_on_a_worker_without_cuda_is_an_error():
    spec = validate(spec_with(backend="nccl", resources={"gpu": 1}))
    with pytest.raises(ValueError, match="backend: nccl needs CUDA"):
        spec.resolved_backend(False)


def test_nccl_without_gpus_is_rejected():
    assert errors_of(spec_with(backend="nccl")) == [
        "backend: nccl needs GPUs, but resources.gpu is 0"
    ]


def test_chaos_fault_parses():
    spec = validate(
        spec_with(chaos={"faults": [{"kind": "kill_worker", "rank": 3, "at_step": 99}]})
    )
    (fault,) = spec.chaos.faults
    assert (fault.kind, fault.rank, fault.at_step) == ("kill_worker", 3, 99)


@pytest.mark.parametrize(
    "entrypoint",
    ["pkg:fn", "pkg.mod:fn", "pkg.sub_mod.x:_fn2", "path/to/train.py:main", "train.py:f"],
)
def test_good_entrypoints(entrypoint):
    assert validate(spec_with(entrypoint=entrypoint)).entrypoint == entrypoint


# --- error messages name the field path -------------------------------------------------------


def test_every_steps_zero():
    assert errors_of(spec_with(checkpoint={"every_steps": 0})) == [
        "checkpoint.every_steps: must be >= 1, got 0"
    ]


def test_workers_zero():
    assert errors_of(spec_with(workers=0)) == ["workers: must be >= 1, got 0"]


def test_negative_steps():
    assert errors_of(spec_with(steps=-5)) == ["steps: must be >= 1, got -5"]


def test_gt_constraint_message():
    assert errors_of(spec_with(failure={"abort_timeout_s": 0})) == [
        "failure.abort_timeout_s: must be > 0.0, got 0"
    ]


def test_le_constraint_message():
    assert errors_of(spec_with(metrics={"port": 70000})) == [
        "metrics.port: must be <= 65535, got 70000"
    ]


def test_unknown_top_level_field():
    assert errors_of(spec_with(bogus=1)) == ["bogus: unknown field"]


def test_unknown_nested_field():
    assert errors_of(spec_with(resources={"gpus": 1})) == ["resources.gpus: unknown field"]


def test_unknown_field_in_fault():
    fault = {"kind": "kill_worker", "rank": 0, "at_step": 1, "signal": 9}
    assert errors_of(spec_with(chaos={"faults": [fault]})) == [
        "chaos.faults.0.signal: unknown field"
    ]


def test_missing_required_fields():
    assert errors_of({}) == [
        "name: required field is missing",
        "entrypoint: required field is missing",
        "workers: required field is missing",
        "steps: required field is missing",
    ]


def test_missing_field_in_fault_has_no_discriminator_tag_in_path():
    errs = errors_of(spec_with(chaos={"faults": [{"kind": "kill_worker", "rank": 0}]}))
    assert errs == ["chaos.faults.0.at_step: required field is missing"]


def test_several_errors_reported_at_once():
    errs = errors_of(spec_with(workers=0, steps=0, bogus=True))
    assert sorted(errs) == sorted(
        ["workers: must be >= 1, got 0", "steps: must be >= 1, got 0", "bogus: unknown field"]
    )


def test_wrong_type_string_for_int():
    (err,) = errors_of(spec_with(workers="many"))
    assert err.startswith("workers: ")
    assert "integer" in err
    assert err.endswith('got "many"')


def test_wrong_type_fractional_int():
    (err,) = errors_of(spec_with(steps=1.5))
    assert err.startswith("steps: ")
    assert "integer" in err
    assert err.endswith("got 1.5")


def test_wrong_type_mapping_expected():
    (err,) = errors_of(spec_with(config=[1, 2]))
    assert err.startswith("config: ")
    assert "dictionary" in err
    assert "[1, 2]" in err


def test_wrong_type_nested_section():
    (err,) = errors_of(spec_with(checkpoint=5))
    assert err.startswith("checkpoint: ")


def test_bad_literal():
    (err,) = errors_of(spec_with(placement="STRICT"))
    assert err.startswith("placement: ")
    assert "'PACK' or 'SPREAD'" in err
    assert err.endswith('got "STRICT"')


def test_bad_name_pattern():
    (err,) = errors_of(spec_with(name="Bad_Name"))
    assert err.startswith("name: ")
    assert '"Bad_Name"' in err


def test_negative_resources():
    assert errors_of(spec_with(resources={"gpu": -1})) == ["resources.gpu: must be >= 0.0, got -1"]


@pytest.mark.parametrize(
    "entrypoint",
    [
        "nocolon",
        "pkg.mod:",
        ":fn",
        "pkg:mod:fn",
        "pkg.mod:1fn",
        "pkg.mod:fn-name",
        "1pkg:fn",
        "pkg mod:fn",
        "",
    ],
)
def test_bad_entrypoint_forms(entrypoint):
    assert errors_of(spec_with(entrypoint=entrypoint)) == [
        "entrypoint: expected 'package.module:function' or 'path/to/file.py:function', "
        f"got {entrypoint!r}"
    ]


@pytest.mark.parametrize("entrypoint", ["pkg.:fn", "pkg..mod:fn", "pkg.mod.:fn"])
def test_entrypoint_module_path_with_empty_component_is_rejected(entrypoint):
    # 'pkg.:fn' can never be imported; the spec is supposed to catch it at the edge rather
    # than after Ray has placed the workers.
    (err,) = errors_of(spec_with(entrypoint=entrypoint))
    assert err.startswith("entrypoint: expected")


def test_entrypoint_wrong_type():
    (err,) = errors_of(spec_with(entrypoint=5))
    assert err.startswith("entrypoint: ")


def test_fault_rank_must_be_below_workers():
    fault = {"kind": "kill_worker", "rank": 4, "at_step": 10}
    assert errors_of(spec_with(chaos={"faults": [fault]})) == [
        "chaos.faults.0.rank: must be < workers (4), got 4"
    ]


def test_fault_at_step_must_be_below_steps():
    ok = {"kind": "kill_worker", "rank": 0, "at_step": 1}
    bad = {"kind": "kill_worker", "rank": 1, "at_step": 100}
    assert errors_of(spec_with(chaos={"faults": [ok, bad]})) == [
        "chaos.faults.1.at_step: must be < steps (100), got 100"
    ]


def test_fault_last_legal_values_accepted():
    fault = {"kind": "kill_worker", "rank": 3, "at_step": 99}
    assert validate(spec_with(chaos={"faults": [fault]})).chaos.faults[0].rank == 3


def test_fault_negative_rank():
    fault = {"kind": "kill_worker", "rank": -1, "at_step": 0}
    assert errors_of(spec_with(chaos={"faults": [fault]})) == [
        "chaos.faults.0.rank: must be >= 0, got -1"
    ]


def test_unknown_fault_kind():
    fault = {"kind": "flip_bits", "rank": 0, "at_step": 1}
    (err,) = errors_of(spec_with(chaos={"faults": [fault]}))
    assert err.startswith("chaos.faults.0: ")
    assert "'flip_bits'" in err
    assert "'kill_worker'" in err


def test_fault_without_kind():
    (err,) = errors_of(spec_with(chaos={"faults": [{"rank": 0, "at_step": 1}]}))
    assert err.startswith("chaos.faults.0: ")
    assert "kind" in err


def test_top_level_not_a_mapping():
    assert errors_of([1, 2], "job.yaml") == ["expected a mapping at the top level, got list"]
    assert errors_of(None) == ["expected a mapping at the top level, got NoneType"]


def test_spec_error_str_joins_lines():
    err = SpecError("job.yaml", ["a: one", "b: two"])
    assert isinstance(err, ValueError)
    assert str(err) == "job.yaml: a: one; b: two"
    assert err.source == "job.yaml"
    assert err.errors == ["a: one", "b: two"]


# --- load_spec --------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_spec_from_yaml(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec_with(seed=7)))
    spec = load_spec(path)
    assert spec.seed == 7
    assert spec.name == "job"


def test_load_spec_accepts_str_path(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec_with()))
    assert load_spec(str(path)).workers == 4


def test_load_spec_validation_error_names_file(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec_with(checkpoint={"every_steps": 0})))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.source == str(path)
    assert info.value.errors == ["checkpoint.every_steps: must be >= 1, got 0"]
    assert str(info.value).startswith(f"{path}: ")


def test_load_spec_bad_yaml(tmp_path):
    path = write(tmp_path, "name: job\nworkers: [1, 2\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.source == str(path)
    (err,) = info.value.errors
    assert err.startswith("not valid YAML: ")


def test_load_spec_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.source == str(path)
    assert info.value.errors == ["cannot read: No such file or directory"]


def test_load_spec_directory_is_unreadable(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path)
    assert info.value.errors == ["cannot read: Is a directory"]


@pytest.mark.parametrize(
    ("text", "typename"),
    [("- 1\n- 2\n", "list"), ("just a string\n", "str"), ("", "an empty file"), ("42\n", "int")],
)
def test_load_spec_non_mapping_top_level(tmp_path, text, typename):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.errors == [f"expected a mapping at the top level, got {typename}"]


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", ""])
def test_load_spec_non_mapping_top_level_with_overrides(tmp_path, text):
    # `stalwart run job.yaml --set workers=2` on a file that is not a mapping must still be a
    # SpecError naming the file, not a TypeError/AttributeError from apply_overrides.
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["workers=2"])
    assert info.value.source in (str(path), "--set")


def test_load_spec_with_overrides(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec_with()))
    spec = load_spec(path, ["workers=2", "failure.max_restarts=null", "config.lr=0.5"])
    assert spec.workers == 2
    assert spec.failure.max_restarts is None
    assert spec.config == {"lr": 0.5}


def test_load_spec_override_makes_spec_invalid(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec_with()))
    with pytest.raises(SpecError) as info:
        load_spec(path, ["checkpoint.every_steps=0"])
    assert info.value.source == str(path)
    assert info.value.errors == ["checkpoint.every_steps: must be >= 1, got 0"]


def test_quickstart_example_validates():
    spec = load_spec(QUICKSTART)
    assert spec.name == "quickstart"
    assert spec.workers == 4
    assert [(f.kind, f.rank, f.at_step) for f in spec.chaos.faults] == [("kill_worker", 1, 60)]


def test_quickstart_single_worker_needs_faults_cleared():
    with pytest.raises(SpecError) as info:
        load_spec(QUICKSTART, ["workers=1"])
    assert info.value.errors == ["chaos.faults.0.rank: must be < workers (1), got 1"]
    spec = load_spec(QUICKSTART, ["workers=1", "chaos.faults=[]"])
    assert spec.workers == 1
    assert spec.chaos.faults == []


# --- parse_override / apply_overrides --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("workers=8", ["workers"], 8),
        ("failure.max_restarts=null", ["failure", "max_restarts"], None),
        ("chaos.faults=[]", ["chaos", "faults"], []),
        (
            "chaos.faults=[{kind: kill_worker, rank: 2, at_step: 30}]",
            ["chaos", "faults"],
            [{"kind": "kill_worker", "rank": 2, "at_step": 30}],
        ),
        ("config.lr=0.003", ["config", "lr"], 0.003),
        ("config.flag=true", ["config", "flag"], True),
        ("name=my-job", ["name"], "my-job"),
        ("name=", ["name"], ""),
        ("config.expr=a=b", ["config", "expr"], "a=b"),
        ("config.text='007'", ["config", "text"], "007"),
        ("config.model={d_model: 256}", ["config", "model"], {"d_model": 256}),
    ],
)
def test_parse_override_values_are_yaml(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["workers", "=3", "a..b=1", ".a=1", "a.=1", ""])
def test_parse_override_malformed(text):
    with pytest.raises(SpecError) as info:
        parse_override(text)
    assert info.value.source == "--set"
    assert info.value.errors == [f"expected key.path=value, got {text!r}"]


def test_parse_override_bad_yaml_value():
    with pytest.raises(SpecError) as info:
        parse_override("config.x=[1, 2")
    assert info.value.source == "--set"
    (err,) = info.value.errors
    assert err.startswith("config.x: value is not valid YAML: ")


def test_apply_overrides_sets_and_returns_same_dict():
    data = spec_with()
    out = apply_overrides(data, ["workers=2", "steps=50"])
    assert out is data
    assert data["workers"] == 2
    assert data["steps"] == 50


def test_apply_overrides_replace_faults():
    data = load_yaml(QUICKSTART)
    apply_overrides(data, ["chaos.faults=[{kind: kill_worker, rank: 2, at_step: 30}]"])
    spec = validate(data)
    assert [(f.rank, f.at_step) for f in spec.chaos.faults] == [(2, 30)]


def test_apply_overrides_clear_faults():
    data = load_yaml(QUICKSTART)
    apply_overrides(data, ["chaos.faults=[]"])
    assert validate(data).chaos.faults == []


def test_apply_overrides_unlimited_restarts():
    data = load_yaml(QUICKSTART)
    apply_overrides(data, ["failure.max_restarts=null"])
    assert data["failure"]["max_restarts"] is None
    assert validate(data).failure.max_restarts is None


def test_apply_overrides_creates_nested_mappings():
    data = spec_with()
    apply_overrides(data, ["config.model.d_model=256", "failure.user_error_retries=2"])
    assert data["config"] == {"model": {"d_model": 256}}
    assert data["failure"] == {"user_error_retries": 2}
    spec = validate(data)
    assert spec.config["model"]["d_model"] == 256
    assert spec.failure.user_error_retries == 2
    assert spec.failure.max_restarts == 10  # untouched default


def test_apply_overrides_replaces_null_section():
    data = spec_with(failure=None)
    apply_overrides(data, ["failure.max_restarts=1"])
    assert data["failure"] == {"max_restarts": 1}


def test_apply_overrides_keeps_siblings():
    data = spec_with(failure={"max_restarts": 3, "user_error_retries": 1})
    apply_overrides(data, ["failure.max_restarts=5"])
    assert data["failure"] == {"max_restarts": 5, "user_error_retries": 1}


def test_apply_overrides_later_wins():
    data = spec_with()
    apply_overrides(data, ["workers=2", "workers=3"])
    assert data["workers"] == 3


def test_apply_overrides_under_scalar_is_clear_error():
    data = spec_with()
    with pytest.raises(SpecError) as info:
        apply_overrides(data, ["workers.count=3"])
    assert info.value.source == "--set"
    assert info.value.errors == ["workers: is not a mapping, cannot set workers.count"]


def test_apply_overrides_under_list_is_clear_error():
    data = load_yaml(QUICKSTART)
    with pytest.raises(SpecError) as info:
        apply_overrides(data, ["chaos.faults.0.rank=2"])
    assert info.value.errors == ["chaos.faults: is not a mapping, cannot set chaos.faults.0.rank"]


def test_apply_overrides_deep_non_mapping_names_prefix():
    data = spec_with(config={"model": "tiny"})
    with pytest.raises(SpecError) as info:
        apply_overrides(data, ["config.model.d_model=3"])
    assert info.value.errors == ["config.model: is not a mapping, cannot set config.model.d_model"]


def test_apply_overrides_malformed_text():
    with pytest.raises(SpecError) as info:
        apply_overrides(spec_with(), ["workers:3"])
    assert info.value.errors == ["expected key.path=value, got 'workers:3'"]


# --- JSON schema ------------------------------------------------------------------------------

TOP_LEVEL = [
    "name",
    "entrypoint",
    "workers",
    "resources",
    "placement",
    "backend",
    "steps",
    "seed",
    "checkpoint",
    "failure",
    "health",
    "metrics",
    "chaos",
    "config",
    "output_dir",
    "runtime_env",
]


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_json_schema_shape():
    schema = json_schema()
    json.loads(json.dumps(schema))  # JSON-serialisable
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "stalwart job spec"
    assert schema["type"] == "object"
    assert set(schema["properties"]) == set(TOP_LEVEL)
    assert set(schema["required"]) == {"name", "entrypoint", "workers", "steps"}
    assert schema["additionalProperties"] is False
    count, rng = schema["properties"]["workers"]["oneOf"]
    assert count["minimum"] == 1
    assert rng["$ref"].endswith("WorkerRange")


def test_json_schema_is_valid_and_accepts_quickstart():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(load_yaml(QUICKSTART))) == []


def test_json_schema_rejects_what_validate_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    for bad in (
        spec_with(workers=0),
        spec_with(bogus=1),
        spec_with(checkpoint={"every_steps": 0}),
        spec_with(chaos={"faults": [{"kind": "flip_bits", "rank": 0, "at_step": 1}]}),
        {k: v for k, v in BASE.items() if k != "steps"},
    ):
        assert list(validator.iter_errors(bad)), bad


def test_a_worker_must_ask_for_something():
    from stalwart.orchestrator.spec import SpecError, validate

    data = {
        "name": "x",
        "entrypoint": "a.b:c",
        "workers": 1,
        "steps": 1,
        "resources": {"cpu": 0, "gpu": 0},
    }
    try:
        validate(data)
    except SpecError as e:
        assert e.errors == ["resources: a worker must ask for some cpu, gpu or custom resource"]
    else:
        raise AssertionError("accepted a worker that asks for nothing")


# --- reading the YAML: bytes, duplicate keys, huge integers, stdin (orchestrator/spec_yaml.py) --

MINIMAL = "name: job\nentrypoint: pkg.mod:train\nworkers: 4\nsteps: 100\n"


def test_a_byte_that_is_not_utf8_is_named_with_its_offset_and_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(MINIMAL.encode() + b"config: {note: caf\xe9}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.source == str(path)
    offset = len(MINIMAL) + len("config: {note: caf")
    assert info.value.errors == [
        f"not UTF-8 text: byte 0xe9 at offset {offset} (line 5, column 19); save the file as UTF-8"
    ]


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + MINIMAL.encode())
    assert load_spec(path).name == "job"


def test_duplicate_keys_are_named_with_their_path_and_lines(tmp_path):
    text = MINIMAL + (
        "steps: 200\n"
        "checkpoint:\n  persist: {uri: /a, uri: /b}\n"
        "chaos:\n  faults:\n    - {kind: kill_worker, rank: 1, rank: 2, at_step: 5}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    assert info.value.errors == [
        "steps: duplicate key at line 5 (first at line 4); YAML would keep only the last value",
        "checkpoint.persist.uri: duplicate key at line 7 (first at line 7); YAML would keep "
        "only the last value",
        "chaos.faults.0.rank: duplicate key at line 10 (first at line 10); YAML would keep "
        "only the last value",
    ]


def test_merge_keys_and_anchors_still_load(tmp_path):
    text = MINIMAL + "config:\n  base: &b {lr: 0.1, wd: 0}\n  run: {<<: *b, lr: 0.2}\n"
    spec = load_spec(write(tmp_path, text))
    assert spec.config["run"] == {"lr": 0.2, "wd": 0}


def test_a_duplicate_key_in_a_set_value_is_refused():
    with pytest.raises(SpecError) as info:
        parse_override("config.x={a: 1, a: 2}")
    assert info.value.source == "--set"
    assert info.value.errors[0].startswith("config.x.a: duplicate key at line 1")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 10**29, "steps: must be <= 1000000000000, got 100000000000000000000000000000"),
        ("workers", 400_000, "workers: must be <= 100000, got 400000"),
        ("workers", {"min": 1, "max": 10**6}, "workers.max: must be <= 100000, got 1000000"),
        ("failure", {"spares": 10**9}, "failure.spares: must be <= 100000, got 1000000000"),
        (
            "checkpoint",
            {"every_steps": 10**13},
            "checkpoint.every_steps: must be <= 1000000000000, got 10000000000000",
        ),
    ],
)
def test_counts_have_upper_bounds(field, value, message):
    assert message in errors_of(spec_with(**{field: value}))


def test_an_integer_beyond_int64_is_refused_wherever_it_is():
    errors = errors_of(spec_with(seed=2**63, config={"sizes": [1, -(2**64)]}))
    assert errors == [
        "seed: 9223372036854775808 is too large (integers must fit in 64 bits, at most "
        "9223372036854775807)",
        "config.sizes.1: -18446744073709551616 is too large (integers must fit in 64 bits, at "
        "most 9223372036854775807)",
    ]
    assert validate(spec_with(seed=2**63 - 1)).seed == 2**63 - 1


def test_a_huge_integer_is_shown_by_its_size(tmp_path):
    (err,) = errors_of(spec_with(steps=10**5000))
    assert err == "steps: must be <= 1000000000000, got an integer of about 5001 digits"
    path = write(tmp_path, MINIMAL + "config: {x: " + "9" * 5000 + "}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.errors == [
        "config.x: a 5000-digit integer at line 5 is too large (integers must fit in 64 bits, "
        "at most 9223372036854775807)"
    ]


def test_load_spec_reads_stdin_for_dash(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MINIMAL.encode())))
    assert load_spec("-", ["steps=7"]).steps == 7
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"name: [")))
    with pytest.raises(SpecError) as info:
        load_spec("-")
    assert info.value.source == "<stdin>"
    assert info.value.errors[0].startswith("not valid YAML: ")

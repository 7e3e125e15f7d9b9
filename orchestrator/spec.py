"""Job spec: the YAML a user writes, validated once at the edge.

Every error names the field path and what was expected, e.g.
``checkpoint.every_steps: must be >= 1, got 0``. Nothing past this module
sees an unvalidated spec.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
)

from stalwart.orchestrator.spec_checkpoint import (  # noqa: F401 (re-exported)
    MAX_COUNT,
    MAX_STEPS,
    MAX_WORKERS,
    CheckpointSpec,
    PersistSpec,
)
from stalwart.orchestrator.spec_faults import (  # noqa: F401 (re-exported)
    COLLECTIVE_FAULTS,
    PEER_FAULTS,
    ChaosSpec,
    CorruptShard,
    DropReplicas,
    Fault,
    FillShm,
    GpuXid,
    Hang,
    KillNode,
    KillSupervisor,
    KillWorker,
    NanLoss,
    Slow,
    StorageUnavailable,
    _Model,
)
from stalwart.orchestrator.spec_health import (  # noqa: F401 (re-exported)
    GpuSpec,
    HangSpec,
    HealthSpec,
    LossGuardSpec,
    PreflightSpec,
    StragglerSpec,
)
from stalwart.orchestrator.spec_yaml import (
    STDIN,
    SpecError,
    int_text,
    load_yaml,
    oversized_ints,
    read_yaml,
)

ENTRYPOINT_RE = re.compile(
    r"^(?P<target>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*|[^:]+\.py):(?P<func>[A-Za-z_]\w*)$",
)


# Upper bounds of the spec's counts: far above any real job, low enough that a typo (an
# extra few zeros) is an error rather than a job that never ends or asks for a million
# processes. Any integer beyond int64 is refused wherever it is (spec_yaml.oversized_ints).


class Resources(_Model):
    """What one worker asks of Ray."""

    cpu: float = Field(1.0, ge=0, description="CPUs per worker")
    gpu: float = Field(0.0, ge=0, description="GPUs per worker")
    custom: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per worker"
    )
    start_method: Literal["fork", "spawn"] | None = Field(
        None,
        description="how a worker's process starts: fork (from a process per node that "
        "imported torch once, orchestrator/worker/zygote.py: about half the CPU of a "
        "fresh start, which imports torch itself) or spawn (a fresh interpreter, as Ray "
        "starts any worker). null (the default): fork for CPU jobs, spawn "
        "for jobs with resources.gpu > 0. Jobs with a runtime_env (or submitted with "
        "one) always spawn: their workers' interpreter is the runtime_env's",
    )

    def forks(self) -> bool:
        """Whether workers start from the node's zygote (before the runtime_env's say)."""
        if self.start_method is None:
            return self.gpu == 0
        return self.start_method == "fork"


class FailureSpec(_Model):
    max_restarts: int | None = Field(
        10,
        ge=0,
        le=MAX_COUNT,
        description="recoveries allowed before the job fails; null = unlimited",
    )
    user_error_retries: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="times an exception raised by the train loop is retried from the last "
        "checkpoint before the job fails (replays are deterministic, so 0 fails fast)",
    )
    spares: int = Field(
        0,
        ge=0,
        le=MAX_WORKERS,
        description="idle workers kept started (torch imported, entrypoint loaded) that take "
        "a lost rank's place without starting a process",
    )
    standby: bool | None = Field(
        None,
        description="keep idle worker processes (failure.standbys_per_node) on each node "
        "that holds ranks or a spare, started in advance (torch imported) but holding no "
        "Ray resources: a rank lost when no spare is ready moves into it (in its own slot, "
        "or a new slot on a standby's node) instead of starting a process; costs ~0.4 GB "
        "of host memory per standby. null (the default): on for CPU jobs when every node "
        "holding ranks has the memory for one beside the checkpoints and its machine a core "
        "the ranks leave idle, with the decision in the job's events. Not used for jobs "
        "with resources.gpu > 0: a process started without a GPU grant cannot be handed one "
        "later (failure.spares are their warm processes)",
    )
    standbys_per_node: int = Field(
        2,
        ge=1,
        le=8,
        description="the most standbys kept on each node when they are on (failure.standby): "
        "with 2 a second fault on the same node, before the first one's standby is started "
        "again (5-10 s on a busy node), still finds one ready. Left to decide, a node gets "
        "only as many as fit in its memory beside the checkpoints (at least one, else none); "
        "the first of each node's start with the ranks, the others once the job has trained",
    )
    abort_timeout_s: float = Field(
        10.0, gt=0, description="how long survivors get to leave their train loop on recovery"
    )
    rendezvous_timeout_s: float = Field(
        120.0, gt=0, description="how long ranks wait for each other to form a process group"
    )
    scheduling_timeout_s: float = Field(
        120.0, gt=0, description="how long to wait for Ray to place the workers"
    )
    replacement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long a lost rank's replacement may wait for capacity on a healthy "
        "node before the job fails",
    )
    restore_timeout_s: float = Field(
        120.0,
        gt=0,
        description="a rank's fetch of its shard from a node's memory fails after this "
        "long (the source died or stalls): the recovery restores from the next source",
    )
    supervisor_restarts: int = Field(
        2,
        ge=0,
        le=MAX_COUNT,
        description="times the driver restarts a dead supervisor, which takes the job back "
        "from the node agents' memory (or durable storage)",
    )


class MetricsSpec(_Model):
    host: str = Field("127.0.0.1", description="exporter bind address")
    port: int = Field(0, ge=0, le=65535, description="exporter port; 0 picks a free one")
    linger_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="keep serving the final values this long after the job ends, so a "
        "Prometheus scraping every N s sees the end state (set it above the scrape interval)",
    )
    file_sd_dir: str | None = Field(
        None,
        description="a folder on the head node that Prometheus reads with file_sd_configs "
        "(dashboards/prometheus/scrape.yml): the job's supervisor writes its exporter's "
        "target there as stalwart-NAME.json and removes it when the job ends",
    )


class WorkerRange(_Model):
    """An elastic world: start with `max` ranks, continue with no fewer than `min`."""

    min: StrictInt = Field(
        ge=1, le=MAX_WORKERS, description="fewest data-parallel ranks to continue with"
    )
    max: StrictInt = Field(ge=1, le=MAX_WORKERS, description="ranks to start with and grow back to")
    multiple_of: StrictInt = Field(
        1,
        ge=1,
        le=MAX_WORKERS,
        description="the world size stays a multiple of this (HSDP: the shard dimension's "
        "size, so that the mesh (world // shard, shard) fits every world): a shrink drops "
        "down to the next multiple, a grow adds whole multiples",
    )

    def model_post_init(self, _ctx: Any) -> None:
        if self.min > self.max:
            raise ValueError(f"workers.min: must be <= workers.max ({self.max}), got {self.min}")
        for key in ("min", "max"):
            value = getattr(self, key)
            if value % self.multiple_of:
                raise ValueError(
                    f"workers.{key}: must be a multiple of workers.multiple_of "
                    f"({self.multiple_of}), got {value}"
                )


def _workers_form(value: Any) -> str:
    return "range" if isinstance(value, dict | WorkerRange) else "count"


class JobSpec(_Model):
    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="job name: lower-case letters, digits and '-'",
    )
    entrypoint: str = Field(
        description="'package.module:function' or 'path/to/file.py:function'; "
        "the function takes the train context"
    )
    workers: Annotated[
        Annotated[Annotated[StrictInt, Field(ge=1, le=MAX_WORKERS)], Tag("count")]
        | Annotated[WorkerRange, Tag("range")],
        Discriminator(_workers_form),
    ] = Field(
        description="number of training ranks, or {min, max}: start with max and, when a "
        "lost rank cannot be replaced within failure.replacement_timeout_s, continue with "
        "fewer (not below min), growing back when capacity returns"
    )
    resources: Resources = Field(default_factory=Resources)
    placement: Literal["PACK", "SPREAD"] = "PACK"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    steps: StrictInt = Field(ge=1, le=MAX_STEPS, description="total training steps")
    seed: int = 0
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    chaos: ChaosSpec = Field(default_factory=ChaosSpec)
    config: dict[str, Any] = Field(
        default_factory=dict, description="free-form settings handed to the train loop"
    )
    output_dir: str | None = Field(
        None,
        description="where the loop saves what it keeps (ctx.output_dir, e.g. the final "
        "model from rank 0): a path every node can write, or an fsspec URL; default: "
        "RUN_DIR/output when the cluster is this machine, else under checkpoint.persist.uri",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="passed to Ray as the workers' runtime_env"
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not ENTRYPOINT_RE.match(v):
            raise ValueError(
                f"expected 'package.module:function' or 'path/to/file.py:function', got {v!r}"
            )
        return v

    @property
    def max_workers(self) -> int:
        """The world size the job starts with (and grows back to)."""
        return self.workers.max if isinstance(self.workers, WorkerRange) else self.workers

    @property
    def min_workers(self) -> int:
        return self.workers.min if isinstance(self.workers, WorkerRange) else self.workers

    @property
    def world_multiple(self) -> int:
        """What every world size of the job is a multiple of (workers.multiple_of)."""
        return self.workers.multiple_of if isinstance(self.workers, WorkerRange) else 1

    def model_post_init(self, _ctx: Any) -> None:
        r = self.resources
        if self.backend == "nccl" and not r.gpu:
            raise ValueError("backend: nccl needs GPUs, but resources.gpu is 0")
        if not (r.cpu or r.gpu or any(r.custom.values())):
            raise ValueError("resources: a worker must ask for some cpu, gpu or custom resource")
        for i, fault in enumerate(self.chaos.faults):
            if fault.after_persist and not self.checkpoint.persist.uri:
                raise ValueError(
                    f"chaos.faults.{i}.after_persist: waits for a durable checkpoint, and "
                    "this job has none (set checkpoint.persist.uri)"
                )
            if fault.during == "persist" and (
                fault.kind != "kill_node" or not self.checkpoint.persist.uri
            ):
                raise ValueError(
                    f"chaos.faults.{i}.during: persist is for a kill_node of a job with "
                    f"checkpoint.persist.uri set (got {fault.kind}"
                    + ("" if self.checkpoint.persist.uri else ", and no persist.uri")
                    + ")"
                )
            if fault.during == "snapshot" and fault.kind != "kill_worker":
                raise ValueError(
                    f"chaos.faults.{i}.during: snapshot is for a kill_worker, not {fault.kind}"
                )
            if fault.in_collective is not None and (
                fault.kind not in COLLECTIVE_FAULTS or fault.during is not None
            ):
                raise ValueError(
                    f"chaos.faults.{i}.in_collective: only for "
                    f"{', '.join(COLLECTIVE_FAULTS)} without `during`, not {fault.kind}"
                    + (f" during {fault.during}" if fault.during else "")
                )
            if fault.peer_of_rank is not None and fault.kind not in PEER_FAULTS:
                raise ValueError(
                    f"chaos.faults.{i}.peer_of_rank: only for faults that hit a node "
                    f"({', '.join(PEER_FAULTS)}), not {fault.kind}"
                )
            if fault.rank >= self.max_workers:
                raise ValueError(
                    f"chaos.faults.{i}.rank: must be < workers ({self.max_workers}), "
                    f"got {fault.rank}"
                )
            if fault.at_step >= self.steps:
                raise ValueError(
                    f"chaos.faults.{i}.at_step: must be < steps ({self.steps}), got {fault.at_step}"
                )

    def resolved_backend(self, cuda_available: bool) -> str:
        """The backend a worker uses, given whether it sees CUDA (asked on the worker)."""
        if self.backend == "nccl" and not cuda_available:
            raise ValueError("backend: nccl needs CUDA, and this worker sees no CUDA device")
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.resources.gpu > 0 and cuda_available else "gloo"


def _format_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    # Discriminated unions add the tag to the path; users never wrote it.
    loc = re.sub(
        r"(faults\.\d+)\.(kill_worker|kill_node|kill_raylet|hang|slow|gpu_xid|drop_replicas|"
        r"storage_unavailable|kill_supervisor|corrupt_shard|fill_shm|nan_loss)\b",
        r"\1",
        loc,
    )
    loc = re.sub(r"^workers\.(count|range)\b", "workers", loc)
    msg = err["msg"]
    typ = err["type"]
    given = err.get("input")
    if typ == "extra_forbidden":
        return f"{loc}: unknown field"
    if typ == "missing":
        return f"{loc}: required field is missing"
    if typ == "value_error":
        text = msg.removeprefix("Value error, ")
        # model_post_init raises with its own field path.
        if re.match(r"^[\w.]+: ", text):
            return text
        return f"{loc}: {text}" if loc else text
    ctx = err.get("ctx") or {}
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            got = int_text(given) if type(given) is int else repr(given)
            return f"{loc}: must be {word} {ctx[key]}, got {got}"
    if type(given) is int:
        shown = int_text(given)
    elif isinstance(given, str | float | bool):
        shown = json.dumps(given)
    else:
        shown = repr(given)
    return f"{loc}: {msg[0].lower() + msg[1:]}, got {shown}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise SpecError("--set", [f"expected key.path=value, got {text!r}"])
    try:
        value = load_yaml(raw, "--set", prefix=key) if raw != "" else ""
    except SpecError as e:
        if e.errors[0].startswith("not valid YAML: "):
            raise SpecError("--set", [f"{key}: value is {e.errors[0]}"]) from None
        raise
    return key.split("."), value


def set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    """data[path[0]][path[1]]... = value, creating the mappings on the way."""
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise SpecError(
                "--set",
                [f"{'.'.join(path[: i + 1])}: is not a mapping, cannot set {'.'.join(path)}"],
            )
        node = child
    node[path[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        set_path(data, *parse_override(text))
    return data


def load_model(path: str | Path, model: type[BaseModel], overrides: list[str] = ()) -> Any:
    """A YAML file read, `overrides` (key.path=value) applied and checked as `model`:
    SpecError names the file and every bad field (chaos and simulation scenarios)."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise SpecError(str(path), [f"expected a mapping at the top level, got {got}"])
    data = apply_overrides(data, list(overrides))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(str(path), [_format_error(err) for err in e.errors()]) from None


def validate(data: Any, source: str = "<spec>") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(source, [f"expected a mapping at the top level, got {type(data).__name__}"])
    # An integer no field holds (steps: 10**29): named even where the model takes any value
    # (config, runtime_env), and before pydantic turns it into a float or a long repr.
    oversized = oversized_ints(data)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        errors = [_format_error(err) for err in e.errors()]
        named = {line.partition(": ")[0] for line in errors}
        errors += [line for where, line in oversized if where not in named]
        raise SpecError(source, errors) from None
    if oversized:
        raise SpecError(source, [line for _, line in oversized])
    return spec


def load_spec(path: str | Path, overrides: list[str] = ()) -> JobSpec:
    """The job spec in the YAML file `path` (`-`: standard input), with `--set` overrides."""
    source = STDIN if str(path) == "-" else str(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise SpecError(source, [f"expected a mapping at the top level, got {got}"])
    return validate(apply_overrides(data, list(overrides)), source)


def json_schema() -> dict[str, Any]:
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "stalwart job spec"
    return schema

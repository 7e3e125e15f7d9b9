"""The `checkpoint` section of a job spec: in-memory snapshots and their copies, durable
persistence, starting from another checkpoint (orchestrator/spec.py re-exports them)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt, field_validator, model_validator

from stalwart.ckpt.footprint import (
    LEAN_VERSIONS,
    VERSIONS,
    is_lean,
    parse_quantity,
    versions_for,
)
from stalwart.orchestrator.spec_faults import _Model

MAX_STEPS = 10**12
MAX_WORKERS = 100_000
MAX_COUNT = 1_000_000  # retries, restarts, roll backs, windows


class PersistSpec(_Model):
    """The durable tier: committed steps written to storage in the background."""

    uri: str | None = Field(
        None,
        description="where checkpoints go: a local path, file://, or an fsspec URL (s3://, "
        "gs://, ... with the matching fsspec backend installed); null: no durable tier",
    )
    every_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="persist a committed step at least this many steps apart",
    )
    every_seconds: float | None = Field(
        None,
        gt=0,
        description="persist a committed step at least this often (default 300 s when "
        "uri is set and every_steps is not)",
    )
    keep_last: int = Field(
        3, ge=1, le=MAX_COUNT, description="complete checkpoints kept on storage"
    )
    retries: int = Field(
        3, ge=0, le=MAX_COUNT, description="retries of a failed write, with backoff"
    )
    backoff_s: float = Field(0.5, ge=0, description="first retry's delay; doubles each time")

    @model_validator(mode="before")
    @classmethod
    def _default_interval(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("uri")
            and data.get("every_steps") is None
            and data.get("every_seconds") is None
        ):
            data = {**data, "every_seconds": 300.0}
        return data

    def model_post_init(self, _ctx: Any) -> None:
        if self.uri is not None and not self.uri.strip():
            raise ValueError("checkpoint.persist.uri: must not be empty (null: no durable tier)")
        if self.uri:
            from fsspec.registry import get_filesystem_class
            from fsspec.utils import get_protocol

            protocol = get_protocol(self.uri)
            try:
                get_filesystem_class(protocol)
            except (ValueError, ImportError) as e:
                raise ValueError(
                    f"checkpoint.persist.uri: no usable fsspec backend for {protocol}:// ({e})"
                ) from None


class CheckpointSpec(_Model):
    every_steps: int = Field(
        1, ge=1, le=MAX_STEPS, description="snapshot registered state every N steps"
    )
    replicas: int = Field(
        2,
        ge=1,
        le=MAX_WORKERS,
        description="copies of each shard kept in memory on distinct nodes (its own node's "
        "and replicas-1 peers', in groups: losing any replicas-1 nodes loses no shard); a "
        "step is committed once every shard has them",
    )
    max_lag_steps: int | None = Field(
        2,
        ge=0,
        le=MAX_STEPS,
        description="the newest committed step (every shard on `replicas` nodes) is never "
        "more than this many steps behind the newest snapshot: copies of every "
        "max_lag_steps-th step go to the peers, and when they fall behind (a slow link, a "
        "busy node) training waits for them at the next step boundary (metric "
        "stalwart_replication_wait_seconds_total, event replication_wait). A node lost "
        "after step k then costs at most max_lag_steps + 1 steps; 0: every step is copied "
        "before the next begins. null: no bound, copies thinned by replication_duty alone "
        "(they may lag by seconds)",
    )
    replication_duty: float = Field(
        0.1,
        gt=0,
        le=1,
        description="with max_lag_steps null: the share of the time a node may spend sending "
        "copies to its peers: copies are thinned to every k-th snapshot so one round of sends "
        "(measured) fits it; the committed step then lags more (event replication_stride "
        "says by how much)",
    )
    persist: PersistSpec = Field(default_factory=PersistSpec)
    init_from: str | None = Field(
        None,
        min_length=1,
        description="start the job from this DCP checkpoint directory (a local path or an "
        "fsspec URL: another job's dcp.save, a torchtitan step, a stalwart step directory): "
        "every registered object the checkpoint holds state for under its name (model, "
        "optimizer, ...) is loaded at the job's start, resharded to the job's layout, and "
        "training goes on from its top-level `step` (0 without one). Read only, never "
        "written; a resume from the job's own checkpoints (checkpoint.persist) comes first",
    )
    memory_budget: int | None = Field(
        None,
        ge=2,
        le=MAX_WORKERS,
        description="the versions of one rank's state the job may keep in host memory, its "
        "own and the copies together (the budget is this times the state per rank): at "
        "least 2 x replicas. null: 6 of each (12 at replicas 2), the fastest. Under 6 x "
        "replicas every node keeps 2 of each, the newest commit and the one being written, "
        "and each step is copied before the next (max_lag_steps 0): training waits for the "
        'copies, a node loss costs at most 1 step (docs/checkpoints.md, "Host memory")',
    )
    state_size_per_rank: StrictInt | str | None = Field(  # bytes, once validated
        None,
        description="one rank's state as a snapshot holds it (model, optimizer, RNG states), "
        "a memory quantity (12Gi, 512Mi, bytes): with it, each node's free memory and "
        "/dev/shm are checked before the workers start, against the versions of the state "
        'its ranks and copies keep (docs/checkpoints.md, "Host memory"); a job that '
        "would not fit is refused with the sum, as the Helm chart gives it",
    )
    shm_dir: str = Field(
        "/dev/shm/stalwart",
        description="where each node keeps its in-memory checkpoints as shared-memory files "
        "(a memory-backed file system: /dev/shm, a Kubernetes emptyDir with medium Memory); "
        "when it is missing, too small or full, the node keeps them in its agent's memory",
    )

    @property
    def versions(self) -> int:
        """The versions of each rank's state a node keeps, own and per copy."""
        return versions_for(self.memory_budget, self.replicas)

    @property
    def lean(self) -> bool:
        """memory_budget takes the lean rule: 2 versions of each (ckpt/footprint.py)."""
        return is_lean(self.memory_budget, self.replicas)

    @model_validator(mode="before")
    @classmethod
    def _lean_lag(cls, data: Any) -> Any:
        """A lean budget copies every step before the next: max_lag_steps 0 unless given."""
        if isinstance(data, dict) and "max_lag_steps" not in data:
            budget, replicas = data.get("memory_budget"), data.get("replicas", 2)
            known = isinstance(budget, int) and isinstance(replicas, int)
            if known and is_lean(budget, replicas):
                data = {**data, "max_lag_steps": 0}
        return data

    @model_validator(mode="after")
    def _budget(self) -> CheckpointSpec:
        budget = self.memory_budget
        if budget is None:
            return self
        least = LEAN_VERSIONS * self.replicas
        if budget < least:
            raise ValueError(
                f"checkpoint.memory_budget: {budget} versions cannot hold {LEAN_VERSIONS} of "
                f"each of checkpoint.replicas={self.replicas} (at least {least})"
            )
        if not self.lean:
            return self
        if self.max_lag_steps != 0:
            raise ValueError(
                f"checkpoint.memory_budget: {budget} (under {VERSIONS} x replicas) keeps "
                f"{LEAN_VERSIONS} versions, which needs every step copied before the next: "
                f"checkpoint.max_lag_steps must be 0 (or left out), not {self.max_lag_steps}"
            )
        if self.persist.uri:
            raise ValueError(
                f"checkpoint.memory_budget: {budget} (under {VERSIONS} x replicas) cannot "
                "be used with checkpoint.persist yet: the step being persisted would hold "
                'one of the 2 versions (docs/checkpoints.md, "Host memory")'
            )
        return self

    @field_validator("state_size_per_rank")
    @classmethod
    def _quantity(cls, v: int | str | None) -> int | None:
        if v is None:
            return None
        nbytes = parse_quantity(v)
        if nbytes <= 0:
            raise ValueError("must be more than 0 bytes")
        return nbytes

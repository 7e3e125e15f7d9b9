"""A chaos scenario (YAML): the job, the faults to inject into it, the cluster to run it on and
what must hold afterwards.

    name: kill-worker
    job:
      spec: ../quickstart.yaml        # relative to this file
      set: ["steps=120"]               # --set overrides
    cluster: {worker_nodes: 3, cpus_per_node: 2}   # optional: a local multi-node Ray
    seed: 1                            # for `rank: random`
    faults:
      - {kind: kill_worker, rank: 1, at_step: 30}
      - {kind: kill_node, rank: random, at_step: 60, after_commit: true}
    expect:
      finishes: true
      digest_equals_baseline: true
      max_steps_lost_per_failure: 1
      max_recovery_seconds: {kill_worker: 10, default: 30}
      alerts: [StalwartRestartBudgetLow]   # checked when --prometheus URL is given

A fault is a job spec fault (orchestrator/spec.py: its kind's fields, validated there) whose
`rank` may be `random` (drawn with the scenario's seed), or a fault of the network
(partition, loss, delay, flap: orchestrator/chaos/network.py), which `stalwart chaos run`
carries out from outside the job on a cluster with `network: netns`, or of Ray itself
(restart_gcs: orchestrator/chaos/ray_faults.py), carried out on the local cluster it starts.
The job spec's own faults are replaced by the scenario's; the baseline runs the same spec
with none.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from stalwart.orchestrator.chaos import network, ray_faults
from stalwart.orchestrator.spec import (
    JobSpec,
    SpecError,
    _format_error,
    apply_overrides,
    load_model,
    read_yaml,
    validate,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobRef(_Model):
    spec: str = Field(description="the job spec file, relative to the scenario file")
    set: list[str] = Field(default_factory=list, description="--set overrides, key.path=value")


class Cluster(_Model):
    """Where the scenario runs when no --address is given: with `worker_nodes` 0 an
    embedded one-node Ray, else a local multi-node Ray the command starts (a CPU-less head
    for the supervisor, `worker_nodes` raylets of `cpus_per_node` CPUs) and stops."""

    worker_nodes: StrictInt = Field(0, ge=0, le=16)
    cpus_per_node: StrictInt = Field(2, ge=1)
    network: Literal["loopback", "netns"] = Field(
        "loopback",
        description="netns: each worker node in a network namespace of its own, wired to "
        "the head by a bridge (orchestrator/chaos/netns.py; root, iproute2 and nftables), "
        "for the network faults (partition, loss, delay, flap); loopback: the nodes share "
        "this machine's network",
    )
    gcs_ft: bool = Field(
        False,
        description="keep the head's GCS tables in a Redis the command starts on loopback "
        "(Debian's redis-server), as the Helm chart's gcsFaultTolerance does: a restarted "
        "GCS (the restart_gcs fault) comes back with the cluster's state",
    )
    shm_bytes: StrictInt | None = Field(
        None,
        ge=16 << 20,
        le=4 << 30,
        description="give the job a memory file system of this size for its checkpoints "
        "(a tmpfs the command mounts and removes: needs root), as a container's small "
        "/dev/shm would be; for the fill_shm fault",
    )


class Expect(_Model):
    finishes: bool = Field(True, description="the chaos run ends with status succeeded")
    digest_equals_baseline: bool = Field(
        True, description="its model digest is the failure-free run's, bit for bit"
    )
    max_steps_lost_per_failure: StrictInt | None = Field(
        None, ge=0, description="steps redone after any one failure, at most"
    )
    max_recovery_seconds: dict[str, float] = Field(
        default_factory=dict,
        description="fault kind (or `default`) -> seconds from the failure to every rank's "
        "next step, at most",
    )
    alerts: list[str] = Field(
        default_factory=list,
        description="alerts that must fire for this job (needs --prometheus URL)",
    )
    alerts_within_s: float = Field(
        120.0, gt=0, description="how long after the job ends an expected alert may take"
    )
    memory_flat: bool = Field(
        False,
        description="the memory the nodes hold for checkpoints stays flat after the last "
        "fault (its peak in the run's last half at most 1.25x that of the half before)",
    )
    max_failures: StrictInt | None = Field(
        None,
        ge=0,
        description="failures of the job (every rank's, every kind) at most: 0 for a fault "
        "the job must ride out without a recovery (a short partition, a lossy link)",
    )
    from_scratch_ok: bool = Field(
        False,
        description="a recovery may restart the job from step 0 (no restore point): by "
        "default that fails the verdict",
    )


class TimedFault(NamedTuple):
    after_s: float  # seconds after the job started training
    fault: dict[str, Any]  # a live fault: kind, rank, the kind's fields


class Scenario(_Model):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
    description: str = ""
    job: JobRef
    cluster: Cluster = Field(default_factory=Cluster)
    seed: int = 0
    faults: list[dict[str, Any]] = Field(min_length=1)
    expect: Expect = Field(default_factory=Expect)
    source: Path | None = Field(None, exclude=True)  # the file it was read from

    @model_validator(mode="after")
    def _ray_faults_need_their_cluster(self) -> Scenario:
        for i, f in enumerate(self.faults):
            if not ray_faults.is_ray_fault(f):
                continue
            _checked(i, ray_faults.parse, f)
            if self.cluster.network != "loopback" or self.cluster.worker_nodes < 1:
                raise ValueError(
                    f"faults.{i}: a {f['kind']} fault needs the local cluster the command "
                    "starts: cluster: {worker_nodes: N} (network: loopback)"
                )
            if not self.cluster.gcs_ft and len(self.faults) > 1:
                raise ValueError(
                    f"faults.{i}: without cluster.gcs_ft a {f['kind']} loses the whole "
                    "cluster (the job resumes on a new one): it is the scenario's only fault"
                )
            if not self.cluster.gcs_ft and (self.cluster.shm_bytes or self.expect.alerts):
                raise ValueError(
                    f"faults.{i}: without cluster.gcs_ft a {f['kind']} runs the job twice, on "
                    "two clusters: cluster.shm_bytes and expect.alerts are not carried over"
                )
        return self

    @model_validator(mode="after")
    def _network_faults_need_their_cluster(self) -> Scenario:
        for i, f in enumerate(self.faults):
            if not network.is_network(f):
                continue
            _checked(i, network.parse, f)
            if self.cluster.network != "netns" or self.cluster.worker_nodes < 1:
                raise ValueError(
                    f"faults.{i}: a {f['kind']} fault needs worker nodes with networks of "
                    "their own: cluster: {network: netns, worker_nodes: N}"
                )
            named = [("node", f.get("node"))]
            named += [(f"nodes.{j}", n) for j, n in enumerate(f.get("nodes") or [])]
            named += [(f"from.{j}", n) for j, n in enumerate(f.get("from") or [])]
            for where, peer in named:
                if isinstance(peer, int) and peer > self.cluster.worker_nodes:
                    raise ValueError(
                        f"faults.{i}.{where}: must be <= cluster.worker_nodes "
                        f"({self.cluster.worker_nodes}), got {peer}"
                    )
        return self

    def network_faults(self, workers: int) -> list[network.NetFault]:
        """The scenario's faults of the network (orchestrator/chaos/network.py), with a
        `rank: random` drawn from the scenario's seed."""
        rng = random.Random(self.seed + 1)  # their own draws: the job's faults keep theirs
        out = []
        for f in self.faults:
            if network.is_network(f):
                f = dict(f)
                if f.get("rank") == "random":
                    f["rank"] = rng.randrange(workers)
                out.append(network.parse(f))
        return out

    def ray_faults(self) -> list[ray_faults.RestartGcs]:
        """The scenario's faults of Ray itself (orchestrator/chaos/ray_faults.py)."""
        return [ray_faults.parse(f) for f in self.faults if ray_faults.is_ray_fault(f)]

    def resolved_faults(self, workers: int) -> list[dict[str, Any]]:
        """The faults fired at a step, as job spec faults: `rank: random` drawn and
        `probability` decided (seeded)."""
        return self.resolved(workers)[0]

    def resolved(self, workers: int) -> tuple[list[dict[str, Any]], list[TimedFault]]:
        """(step faults, timed faults): every fault with its `rank: random` drawn and its
        `probability` decided, with the scenario's seed (the same seed, the same faults).
        A timed fault (`after_seconds: T`, or `every_seconds: P` with `jitter_s` and
        `count`) is injected into the running job T (or about P, 2P, ...) seconds after it
        started training."""
        rng = random.Random(self.seed)
        steps, timed = [], []
        for f in self.faults:
            if network.is_network(f) or ray_faults.is_ray_fault(f):
                continue  # carried out from outside the job: network_faults(), ray_faults()
            f = dict(f)
            chance = f.pop("probability", 1.0)
            after, every = f.pop("after_seconds", None), f.pop("every_seconds", None)
            jitter, count = f.pop("jitter_s", 0.0), f.pop("count", 1)
            if chance < 1.0 and rng.random() >= chance:
                continue
            if after is None and every is None:
                if f.get("rank") == "random":
                    f["rank"] = rng.randrange(workers)
                steps.append(f)
                continue
            at = float(after if after is not None else 0.0)
            for _ in range(int(count) if every is not None else 1):
                if every is not None:
                    at += float(every) + rng.uniform(-float(jitter), float(jitter))
                one = dict(f)
                if one.get("rank") == "random":
                    one["rank"] = rng.randrange(workers)
                timed.append(TimedFault(max(at, 0.0), one))
        return steps, sorted(timed, key=lambda t: t.after_s)


def _checked(i: int, parse: Callable[[dict[str, Any]], Any], fault: dict[str, Any]) -> None:
    """`parse(fault)`, the scenario's fault `i` of the outside kinds (network, Ray); its
    errors as one message naming `faults.i` and each field."""
    try:
        parse(fault)
    except ValidationError as e:
        errors = [_format_error(err) for err in e.errors()]
        raise ValueError(f"faults.{i}: " + "; ".join(errors)) from None


def _spec_path(sc: Scenario) -> Path:
    p = Path(sc.job.spec)
    if not p.is_absolute() and sc.source is not None:
        p = sc.source.parent / p
    return p


def load_scenario(path: str | Path, overrides: list[str] = ()) -> Scenario:
    """Read and check a scenario file; SpecError names every bad field. `overrides`
    (key.path=value) apply to the scenario, e.g. `job.set=[...]` or `seed=3`."""
    sc = load_model(path, Scenario, list(overrides))
    sc.source = Path(path).resolve()
    return sc


def lean_baseline(spec: JobSpec, name: str) -> JobSpec:
    """The failure-free run of `spec`: what decides its model, without what only keeps a
    job alive through faults it will not meet. No spares, no standbys (processes that
    would start and import torch beside the ranks on the same cores), no durable tier (its
    writes, and a later baseline resuming from them), no copies to peers and one snapshot
    at the end instead of one every checkpoint.every_steps (the per-step capture and
    commit, which change nothing a run computes: that every setting of them ends with this
    digest is what the chaos runs check)."""
    failure = spec.failure.model_copy(update={"spares": 0, "standby": False})
    ckpt = spec.checkpoint.model_dump(mode="json", exclude={"max_lag_steps"})
    ckpt.update(every_steps=spec.steps, replicas=1, persist={"uri": None})
    checkpoint = type(spec.checkpoint).model_validate(ckpt)
    return spec.model_copy(update={"name": name, "failure": failure, "checkpoint": checkpoint})


def job_specs(sc: Scenario) -> tuple[JobSpec, JobSpec]:
    """(baseline, chaos): the scenario's job without faults and with them, each under a
    name of its own, NAME-baseline and NAME-chaos (their durable checkpoints, if any, never
    mix). SpecError names the spec file, or the scenario's fault, that is wrong."""
    path = _spec_path(sc)
    try:
        data = read_yaml(path)
    except SpecError as e:
        reason = e.errors[0]
        if not reason.startswith("cannot read: "):
            raise
        raise SpecError(
            f"{sc.source}: job.spec",
            [f"cannot read {path}: {reason.removeprefix('cannot read: ')}"],
        ) from None
    if not isinstance(data, dict):
        raise SpecError(str(path), ["expected a mapping at the top level"])
    data = apply_overrides(data, list(sc.job.set))
    base = validate({**data, "chaos": {"faults": []}}, str(path))
    faults, timed = sc.resolved(base.max_workers)
    for i, f in enumerate(sc.faults):
        rank = f.get("rank") if network.is_network(f) else None
        if isinstance(rank, int) and rank >= base.max_workers:
            raise SpecError(
                str(sc.source),
                [f"faults.{i}.rank: must be < workers ({base.max_workers}), got {rank}"],
            )
    # A timed fault is checked as a step fault would be (its kind's fields, its rank).
    faults_checked = [*faults, *({**t.fault, "at_step": 0} for t in timed)]
    name = base.name[:48]
    clean = lean_baseline(base, f"{name}-baseline")
    # chaos.enabled stays the spec's: on a cluster the command did not start it must be
    # set (with --allow-remote), as for `stalwart run`.
    enabled = bool((data.get("chaos") or {}).get("enabled", False))
    chaos = {**data, "name": f"{name}-chaos", "chaos": {"enabled": enabled, "faults": faults}}
    try:
        validate({**chaos, "chaos": {"faults": faults_checked}}, str(path))
        faulty = validate(chaos, str(path))
    except SpecError as e:
        # The faults are the scenario's: say so, with the scenario's field names.
        errors = [m.replace("chaos.faults.", "faults.") for m in e.errors]
        raise SpecError(str(sc.source), errors) from None
    return clean, faulty

"""The `chaos` section of a job spec: the faults a job carries (kinds, targets, triggers),
validated with the rest of the spec (orchestrator/spec.py re-exports them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Faults that may name peer_of_rank.
PEER_FAULTS = ("kill_node", "kill_raylet", "drop_replicas", "gpu_xid")
COLLECTIVE_FAULTS = ("kill_worker", "kill_node", "hang")  # faults that may fire in_collective


class _FaultBase(_Model):
    rank: int = Field(ge=0, description="the rank (or, for node faults, its node) to hit")
    peer_of_rank: int | None = Field(
        None,
        ge=0,
        description="instead of `rank` (kill_node, drop_replicas, gpu_xid): hit the node "
        "that keeps the copies of this rank's shards (its first replica peer), through a "
        "rank of the job there; the fault fires when that rank reaches at_step",
    )

    @model_validator(mode="before")
    @classmethod
    def _peer_stands_for_rank(cls, data: Any) -> Any:
        # With peer_of_rank, `rank` is the rank found on the holder's node when the fault is
        # handed to a generation; until then it names the rank whose holder is meant.
        if isinstance(data, dict) and data.get("peer_of_rank") is not None:
            data = {"rank": data["peer_of_rank"], **data}
        return data

    at_step: int = Field(ge=0, description="fires when the rank reaches this step (once)")
    after_commit: bool = Field(
        False,
        description="first wait (at most 60 s, the rank paused) until the newest snapshot at "
        "or before at_step is committed, so the fault's restore point is known: a loss "
        "tested without racing the copies to peers (the event says which step was committed)",
    )
    after_persist: bool = Field(
        False,
        description="first wait (as after_commit) until the durable tier holds the newest "
        "step of its grid at or before at_step (checkpoint.persist.every_steps; any step "
        "with every_seconds): a loss that must restore from storage tested without racing "
        "the writes (the event says which step was persisted)",
    )
    during: Literal["replace", "rendezvous", "restore", "persist", "snapshot"] | None = Field(
        None,
        description="fire instead in this phase of the first recovery after the job "
        "reached at_step: as the rank's replacement starts (replace: kill_worker only, the "
        "new process dies before it joins), as the rank joins the new group (rendezvous) "
        "or while it loads the restore step (restore): a failure during a recovery; or "
        "(persist: kill_node only) while the rank's node writes its shards of the first "
        "durable checkpoint at or after at_step, after its first shard and before the "
        "manifest; or (snapshot: kill_worker only) while the rank hands over its snapshot "
        "of the first step at or after at_step, half of it copied to its node's memory",
    )
    in_collective: Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast"] | None = (
        Field(
            None,
            description="(kill_worker, kill_node, hang) fire inside the rank's first "
            "collective of this kind at or after at_step, on whichever group it runs (an "
            "FSDP2 all-gather or reduce-scatter of the shard dimension, HSDP's all-reduce "
            "of the replicate one): a kill right after the rank issued its part, so that "
            "its peers are in the middle of it; a hang just before, so that they wait in it",
        )
    )


class KillWorker(_FaultBase):
    """SIGKILL the worker holding ``rank``."""

    kind: Literal["kill_worker"]


class KillNode(_FaultBase):
    """Kill every Ray process of the node hosting ``rank``: its raylet and all its workers."""

    kind: Literal["kill_node"]


class KillRaylet(_FaultBase):
    """SIGKILL the raylet of the node hosting ``rank``, and nothing else, as when a raylet
    crashes: its workers and the job's node agent there lose their raylet and Ray takes
    them down. Only on a cluster the command itself started."""

    kind: Literal["kill_raylet"]


class Hang(_FaultBase):
    """Block ``rank``'s step forever (its heartbeat thread keeps beating)."""

    kind: Literal["hang"]


class Slow(_FaultBase):
    """Make ``rank``'s compute ``factor`` times slower from ``at_step`` on. With
    ``at_step: 0`` its node is slow from the start, preflight check included."""

    kind: Literal["slow"]
    factor: float = Field(3.0, gt=1, description="compute time multiplier")


class GpuXid(_FaultBase):
    """The fake GPU probe of the node hosting ``rank`` reports Xid ``xid`` on that rank's GPU."""

    kind: Literal["gpu_xid"]
    xid: int = Field(ge=1, description="the NVIDIA Xid code, e.g. 79 (fallen off the bus)")


# An open union discriminated by ``kind``.
class DropReplicas(_FaultBase):
    """Wipe the memory of the node hosting ``rank``: its own shards and the copies it keeps
    for its peers, and refuse copies of steps up to ``at_step`` still on their way."""

    kind: Literal["drop_replicas"]


class StorageUnavailable(_FaultBase):
    """The durable target fails every read and write for ``seconds`` from ``at_step`` on."""

    kind: Literal["storage_unavailable"]
    seconds: float = Field(gt=0, description="how long the persist target fails")


class CorruptShard(_FaultBase):
    """Flip a byte in every shard of ``rank`` that its node's own store holds, and in the
    next ``following`` it is handed (damaged memory, a torn write): damaged shards are
    never copied to peers, and a restore from one finds the checksum wrong and restores
    from the next source (another node's copy, an older commit)."""

    kind: Literal["corrupt_shard"]
    following: int = Field(5, ge=0, description="later hand-overs damaged too")


class FillShm(_FaultBase):
    """Fill the file system of the node's checkpoint.shm_dir to its last byte for
    ``seconds`` (another tenant, a leak): new shards no longer fit there and the node keeps
    them in its agent's memory. Only on a cluster the command started, and a file system of
    at most 4 GiB (a scenario's cluster.shm_bytes): a larger one would be the machine's RAM."""

    kind: Literal["fill_shm"]
    seconds: float = Field(30.0, gt=0, description="how long the file system stays full")


class NanLoss(_FaultBase):
    """Make one weight of ``rank``'s registered model NaN before ``at_step`` (a bit flip, a
    bad kernel): its loss goes NaN, and through the all-reduce of the gradients every rank's
    model. The loss guard (health.loss_guard) must stop it before that state is
    checkpointed; the job rolls back and ends with the failure-free model."""

    kind: Literal["nan_loss"]


class KillSupervisor(_FaultBase):
    """Kill the job's supervisor actor when ``rank`` reaches ``at_step``."""

    kind: Literal["kill_supervisor"]


Fault = Annotated[
    KillWorker
    | KillNode
    | KillRaylet
    | Hang
    | Slow
    | GpuXid
    | DropReplicas
    | StorageUnavailable
    | KillSupervisor
    | CorruptShard
    | FillShm
    | NanLoss,
    Field(discriminator="kind"),
]


class ChaosSpec(_Model):
    enabled: bool = Field(
        False,
        description="allow these faults on a cluster this command did not start (with "
        "--allow-remote on the command): on an embedded Ray, or a cluster `stalwart chaos "
        "run` started itself, faults need no opt-in",
    )
    faults: list[Fault] = Field(default_factory=list)

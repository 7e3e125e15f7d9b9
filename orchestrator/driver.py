"""`stalwart run`: connect to Ray (embedded by default), start the job's supervisor, follow it,
and write OUTPUT/result.json and OUTPUT/events.jsonl."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from stalwart.orchestrator import registry
from stalwart.orchestrator.compat import require_ray
from stalwart.orchestrator.observe.logs import RunLogs
from stalwart.orchestrator.spec import JobSpec

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
CONTROL_PROCESSES = 2  # the supervisor and one node agent (the embedded Ray's one node)


class ClusterUnreachable(RuntimeError):
    pass


class JobAlreadyRunning(RuntimeError):
    """Another job of the same name runs on the cluster."""


class ChaosRefused(ValueError):
    """A spec with chaos faults aimed at a cluster this command did not start, without
    both opt-ins."""


class SupervisorLost(RuntimeError):
    """The job's supervisor died more often than failure.supervisor_restarts allows."""


NAME_WAIT_S = 60.0


@dataclass(frozen=True)
class RunOptions:
    address: str | None = None  # None: RAY_ADDRESS, else an embedded local Ray
    output: Path = Path("runs")
    base_dir: str | None = None  # where relative 'file.py:fn' entrypoints are found
    num_cpus: int | None = None  # embedded Ray only
    connect_timeout_s: float = 10.0
    resume: str = "auto"  # "auto", "never" or a step number (checkpoint.persist.uri)
    # The caller started the cluster at `address` itself (a test, `stalwart chaos run`):
    # chaos faults need no opt-in there, and a kill_node may kill whole raylets.
    owns_cluster: bool = False
    allow_remote_chaos: bool = False  # --allow-remote


def check_chaos_allowed(spec: JobSpec, opts: RunOptions) -> None:
    """Faults against a cluster that is not the embedded one (nor one the caller started)
    need `chaos.enabled: true` in the spec and --allow-remote on the command."""
    remote = bool(opts.address or os.environ.get("RAY_ADDRESS"))
    if not spec.chaos.faults or not remote or opts.owns_cluster:
        return
    missing = []
    if not spec.chaos.enabled:
        missing.append("`chaos.enabled: true` in the spec")
    if not opts.allow_remote_chaos:
        missing.append("--allow-remote on the command")
    if missing:
        raise ChaosRefused(
            f"refusing to inject {len(spec.chaos.faults)} chaos fault(s) into a cluster this "
            f"command did not start ({opts.address or os.environ.get('RAY_ADDRESS')}): that "
            f"needs {' and '.join(missing)}; there a kill_node kills only this job's "
            "processes on the node, never its raylet"
        )


def _probe(address: str, timeout: float) -> None:
    """Fail fast, with a clear message, on an address nothing listens on."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port
    if host is None or port is None:
        raise ClusterUnreachable(
            f"--address {address!r}: expected ray://HOST:PORT, HOST:PORT or auto"
        )
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ClusterUnreachable(
            f"cannot reach the Ray cluster at {address}: {e.strerror or e}"
        ) from None


def _attach(address: str, timeout: float) -> None:
    import ray

    _probe(address, timeout)
    try:
        ray.init(address=address, namespace="stalwart", log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        raise ClusterUnreachable(f"cannot connect to the Ray cluster at {address}: {e}") from None


def find_supervisor(address: str, job: str, timeout: float = 10.0) -> Any:
    """Connect to the cluster at `address` and return job `job`'s running supervisor.
    The caller shuts Ray down. LookupError when no such job runs there."""
    import ray

    require_ray()
    _attach(address, timeout)
    try:
        return ray.get_actor(f"stalwart-{job}", namespace="stalwart")
    except ValueError:
        ray.shutdown()
        raise LookupError(f"no running stalwart job named {job!r} on {address}") from None


def connect(address: str | None, spec: JobSpec, num_cpus: int | None, timeout: float) -> str:
    import ray

    require_ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _attach(address, timeout)
        return address
    # Embedded: size Ray's logical CPUs to fit the job (the workers' threads are capped to
    # their own share, so this does not oversubscribe the machine's cores).
    need = (spec.max_workers + spec.failure.spares) * spec.resources.cpu
    # The raylet starts one idle Python process per logical CPU as the driver connects:
    # with one for each of the job's processes (ranks, spares, the supervisor and the node
    # agent), none of them waits for a process to be started (2 at a time on 2 cores).
    processes = spec.max_workers + spec.failure.spares + CONTROL_PROCESSES
    cpus = num_cpus or max(os.cpu_count() or 1, int(need + 0.999), processes)
    ray.init(
        address="local",  # always a new local instance, even if a cluster runs here
        num_cpus=cpus,
        namespace="stalwart",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=True,
        logging_level="ERROR",
    )
    return "embedded"


def run_job(
    spec: JobSpec,
    opts: RunOptions,
    on_progress: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
    on_output: Callable[[list[dict[str, Any]]], None] | None = None,
    on_connected: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `spec` to the end. Returns result.json's content (also written to opts.output).
    `on_output`: the lines the ranks print, as they arrive (all kept under OUTPUT/logs/);
    `on_connected`: the cluster's address, once connected."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marks = {"started": time.time()}  # the cold start's (supervisor/startup.py)
    check_chaos_allowed(spec, opts)
    out = Path(opts.output)
    # Imported in this thread, before Ray connects: torch imported in a second thread
    # while ray.init ran crashed the driver now and then ("Intel oneMKL FATAL ERROR: Cannot
    # load libtorch_cpu.so", then SIGSEGV, on a cluster the Jobs API runs it on).
    from stalwart.orchestrator.ray_classes import actor_class
    from stalwart.orchestrator.supervisor.actor import JobSupervisor

    # Connected first: an address that does not answer leaves no empty run directory.
    where = connect(opts.address, spec, opts.num_cpus, opts.connect_timeout_s)
    marks["ray_ready"] = time.time()
    logs: RunLogs | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        events_path = out / "events.jsonl"
        events_path.write_text("")
        logs = RunLogs(out)
        if spec.output_dir is None and (where == "embedded" or _one_machine()):
            # Every worker can write the run directory: ctx.output_dir is in it.
            spec = spec.model_copy(update={"output_dir": str((out / "output").resolve())})
        elif spec.output_dir is None and not spec.checkpoint.persist.uri:
            log.warning(
                "ctx.output_dir is not available to this job: the cluster is not this machine "
                "and the spec sets neither output_dir nor checkpoint.persist.uri (a loop that "
                "saves its model there fails at the save)"
            )
        name = f"stalwart-{spec.name}"
        _wait_for_name(name)
        # Where another terminal finds this job (`stalwart status NAME`): this cluster and
        # no other, even where another Ray runs on this machine.
        gcs = ray.get_runtime_context().gcs_address
        registry.record(spec.name, gcs, str(out))
        if on_connected is not None:
            on_connected(gcs)
        # One store key for every supervisor of this run: a restarted one finds the node
        # agents (and the shards in their memory) by it.
        store_key = f"{spec.name}-{uuid.uuid4().hex[:12]}"
        owned = where == "embedded" or opts.owns_cluster
        if where == "embedded":
            from stalwart.orchestrator.supervisor.agents import start_agent  # imported above

            # Its one node's agent starts (imports torch, ...) while the supervisor does, on
            # the core the supervisor leaves idle, not later beside the ranks' starts.
            start_agent(spec, store_key, _head_node())

        def start(adopt: dict[str, Any] | None) -> Any:
            marks.setdefault("supervisor_requested", time.time())
            return (
                actor_class(JobSupervisor)
                .options(
                    num_cpus=0,
                    max_concurrency=8,
                    name=name,
                    get_if_exists=False,
                    max_restarts=0,
                    # On the head node, whose loss is the cluster's loss anyway: a lost
                    # worker node (or a chaos kill_node) never takes the supervisor along.
                    scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node(), soft=False),
                )
                .remote(
                    spec.model_dump(mode="json"),
                    opts.base_dir,
                    opts.resume,
                    store_key,
                    adopt,
                    owned_cluster=owned,
                    driver_marks=marks,
                )
            )

        supervisor = start(None)
        restarts = 0
        with events_path.open("a") as events_file, _ray_messages_to(logs):
            follower = _Follower(
                supervisor, supervisor.run.remote(), events_file, on_progress, out, logs, on_output
            )
            while True:
                try:
                    result = follower.follow()
                    break
                except KeyboardInterrupt:
                    # Cancel cleanly: the supervisor aborts the workers and still reports,
                    # within CANCEL_WAIT_S (or until a second Ctrl-C); else it is stopped.
                    follower.supervisor.cancel.remote()
                    try:
                        result = follower.follow(deadline=time.monotonic() + CANCEL_WAIT_S)
                    except (KeyboardInterrupt, _CancelTimeout) as e:
                        why = (
                            "a second Ctrl-C"
                            if isinstance(e, KeyboardInterrupt)
                            else f"it had not stopped {CANCEL_WAIT_S:g} s after the cancel"
                        )
                        result = _force_stop(follower, spec, store_key, why)
                    break
                except ray.exceptions.RayActorError as e:
                    # The supervisor died (its process, or a chaos kill_supervisor).
                    if restarts >= spec.failure.supervisor_restarts:
                        raise SupervisorLost(
                            f"the job's supervisor died {restarts + 1} time(s) "
                            f"(failure.supervisor_restarts={spec.failure.supervisor_restarts})"
                            f": {str(e).splitlines()[0]}"
                        ) from None
                    restarts += 1
                    follower.note(
                        "supervisor_lost",
                        restarts=restarts,
                        reason=f"the supervisor died; starting another one ({restarts} of "
                        f"{spec.failure.supervisor_restarts}), which takes the job back from "
                        "the node agents' memory",
                    )
                    _wait_for_name(name)
                    supervisor = start({"restarts": restarts, **follower.account()})
                    follower.rebind(supervisor, supervisor.run.remote())
        result["ray"] = where
        result["output"] = str(out)
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        _linger(spec.metrics.linger_s, result.get("metrics_url"))
        return result
    finally:
        registry.forget(spec.name)
        ray.shutdown()
        if logs is not None:
            logs.close()


@contextlib.contextmanager
def _ray_messages_to(logs: RunLogs) -> Iterator[None]:
    """Ray's driver prints what the raylets report (a worker died, a node was marked dead)
    as paragraphs into the terminal, over the progress view, for faults stalwart reports in
    one line of its own: keep them in OUTPUT/logs/ray.log instead. (Ray's private printer;
    where a Ray version has none by that name, its messages print as before.)"""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        yield
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        if data.get("pid") == "raylet":
            logs.note("\n".join(data.get("lines", [])))
        else:
            original(data, ignore_prefix)

    ray_worker.print_to_stdstream = to_log
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = original


def _linger(seconds: float, url: str | None) -> None:
    """Keep the supervisor (and its exporter) up `seconds` after the job ended, so the end
    state is scraped (metrics.linger_s); Ctrl-C cuts it short."""
    if not seconds or not url:
        return
    log.info("serving the final metrics at %s for %g s (metrics.linger_s)", url, seconds)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait(seconds)


def _wait_for_name(name: str, timeout_s: float = NAME_WAIT_S) -> None:
    """A job's supervisor is named after the job. A supervisor of the same name whose
    driver died (SIGKILL, a lost laptop) goes with it, which Ray notices within seconds:
    wait for that. One that still answers is a running job: refuse, saying so."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            old = ray.get_actor(name, namespace="stalwart")
        except ValueError:
            return  # free
        try:
            ray.get(old.poll.remote(0), timeout=5)
            alive = True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            alive = False
        if alive:
            raise JobAlreadyRunning(
                f"a job named {name.removeprefix('stalwart-')!r} is already running on this "
                "cluster: wait for it, stop it, or give this one another name"
            )
        if time.monotonic() > deadline:
            raise JobAlreadyRunning(
                f"the previous {name!r} (its driver is gone) was not cleaned up by Ray "
                f"within {timeout_s:g} s"
            )
        time.sleep(0.5)  # Ray is removing the dead one; bounded by the deadline


def _one_machine() -> bool:
    """Every node of the cluster is this machine (a local multi-node cluster, say)."""
    import ray

    here = ray.util.get_node_ip_address()
    return all(n["NodeManagerAddress"] == here for n in ray.nodes() if n["Alive"])


def _head_node() -> str:
    import ray

    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


CANCEL_WAIT_S = 30.0  # a cancelled job's supervisor has this long to report


class _CancelTimeout(Exception):
    pass


def _force_stop(follower: _Follower, spec: JobSpec, store_key: str, why: str) -> dict:
    """Stop a cancelled job whose supervisor did not report in time: kill it (its workers
    go with it) and the job's node agents (detached: they would hold the nodes' memory for
    their lease), and make the result from the last progress seen."""
    import ray

    from stalwart.orchestrator.supervisor.agents import AGENT_PREFIX

    with contextlib.suppress(Exception):
        ray.kill(follower.supervisor, no_restart=True)
    prefix = f"{AGENT_PREFIX}{store_key}-"
    with contextlib.suppress(Exception):
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == "stalwart" and actor["name"].startswith(prefix):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(actor["name"], namespace="stalwart"), no_restart=True)
    p = follower.last_progress or {}
    reason = f"cancelled; the supervisor was stopped ({why})"
    follower.note("state", old=p.get("state"), new="CANCELLED", reason=reason)
    return {
        "name": spec.name,
        "metrics_url": None,
        "status": "cancelled",
        "steps_completed": p.get("step", 0),
        "total_steps": spec.steps,
        "final_loss": p.get("loss"),
        "model_digest": None,
        "workers": p.get("workers", spec.max_workers),
        "resizes": [],
        "generations": p.get("generation", 0),
        "restarts": p.get("restarts", 0),
        "failures": follower.account()["failures"],
        "lost_steps_total": sum(f.get("steps_redone") or 0 for f in follower.account()["failures"]),
        "wall_seconds": round(time.time() - follower.started, 3),
        "training_seconds": None,
        "goodput": p.get("goodput"),
        "steps_per_second": None,
        "samples_per_second": None,
        "committed_step": p.get("committed_step"),
        "cordoned": [],
        "lost_nodes": [],
        "stragglers": [],
        "slow_links": [],
        "checkpoint": None,
        "replication": None,
        "persist": None,
        "resumed_from": None,
        "supervisor_restarts": 0,
        "startup": follower.account()["startup"],
        "error": {"message": reason},
    }


class _Follower:
    """Polls the supervisor: appends new events to events.jsonl, feeds the progress view."""

    def __init__(
        self,
        supervisor: Any,
        done: Any,
        events_file: Any,
        on_progress: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None,
        out: Path | None = None,
        logs: RunLogs | None = None,
        on_output: Callable[[list[dict[str, Any]]], None] | None = None,
    ):
        self.supervisor = supervisor
        self.done = done
        self.events_file = events_file
        self.on_progress = on_progress
        self.out = out
        self.logs = logs
        self.on_output = on_output
        self.seen = 0
        self.output_seen = 0
        self.last_progress: dict[str, Any] | None = None
        self.started = time.time()
        self._closed: list[dict[str, Any]] = []  # failure_closed records, every supervisor's
        self._recoveries = 0
        self._startup: dict[str, Any] | None = None  # the `startup` event's breakdown

    def account(self) -> dict[str, Any]:
        """What a successor supervisor carries on: the failures recovered so far and the
        number of recoveries (the restart budget spent)."""
        return {
            "failures": list(self._closed),
            "recoveries": self._recoveries,
            "started_at": self.started,  # the job's wall time spans every supervisor
            "startup": self._startup,
        }

    def note(self, kind: str, **fields: Any) -> None:
        """An event of the driver's own (the supervisor that would log it is gone)."""
        event = {"ts": time.time(), "type": kind, **fields}
        self.events_file.write(json.dumps(event) + "\n")
        self.events_file.flush()
        if self.on_progress and self.last_progress is not None:
            self.on_progress(self.last_progress, [event])

    def rebind(self, supervisor: Any, done: Any) -> None:
        """Follow a new supervisor (its event log starts at 0)."""
        self.supervisor, self.done, self.seen, self.output_seen = supervisor, done, 0, 0

    def follow(self, deadline: float | None = None) -> dict[str, Any]:
        """Until the supervisor's run() returns (its result); past `deadline` (monotonic),
        _CancelTimeout."""
        import ray

        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise _CancelTimeout()
            finished, _ = ray.wait([self.done], timeout=POLL_INTERVAL_S)
            left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
            try:
                update = ray.get(
                    self.supervisor.poll.remote(self.seen, self.output_seen), timeout=left
                )
            except ray.exceptions.GetTimeoutError:
                raise _CancelTimeout() from None
            self._take_output(update.get("output"))
            for _ in range(20):  # a burst of lines: take the rest now, not a poll later
                if not (update.get("output") or {}).get("more"):
                    break
                update = ray.get(self.supervisor.poll.remote(self.seen, self.output_seen))
                self._take_output(update.get("output"))
            if update.get("events_missed"):
                self.note(
                    "events_missed",
                    count=update["events_missed"],
                    reason="the supervisor let them go before they were fetched (it keeps "
                    "only its newest events in memory)",
                )
            for event in update["events"]:
                if event["type"] == "failure_closed":
                    self._closed.append(event["record"])
                elif event["type"] == "recovered":
                    self._recoveries += 1
                elif event["type"] == "startup":
                    self._startup = {
                        k: v for k, v in event.items() if k not in ("ts", "type", "seq")
                    }
                if event["type"] == "stacks" and self.out is not None:
                    event = self._write_stacks(event)
                self.events_file.write(json.dumps(event) + "\n")
            self.events_file.flush()
            if update["events"]:
                self.seen = update["events"][-1]["seq"] + 1
            self.last_progress = update["progress"]
            if self.on_progress:
                self.on_progress(update["progress"], update["events"])
            if finished:
                # The ranks' last lines reached the supervisor before their outcomes.
                for _ in range(100):
                    more = ray.get(self.supervisor.poll.remote(self.seen, self.output_seen))
                    if not more["output"]["lines"]:
                        break
                    self._take_output(more["output"])
                return ray.get(self.done)

    def _take_output(self, output: dict[str, Any] | None) -> None:
        if not output:
            return
        self.output_seen = output["next"]
        lines = output["lines"]
        if output["missed"] and self.logs is not None:
            self.logs.note(f"[stalwart: {output['missed']} lines of the ranks' output missed]")
        if lines and self.logs is not None:
            self.logs.write(lines)
        if lines and self.on_output:
            self.on_output(lines)

    def _write_stacks(self, event: dict[str, Any]) -> dict[str, Any]:
        """Stacks go to OUTPUT/stacks/gen<G>-rank<R>.txt; the event keeps their paths."""
        folder = self.out / "stacks"
        folder.mkdir(parents=True, exist_ok=True)
        files = {}
        for rank, st in sorted(event["stacks"].items(), key=lambda kv: int(kv[0])):
            path = folder / f"gen{event['generation']}-rank{rank}.txt"
            path.write_text(
                f"# rank {rank}, pid {st.get('pid')}, via {st.get('via')}\n"
                f"# {event['reason']}\n{st['text']}\n"
            )
            files[rank] = str(path)
        return {**event, "files": files}

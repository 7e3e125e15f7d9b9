"""`stalwart chaos run`: the failure-free baseline (cached), the chaos run, the verdict.

The two runs share the cluster: the one at --address, else one the command starts (an
embedded Ray, or a local multi-node Ray when the scenario asks for worker nodes) and stops.
The baseline's digest is cached under a key of the job spec without faults and the code
that trains it (stalwart's sources, torch's and Ray's versions, the entrypoint's file), so
a scenario suite runs each job's baseline once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.ckpt.durable import DurableStore
from stalwart.orchestrator.chaos import cluster_loss, fencing, ray_faults
from stalwart.orchestrator.chaos.network import NetworkInjector
from stalwart.orchestrator.chaos.ray_faults import RayFaultInjector
from stalwart.orchestrator.chaos.render import junit
from stalwart.orchestrator.chaos.scenario import Scenario, TimedFault, job_specs
from stalwart.orchestrator.chaos.verdict import Verdict, judge
from stalwart.orchestrator.driver import ChaosRefused, RunOptions, check_chaos_allowed, run_job
from stalwart.orchestrator.spec import JobSpec

if TYPE_CHECKING:
    from stalwart.orchestrator.chaos.netns import NetnsCluster

PACKAGE = Path(__file__).resolve().parents[2]  # the installed `stalwart` package
SUBPACKAGES = ("orchestrator", "health", "ckpt", "dashboards", "examples")


class BaselineFailed(RuntimeError):
    """The failure-free run did not succeed: there is nothing to compare with."""


@dataclass(frozen=True)
class ChaosOptions:
    output: Path
    address: str | None = None  # None: the command starts the scenario's cluster
    owns_cluster: bool = False  # the caller started the cluster at `address`
    allow_remote: bool = False  # --allow-remote
    base_dir: str | None = None  # where relative 'file.py:fn' entrypoints are found
    use_cache: bool = True
    cache_dir: Path | None = None  # default: $STALWART_CACHE_DIR or ~/.cache/stalwart
    prometheus_url: str | None = None
    # A network-namespace cluster the caller started (its address is `address`): the
    # scenario's network faults are carried out on it.
    netns: NetnsCluster | None = None


def cache_dir(opts: ChaosOptions) -> Path:
    if opts.cache_dir is not None:
        return opts.cache_dir
    env = os.environ.get("STALWART_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "stalwart"


def code_version(spec: JobSpec, base_dir: str | None) -> str:
    """A hash of what decides a baseline's digest besides the spec: stalwart's sources,
    torch's and Ray's versions, the entrypoint's own file."""
    import ray
    import torch

    h = hashlib.sha256(f"torch {torch.__version__} ray {ray.__version__}".encode())
    sources = [p for sub in SUBPACKAGES for p in (PACKAGE / sub).rglob("*.py")]
    for path in sorted(sources):
        h.update(str(path.relative_to(PACKAGE)).encode())
        h.update(path.read_bytes())
    target = spec.entrypoint.rpartition(":")[0]
    source: Path | None = None
    if target.endswith(".py"):
        source = Path(target) if Path(target).is_absolute() else Path(base_dir or ".") / target
    else:
        with contextlib.suppress(ImportError, ValueError, AttributeError):
            found = importlib.util.find_spec(target)
            source = Path(found.origin) if found and found.origin else None
    if source is not None and source.is_file():
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


# How a job is kept alive, never what it computes: specs that differ only here share a
# baseline. A digest that differs for one of them is a finding (a knob that changed the
# model), not a reason to keep separate baselines.
# What the heads of the local clusters stalwart and its tests start leave out: the dashboard,
# and the log monitor, which would tail every job's log files for the cluster's life for no
# one (stalwart's drivers take no worker output from Ray: log_to_driver is off, the ranks'
# output comes through stalwart).
QUIET_HEAD = {"include_dashboard": False, "include_log_monitor": False}
OPERATIONAL = ("placement", "checkpoint", "failure", "health", "metrics", "chaos", "output_dir")


def computes(spec: JobSpec) -> dict:
    """What decides a job's model: its spec without the OPERATIONAL sections and its name,
    but with checkpoint.init_from (the weights it starts from), which is one of theirs."""
    data = spec.model_dump(mode="json")
    for field in (*OPERATIONAL, "name"):
        data.pop(field, None)
    if spec.checkpoint.init_from is not None:
        data["init_from"] = spec.checkpoint.init_from
    return data


def baseline_key(spec: JobSpec, base_dir: str | None) -> str:
    data = computes(spec)
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(f"{text}\n{code_version(spec, base_dir)}".encode()).hexdigest()[:24]


class ShmMountFailed(RuntimeError):
    """cluster.shm_bytes: the tmpfs could not be mounted (not root?)."""


@contextlib.contextmanager
def small_shm(nbytes: int | None, where: Path) -> Iterator[str | None]:
    """A tmpfs of `nbytes` mounted under `where` for the job's checkpoint.shm_dir (a
    container's small /dev/shm), unmounted on the way out; None when not asked for."""
    if nbytes is None:
        yield None
        return
    import subprocess

    mount = where / "shm"
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=1777", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ShmMountFailed(
            f"cluster.shm_bytes: cannot mount a {nbytes} byte tmpfs at {mount} (it needs "
            f"root): {done.stderr.strip() or done.returncode}"
        )
    try:
        yield str(mount / "stalwart")
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@contextlib.contextmanager
def scenario_cluster(
    sc: Scenario, opts: ChaosOptions
) -> Iterator[tuple[str | None, bool, NetnsCluster | None, Any]]:
    """(address, owned, netns, local): the cluster both runs use, its network-namespace
    handle when its nodes have networks of their own, and the local cluster's handle
    (ray.cluster_utils' Cluster) when the command started one on loopback. A local
    multi-node Ray the command starts here is stopped on the way out (its loopback ports,
    or its namespaces, only)."""
    if opts.address is not None:
        with environ(opts.netns.env if opts.netns else {}):
            yield opts.address, opts.owns_cluster, opts.netns, None
        return
    if sc.cluster.worker_nodes == 0:
        yield None, True, None, None  # each run's embedded Ray
        return
    if sc.cluster.network == "netns":
        from stalwart.orchestrator.chaos.netns import NetnsCluster

        with (
            NetnsCluster(sc.cluster.worker_nodes, sc.cluster.cpus_per_node) as netns,
            environ(netns.env),
        ):
            try:
                yield netns.address, True, netns, None
            finally:
                import ray

                ray.shutdown()
        return
    with local_cluster(sc) as cluster:
        yield cluster.address, True, None, cluster


@contextlib.contextmanager
def local_cluster(sc: Scenario) -> Iterator[Any]:
    """A local multi-node Ray on loopback (ray.cluster_utils' Cluster: a CPU-less head and
    the scenario's worker nodes), its GCS's tables in a Redis with `cluster.gcs_ft`
    (orchestrator/chaos/ray_faults.py); stopped on the way out."""
    from ray.cluster_utils import Cluster

    with contextlib.ExitStack() as stack:
        if sc.cluster.gcs_ft:
            address = stack.enter_context(ray_faults.redis_store())
            ns = f"stalwart-chaos-{sc.name}-{os.getpid()}"
            stack.enter_context(
                environ({"RAY_REDIS_ADDRESS": address, "RAY_external_storage_namespace": ns})
            )
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, **QUIET_HEAD},
        )
        try:
            for _ in range(sc.cluster.worker_nodes):
                cluster.add_node(num_cpus=sc.cluster.cpus_per_node)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()


def _run_through_cluster_loss(
    sc: Scenario, clean: JobSpec, faulty: JobSpec, opts: ChaosOptions, say: Callable[[str], None]
) -> Verdict:
    """A restart_gcs without GCS fault tolerance (orchestrator/chaos/cluster_loss.py): the
    chaos run in a process of its own on a cluster the restart takes down, then the job
    again on a new cluster, resuming from the newest durable step; that run's verdict."""
    out, ray_fs = opts.output, sc.ray_faults()
    lost_dir = out / "chaos"
    persist = faulty.checkpoint.persist
    if persist.uri:
        # The chaos run's own job (NAME-chaos): what an earlier run of the scenario left
        # there would be the newest step to resume from, not this run's.
        store = DurableStore(persist.uri, faulty.name)
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(store.root, recursive=True)
    with local_cluster(sc) as first:
        digest = baseline_digest(clean, first.address, True, opts, say)
        import ray

        ray.shutdown()  # Ray aborts a process connected to a cluster whose GCS restarts
        say(f"chaos run: {faulty.name}, {len(ray_fs)} fault(s) of Ray, in a process of its own")
        restarter = RayFaultInjector(ray_fs, first, lost_dir / "events.jsonl")
        try:
            rc = cluster_loss.run_lost(
                faulty.model_dump_json(), lost_dir, first.address, opts.base_dir, restarter.over
            )
        finally:
            applied = restarter.finish()
    newest = cluster_loss.newest_step(persist.uri, faulty.name) if persist.uri else None
    say(
        f"the cluster is lost (the run's driver ended with status {rc}): the job again on a "
        "new cluster, resuming from storage"
    )
    with local_cluster(sc) as second:
        result = _run(faulty, out / "resumed", second.address, True, opts, resume="auto")
    lost = cluster_loss.events_of(lost_dir / "events.jsonl")
    events = cluster_loss.events_of(out / "resumed" / "events.jsonl")
    resumed = cluster_loss.resumed_check(newest, lost, events)
    durable = _durable_audit(faulty, result)
    return _written(
        judge(sc, [], result, events, digest, None, None, applied, durable, also=[resumed]), out
    )


def _durable_audit(spec: JobSpec, result: dict[str, Any]) -> fencing.Audit | None:
    """What the run (its result.json says which) wrote to the job's durable store; None
    when the job writes none."""
    uri = spec.checkpoint.persist.uri
    run = (result.get("persist") or {}).get("run")
    return fencing.audit(uri, spec.name, run) if uri else None


def _written(verdict: Verdict, out: Path) -> Verdict:
    """`verdict`, also written to OUT/verdict.json and OUT/junit.xml."""
    (out / "verdict.json").write_text(json.dumps(verdict.to_dict(), indent=2) + "\n")
    (out / "junit.xml").write_text(junit([verdict]))
    return verdict


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment (the drivers' Ray reads it), then as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class AlertWatch:
    """Asks Prometheus once a second which alerts fire for the job; remembers when each
    first did. Alerts without a train_job label (ExporterAbsent) count for every job."""

    def __init__(self, url: str, job: str, started: float):
        self.url = url.rstrip("/")
        self.job = job
        self.started = started
        self.fired: dict[str, float] = {}
        # Why the last query failed (the verdict says so beside an alert not seen).
        self.error: str | None = f"Prometheus at {self.url} was not asked before the run ended"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="alert-watch", daemon=True)
        self._thread.start()

    def _once(self) -> None:
        query = urllib.parse.urlencode({"query": 'ALERTS{alertstate="firing"}'})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=5) as r:
            data = json.load(r)
        for item in data.get("data", {}).get("result", []):
            labels = item.get("metric", {})
            if labels.get("train_job", self.job) == self.job:
                name = labels.get("alertname", "?")
                self.fired.setdefault(name, round(time.time() - self.started, 1))

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._once()
                self.error = None
            except (OSError, ValueError) as e:
                self.error = f"cannot query Prometheus at {self.url}: {e}"

    def finish(self, expected: list[str], within_s: float) -> dict[str, float]:
        deadline = time.monotonic() + within_s
        while not set(expected) <= set(self.fired) and time.monotonic() < deadline:
            self._stop.wait(1.0)
        self._stop.set()
        self._thread.join(timeout=10)
        return dict(self.fired)


RETRY_S = 60.0  # how long a timed fault waits for a recovering job to run again


JOB_ENDED = "the job ended before its time came"  # a timed fault's answer once the job is over


class TimedInjector:
    """Injects the scenario's timed faults into the running chaos job (through its
    supervisor, as `stalwart chaos inject` does): each at its offset after the job first
    reached RUNNING. What each injection answered is kept for the verdict."""

    def __init__(self, timed: list[TimedFault], job: str, events: Path, allow_remote: bool):
        self.timed = timed
        self.job = job
        self.events = events
        self.allow_remote = allow_remote
        self.answers: list[tuple[TimedFault, dict[str, Any]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-timed", daemon=True)
        if timed:
            self._thread.start()

    def _running_since(self) -> float | None:
        with contextlib.suppress(OSError, ValueError):
            for line in self.events.read_text().splitlines():
                e = json.loads(line)
                if e.get("type") == "state" and e.get("new") == "RUNNING":
                    return e["ts"]
        return None

    def _loop(self) -> None:
        import ray

        started = None
        while started is None and not self._done.wait(0.2):
            started = self._running_since()
        for t in self.timed:
            if self._done.wait(max(started + t.after_s - time.time(), 0.0)):
                break
            request = {**t.fault, "by": "stalwart chaos run", "allow_remote": self.allow_remote}
            # A job that is recovering takes it once it runs again (within RETRY_S).
            until = time.monotonic() + RETRY_S
            while True:
                try:
                    sup = ray.get_actor(f"stalwart-{self.job}", namespace="stalwart")
                    answer = ray.get(sup.inject.remote(request), timeout=30)
                except Exception as e:  # the job ended, or its supervisor is being replaced
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    # Once the job has ended, Ray's connection went with it: say that.
                    answer = {"error": JOB_ENDED if self._done.is_set() else why}
                if not answer.get("retry") or time.monotonic() > until or self._done.wait(0.5):
                    break
            answer.pop("retry", None)
            self.answers.append((t, answer))

    def finish(self) -> list[tuple[TimedFault, dict[str, Any]]]:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=40)
        done = {id(t) for t, _ in self.answers}
        return self.answers + [(t, {"error": JOB_ENDED}) for t in self.timed if id(t) not in done]


def _run(
    spec: JobSpec,
    out: Path,
    address: str | None,
    owned: bool,
    opts: ChaosOptions,
    resume: str = "never",
    **kw,
):
    ropts = RunOptions(
        address=address,
        output=out,
        base_dir=opts.base_dir,
        resume=resume,
        owns_cluster=owned,
        allow_remote_chaos=opts.allow_remote,
    )
    return run_job(spec, ropts, **kw)


def baseline_digest(
    spec: JobSpec,
    address: str | None,
    owned: bool,
    opts: ChaosOptions,
    say: Callable[[str], None],
) -> str:
    key = baseline_key(spec, opts.base_dir)
    path = cache_dir(opts) / "baselines" / f"{key}.json"
    if opts.use_cache and path.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError):
            cached = json.loads(path.read_text())
            say(f"baseline: cached ({path}), digest {cached['model_digest'][:12]}")
            return cached["model_digest"]
    say(f"baseline: {spec.name}, {spec.steps} steps without faults")
    result = _run(spec, opts.output / "baseline", address, owned, opts)
    if result["status"] != "succeeded" or result["failures"]:
        why = (result.get("error") or {}).get("message") or f"{len(result['failures'])} failures"
        raise BaselineFailed(
            f"the failure-free run of {spec.name} did not succeed ({result['status']}: {why}); "
            f"see {opts.output / 'baseline'}"
        )
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # runs sharing the cache
        tmp.write_text(
            json.dumps(
                {
                    "model_digest": result["model_digest"],
                    "job": spec.name,
                    "steps": spec.steps,
                    "wall_seconds": result["wall_seconds"],
                    "written_at": time.time(),
                },
                indent=2,
            )
        )
        tmp.replace(path)
    return result["model_digest"]


def _with_shm(spec: JobSpec, shm_dir: str) -> JobSpec:
    ckpt = spec.checkpoint.model_copy(update={"shm_dir": shm_dir})
    return spec.model_copy(update={"checkpoint": ckpt})


def run_scenario(
    sc: Scenario,
    opts: ChaosOptions,
    say: Callable[[str], None] = lambda _m: None,
    on_progress: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
) -> Verdict:
    """Run the scenario: its baseline (unless cached), its chaos run, the verdict (also
    written to OUTPUT/verdict.json and OUTPUT/junit.xml)."""
    clean, faulty = job_specs(sc)
    opts.output.mkdir(parents=True, exist_ok=True)
    if sc.ray_faults() and not sc.cluster.gcs_ft and opts.address is None:
        return _run_through_cluster_loss(sc, clean, faulty, opts, say)
    if sc.cluster.shm_bytes is not None and opts.address is not None and not opts.owns_cluster:
        raise ChaosRefused(
            "cluster.shm_bytes mounts a file system on this machine for the job's nodes: "
            "only on a cluster this command starts (no --address)"
        )
    with (
        small_shm(sc.cluster.shm_bytes, opts.output) as shm_dir,
        scenario_cluster(sc, opts) as (address, owned, netns, local),
    ):
        net_faults = sc.network_faults(faulty.max_workers)
        if net_faults and netns is None:
            raise ChaosRefused(
                f"{', '.join(sorted({f.kind for f in net_faults}))} faults are carried out on "
                "a cluster whose nodes have networks of their own, that this command starts "
                "(cluster: {network: netns}): not on the cluster at --address"
            )
        ray_fs = sc.ray_faults()
        if ray_fs and local is None:
            raise ChaosRefused(
                "restart_gcs is carried out on the local cluster this command starts "
                "(cluster: {worker_nodes: N}): not on the cluster at --address"
            )
        if shm_dir is not None:
            clean, faulty = (_with_shm(spec, shm_dir) for spec in (clean, faulty))
        # Refused before the baseline runs, not after it.
        check_chaos_allowed(
            faulty,
            RunOptions(address=address, owns_cluster=owned, allow_remote_chaos=opts.allow_remote),
        )
        digest = baseline_digest(clean, address, owned, opts, say)
        outside = f" and {len(net_faults)} of the network" if net_faults else ""
        outside += f" and {len(ray_fs)} of Ray" if ray_fs else ""
        say(f"chaos run: {faulty.name}, {len(faulty.chaos.faults)} fault(s){outside}")
        watch = (
            AlertWatch(opts.prometheus_url, faulty.name, time.time())
            if opts.prometheus_url
            else None
        )
        events_path = opts.output / "chaos" / "events.jsonl"
        timed = sc.resolved(faulty.max_workers)[1]
        injector = TimedInjector(timed, faulty.name, events_path, opts.allow_remote)
        cutter = NetworkInjector(net_faults, netns, events_path) if net_faults else None
        restarter = RayFaultInjector(ray_fs, local, events_path) if ray_fs else None
        try:
            result = _run(
                faulty, opts.output / "chaos", address, owned, opts, on_progress=on_progress
            )
        finally:
            injected = injector.finish()
            network = cutter.finish() if cutter else []
            network += restarter.finish() if restarter else []
        alerts = watch.finish(sc.expect.alerts, sc.expect.alerts_within_s) if watch else None
        alerts_error = watch.error if watch else None
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    faults = [f.model_dump(mode="json") for f in faulty.chaos.faults]
    # Timed faults: those injected take the index the job gave them; the others are shown
    # as not fired, with the reason.
    live = sorted((a["fault"] for _, a in injected if "fault" in a), key=lambda f: f["index"])
    faults += live
    for t, answer in injected:
        if "error" in answer:
            faults.append({**t.fault, "at_step": -1, "refused": answer["error"]})
    durable = _durable_audit(faulty, result)
    verdict = judge(sc, faults, result, events, digest, alerts, alerts_error, network, durable)
    return _written(verdict, opts.output)

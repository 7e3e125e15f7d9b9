"""A multi-node Ray on one machine whose worker nodes each have a network of their own.

Faults of the network are real only if the nodes talk over a network: here each worker
node runs in its own Linux network namespace, wired to a bridge in the root namespace by
a veth pair, with an address of its own in a private /24 that only these namespaces use.
The head (`ray start --head`, no CPUs: the driver's and the supervisor's node) listens on
the bridge's address. A fault cuts or degrades one node's link with nftables rules in its
namespace (a cut, a loss) or a delay on it (netem, or where the kernel has none a delay line
in this process: chaos/delay_line.py), so every socket of that node (raylet, workers,
stalwart's agent and channel) sees it, as on a real network, and nothing in stalwart's code
is told.

Needs root, iproute2's `ip` and `tc`, nftables' `nft` (`apt-get install nftables`); refused with
what is missing otherwise, never a silent no-op. Tests start one per module; a user can
start one for their own chaos runs on one machine:

    with NetnsCluster(worker_nodes=3) as cluster:
        # drivers need cluster.env (Ray's token auth off for these loopback-only nodes)
        subprocess.run(["stalwart", "run", "job.yaml", "--address", cluster.address],
                       env={**os.environ, **cluster.env})
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.orchestrator.chaos.delay_line import DelayLine

SHUTDOWN_GRACE_S = 2.0  # SIGTERM to SIGKILL when the whole cluster stops
PREFIX = "stw"  # of every namespace, link and nft table this module makes
TABLE = "stalwart_chaos"  # the nft table a fault adds in a node's namespace
START_TIMEOUT_S = 60.0
# Each frame a sender hands its link is one wire packet, as a real NIC puts them on a cable:
# without, TCP hands the veth 64 KiB segmentation-offload bundles that cross the bridge
# whole, so a loss fault there drops dozens of segments at once, a burst that a lossy cable
# or port never makes (and that leaves one pair's share of segments sent again at 0.2 % and
# the next's at 8 % in one window).
ONE_FRAME_PER_SKB = ("gso_max_segs", "1")


class NetnsError(Exception):
    """What this machine lacks for a network-namespace cluster, or a command that failed."""


def missing() -> list[str]:
    """What a network-namespace cluster needs and this machine lacks (empty: all there)."""
    lack = []
    if os.geteuid() != 0:
        lack.append("root (network namespaces and nftables rules need it)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            lack.append(f"`{tool}` (Debian's {package} package)")
    if ray_command() is None:
        lack.append("`ray` beside this Python or on PATH (the nodes are started with `ray start`)")
    return lack


def ray_command() -> str | None:
    """Ray's CLI: the one installed beside this Python (a virtual environment's, even when
    it is not on PATH), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else shutil.which("ray")


def _run(
    *cmd: str, ns: str | None = None, stdin: str | None = None, env: dict | None = None
) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(
        full,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env} if env else None,
    )
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(full)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _free_subnet() -> str:
    """A 10.231.X prefix no interface of this machine has an address in."""
    used = _run("ip", "-4", "-o", "addr", "show")
    for _ in range(64):
        prefix = f"10.231.{secrets.randbelow(250) + 1}"
        if f" {prefix}." not in used:
            return prefix
    raise NetnsError("no free 10.231.X.0/24 subnet for the cluster's network")


@dataclass
class NetNode:
    """A worker node: its namespace, address, the root side of its veth and its raylet."""

    ns: str
    ip: str
    veth: str
    proc: subprocess.Popen | None = None
    faults: set[str] = field(default_factory=set)  # what is on its link: cut, loss, delay
    line: DelayLine | None = None  # its delay, where the kernel has no netem


class NetnsCluster:
    def __init__(self, worker_nodes: int, cpus_per_node: int = 2) -> None:
        lack = missing()
        if lack:
            raise NetnsError("a cluster with a network per node needs " + "; ".join(lack))
        self.worker_nodes, self.cpus_per_node = worker_nodes, cpus_per_node
        self.tag = f"{PREFIX}{secrets.token_hex(2)}"  # link names: at most 15 characters
        self.bridge = f"{self.tag}br"
        self.prefix = _free_subnet()
        self.head_ip = f"{self.prefix}.1"
        self.nodes: list[NetNode] = []
        self._head: subprocess.Popen | None = None
        self.port = 0
        self._logs = Path(f"/tmp/{self.tag}-logs")
        # Ray's token auth would need the same token in every driver: these nodes listen
        # on addresses only this machine's namespaces reach.
        self.env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    # --- start and stop ---------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        self._logs.mkdir(parents=True, exist_ok=True)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up", *ONE_FRAME_PER_SKB)
        with socket.socket() as s:  # a free port on the bridge's address for the GCS
            s.bind((self.head_ip, 0))
            self.port = s.getsockname()[1]
        self._head = self._ray(
            None,
            "--head",
            f"--port={self.port}",
            f"--node-ip-address={self.head_ip}",
            "--num-cpus=0",
            "--include-dashboard=false",
        )
        self._await_nodes(1)
        for _ in range(self.worker_nodes):
            self.add_node()

    def add_node(self) -> NetNode:
        """One more worker node, in a namespace of its own, registered with the head."""
        i = len(self.nodes) + 1
        node = NetNode(f"{self.tag}-n{i}", f"{self.prefix}.{10 + i}", f"{self.tag}v{i}")
        _run("ip", "netns", "add", node.ns)
        self.nodes.append(node)
        _run(
            "ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.ns
        )
        _run("ip", "link", "set", node.veth, "master", self.bridge, "up")
        _run("ip", "addr", "add", f"{node.ip}/24", "dev", "eth0", ns=node.ns)
        _run("ip", "link", "set", "eth0", "up", *ONE_FRAME_PER_SKB, ns=node.ns)
        _run("ip", "link", "set", "lo", "up", ns=node.ns)
        # No default route: the /24 is all a node reaches. With one, the name lookups its
        # processes make (torch's store logs each client's host name) would go to this
        # machine's resolver through the bridge, that forwards nothing: 10 s of DNS
        # timeouts per connection; without, they fail at once.
        self._start_raylet(node)
        return node

    def _start_raylet(self, node: NetNode) -> None:
        # One at a time: raylets starting together in one session pick the same socket names.
        node.proc = self._ray(
            node.ns,
            f"--address={self.address}",
            f"--node-ip-address={node.ip}",
            f"--num-cpus={self.cpus_per_node}",
        )
        self._await_nodes(1 + sum(1 for n in self.nodes if n.proc is not None))

    def _ray(self, ns: str | None, *args: str) -> subprocess.Popen:
        name = ns or "head"
        # No log monitor (runner.py's QUIET_HEAD says why); here every node would run one,
        # each tailing the whole session's log files (one machine, one session directory).
        cmd = [
            ray_command() or "ray",
            "start",
            "--block",
            "--disable-usage-stats",
            "--include-log-monitor=false",
            *args,
        ]
        if ns is not None:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        with open(self._logs / f"{name}.log", "w") as out:
            return subprocess.Popen(
                cmd,
                env={**os.environ, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one
            )

    def _await_nodes(self, count: int) -> None:
        """Until `count` nodes are alive in the head's node table (asked with `ray`'s
        own status command in a subprocess: this process may drive another cluster)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        code = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print('ALIVE', sum(1 for n in ray.nodes() if n['Alive']))"
        )
        while time.monotonic() < deadline:
            done = subprocess.run(
                [sys.executable, "-c", code, self.address],
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
            )
            # Ray may print its own lines to stdout (a warning): ours is marked.
            alive = [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("ALIVE ")]
            if done.returncode == 0 and alive and int(alive[-1]) >= count:
                return
            time.sleep(0.5)  # polling the head's node table, within the deadline
        raise NetnsError(
            f"the cluster's nodes did not all register within {START_TIMEOUT_S:g} s "
            f"(logs in {self._logs})"
        )

    def kill_node(self, node: NetNode) -> None:
        """Kill a worker node's raylet and everything Ray started in its namespace."""
        self._stop(node.proc)
        for pid in _run("ip", "netns", "pids", node.ns).split():
            with _suppress():
                os.kill(int(pid), signal.SIGKILL)

    def shutdown(self) -> None:
        """Stop every node, then remove the namespaces, links and addresses."""
        for node in self.nodes:
            with _suppress():
                self.heal(node)  # a delay line's thread and links first
        # Every node at once, and killed after a moment: `ray start --block` takes 30 s to
        # stop its processes on SIGTERM here, one node after another, and nothing of this
        # cluster outlives it (its processes are in its process group; what Ray started in
        # a node's namespace is killed below).
        self._stop_all([node.proc for node in self.nodes] + [self._head], SHUTDOWN_GRACE_S)
        for node in self.nodes:
            with _suppress():
                self.kill_node(node)  # what outlived its raylet in the namespace
        for node in self.nodes:
            with _suppress():
                _run("ip", "netns", "del", node.ns)
            with _suppress():
                _run("ip", "link", "del", node.veth)
        with _suppress():
            _run("ip", "link", "del", self.bridge)

    @classmethod
    def _stop(cls, proc: subprocess.Popen | None, wait_s: float = 15.0) -> None:
        cls._stop_all([proc], wait_s)

    @staticmethod
    def _stop_all(procs: list[subprocess.Popen | None], wait_s: float = 15.0) -> None:
        """SIGTERM to each `ray start --block` (it stops its processes), all at once; those
        still running `wait_s` later are killed."""
        live = [p for p in procs if p is not None and p.poll() is None]
        for proc in live:
            with _suppress():
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with _suppress():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(wait_s)

    # --- faults -----------------------------------------------------------------------------

    def partition(self, node: NetNode, peers: list[str] | None = None) -> None:
        """Cut `node` off from `peers` (addresses: other nodes', the head's), or from every
        address: all of those packets dropped, both ways (its processes live on, as on a
        real partition)."""
        if peers is None:
            match_in, match_out = 'iifname "eth0"', 'oifname "eth0"'
        else:
            ips = ", ".join(peers)
            match_in, match_out = f"ip saddr {{ {ips} }}", f"ip daddr {{ {ips} }}"
        self._table(node, "cut", f"{match_in} drop", f"{match_out} drop")

    def lose(self, node: NetNode, percent: float) -> None:
        """Drop `percent` of the frames on `node`'s link, each way, at random: on the
        bridge, as a cable or a switch port loses them, after the node's TCP sent them (a
        drop in the node's own output hook is an error TCP sees at once and sends again
        as if nothing was lost, never a retransmission its counters show). The rules live
        in the root namespace, so a heal (or shutdown) removes them; while a delay line
        carries the node's link its frames pass the bridge through the line's own link,
        which these rules do not match."""
        # numgen picks 0..9999 per frame: percent to a hundredth.
        below = max(1, round(percent * 100))
        rule = f"numgen random mod 10000 < {below} drop"
        frm, to = f'iifname "{node.veth}" {rule}', f'oifname "{node.veth}" {rule}'
        _run(
            "nft",
            "-f",
            "-",
            stdin=(
                f"table bridge {self._loss_table(node)} {{\n"
                f"  chain forward {{ type filter hook forward priority 0; {frm}; {to}; }}\n"
                f"  chain input {{ type filter hook input priority 0; {frm}; }}\n"
                f"  chain output {{ type filter hook output priority 0; {to}; }}\n"
                "}\n"
            ),
        )
        node.faults.add("loss")

    @staticmethod
    def _loss_table(node: NetNode) -> str:
        return f"{TABLE}_loss_{node.veth}"

    def delay(self, node: NetNode, ms: float, jitter_ms: float = 0.0) -> None:
        """Hold every packet `node` sends for `ms` (give or take `jitter_ms`), so both
        directions of a conversation wait once: netem on the node's side of its link,
        or, where the kernel has no netem, the link routed through a delay line in this
        process (chaos/delay_line.py)."""
        if netem_available():
            args = ["delay", f"{ms:g}ms"] + ([f"{jitter_ms:g}ms"] if jitter_ms else [])
            _run("tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *args, ns=node.ns)
        else:
            i = self.nodes.index(node) + 1
            line = DelayLine(_run, self.bridge, node.veth, f"{self.tag}d{i}", ms, jitter_ms, i)
            line.start()
            node.line = line
        node.faults.add("delay")

    def _table(self, node: NetNode, name: str, inbound: str, outbound: str) -> None:
        table = f"{TABLE}_{name}"
        _run(
            "nft",
            "-f",
            "-",
            ns=node.ns,
            stdin=(
                f"table inet {table} {{\n"
                f"  chain in {{ type filter hook input priority 0; {inbound}; }}\n"
                f"  chain out {{ type filter hook output priority 0; {outbound}; }}\n"
                "}\n"
            ),
        )
        node.faults.add(name)

    def heal(self, node: NetNode, only: str | None = None) -> None:
        """Undo every fault this module put on `node`'s link, or `only` that one (cut,
        loss, delay): faults that overlap on one node end each at its own time."""
        for name in sorted(node.faults if only is None else node.faults & {only}):
            if name == "delay" and node.line is not None:
                node.line.stop()
                node.line = None
            elif name == "delay":
                _run("tc", "qdisc", "del", "dev", "eth0", "root", ns=node.ns)
            elif name == "loss":
                _run("nft", "delete", "table", "bridge", self._loss_table(node))
            else:
                _run("nft", "delete", "table", "inet", f"{TABLE}_{name}", ns=node.ns)
            node.faults.discard(name)

    def ensure_nodes(self) -> None:
        """Start again every worker node whose raylet ended (Ray declared it dead after a
        long partition, say): in its namespace, with its address, for the next run."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                continue
            self.heal(node)
            self.kill_node(node)
            self._start_raylet(node)

    # --- which node is which ----------------------------------------------------------------

    def node_id(self, node: NetNode) -> str | None:
        """Ray's id of `node` (its raylet now), or None when it has none alive."""
        return self._ids().get(node.ip)

    def node_by_id(self, node_id: str) -> NetNode | None:
        ips = {i: ip for ip, i in self._ids().items()}
        return next((n for n in self.nodes if n.ip == ips.get(node_id)), None)

    def _ids(self) -> dict[str, str]:
        """Node address -> Ray's node id, of the nodes alive in the head's table: from
        this process's Ray connection when it is this cluster's, else a subprocess."""
        import ray

        if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
            nodes = ray.nodes()
        else:
            code = (
                "import json, ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "print('NODES', json.dumps(ray.nodes()))"
            )
            out = _run(sys.executable, "-c", code, self.address, env=self.env)
            marked = [ln for ln in out.splitlines() if ln.startswith("NODES ")]
            nodes = json.loads(marked[-1].removeprefix("NODES ")) if marked else []
        return {n["NodeManagerAddress"]: n["NodeID"] for n in nodes if n["Alive"]}


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has netem (asked once, on a throwaway namespace's loopback)."""
    ns = f"{PREFIX}probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", ns)
        _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=ns)
        return True
    except NetnsError:
        return False
    finally:
        with _suppress():
            _run("ip", "netns", "del", ns)


def _suppress() -> contextlib.AbstractContextManager:
    """Best effort on the way out: a step that fails (already gone) does not stop the rest."""
    return contextlib.suppress(OSError, NetnsError, subprocess.SubprocessError)

"""A multi-node Ray on one machine whose worker nodes each have a network of their own.

Faults of the network are real only if the nodes talk over a network: here each worker
node runs in its own Linux network namespace, wired to a bridge in the root namespace by
a veth pair, with an address of its own in a private /24 that only these namespaces use.
The head (`ray start --head`, no CPUs: the driver's and the supervisor's node) listens on
the bridge's address. A fault cuts or degrades one node's link with nftables rules in its
namespace, so every socket of that node (raylet, workers, stalwart's agent and channel)
sees it, as on a real network, and nothing in stalwart's code is told.

Needs root, iproute2's `ip` and nftables' `nft` (`apt-get install nftables`); refused with
what is missing otherwise, never a silent no-op. Tests start one per module; a user can
start one for their own chaos runs on one machine:

    with NetnsCluster(worker_nodes=3) as cluster:
        # drivers need cluster.env (Ray's token auth off for these loopback-only nodes)
        subprocess.run(["stalwart", "run", "job.yaml", "--address", cluster.address],
                       env={**os.environ, **cluster.env})
"""

from __future__ import annotations

import contextlib
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

PREFIX = "stw"  # of every namespace, link and nft table this module makes
TABLE = "stalwart_chaos"  # the nft table a fault adds in a node's namespace
START_TIMEOUT_S = 60.0


class NetnsError(Exception):
    """What this machine lacks for a network-namespace cluster, or a command that failed."""


def missing() -> list[str]:
    """What a network-namespace cluster needs and this machine lacks (empty: all there)."""
    lack = []
    if os.geteuid() != 0:
        lack.append("root (network namespaces and nftables rules need it)")
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            lack.append(f"`{tool}` (Debian's {package} package)")
    if shutil.which("ray") is None:
        lack.append("`ray` on PATH (the nodes are started with `ray start`)")
    return lack


def _run(*cmd: str, ns: str | None = None, stdin: str | None = None) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=30)
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
    partitioned: bool = field(default=False)


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
        _run("ip", "link", "set", self.bridge, "up")
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
        _run("ip", "link", "set", "eth0", "up", ns=node.ns)
        _run("ip", "link", "set", "lo", "up", ns=node.ns)
        _run("ip", "route", "add", "default", "via", self.head_ip, ns=node.ns)
        # One at a time: raylets starting together in one session pick the same socket names.
        node.proc = self._ray(
            node.ns,
            f"--address={self.address}",
            f"--node-ip-address={node.ip}",
            f"--num-cpus={self.cpus_per_node}",
        )
        self._await_nodes(1 + sum(1 for n in self.nodes if n.proc is not None))
        return node

    def _ray(self, ns: str | None, *args: str) -> subprocess.Popen:
        name = ns or "head"
        cmd = ["ray", "start", "--block", "--disable-usage-stats", *args]
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
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        while time.monotonic() < deadline:
            done = subprocess.run(
                [sys.executable, "-c", code, self.address],
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
            )
            lines = done.stdout.split()
            if done.returncode == 0 and lines and int(lines[-1]) >= count:
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
                self.kill_node(node)
        self._stop(self._head)
        for node in self.nodes:
            with _suppress():
                _run("ip", "netns", "del", node.ns)
            with _suppress():
                _run("ip", "link", "del", node.veth)
        with _suppress():
            _run("ip", "link", "del", self.bridge)

    @staticmethod
    def _stop(proc: subprocess.Popen | None, wait_s: float = 15.0) -> None:
        if proc is None or proc.poll() is not None:
            return
        with _suppress():
            os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops its processes
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(wait_s)

    # --- faults -----------------------------------------------------------------------------

    def partition(self, node: NetNode) -> None:
        """Cut `node` off from every other node and the head: all of its packets dropped,
        both ways (its processes live on, as on a real partition)."""
        _run(
            "nft",
            "-f",
            "-",
            ns=node.ns,
            stdin=(
                f"table inet {TABLE} {{\n"
                '  chain in { type filter hook input priority 0; iifname "eth0" drop; }\n'
                '  chain out { type filter hook output priority 0; oifname "eth0" drop; }\n'
                "}\n"
            ),
        )
        node.partitioned = True

    def heal(self, node: NetNode) -> None:
        """Undo `node`'s partition (or any fault this module put on its link)."""
        if node.partitioned:
            _run("nft", "delete", "table", "inet", TABLE, ns=node.ns)
            node.partitioned = False


def _suppress() -> contextlib.AbstractContextManager:
    """Best effort on the way out: a step that fails (already gone) does not stop the rest."""
    return contextlib.suppress(OSError, NetnsError, subprocess.SubprocessError)

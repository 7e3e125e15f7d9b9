"""orchestrator/chaos/netns.py on this machine: a Ray whose worker nodes each have a
network namespace of their own, and a partition that is real at the socket level (nft
rules in the node's namespace): the head cannot reach the cut-off node's actors while the
other node's answer, and a heal before Ray gives up on the node brings it back. The
namespaces, links and processes are gone afterwards. Root, `ip` and `nft` are installed by
the README's test command (scripts/test.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stalwart.orchestrator.chaos import netns
from stalwart.orchestrator.chaos.netns import NetnsCluster, NetnsError

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

PROBE = """
import sys, time, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=0)
class Where:
    def ip(self):
        return ray.util.get_node_ip_address()

nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")),
               key=lambda n: n["NodeManagerAddress"])
on = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
actors = [Where.options(scheduling_strategy=s).remote() for s in on]
print("IPS", ray.get([a.ip.remote() for a in actors], timeout=60), flush=True)
assert sys.stdin.readline().strip() == "cut"
ready, _ = ray.wait([actors[0].ip.remote()], timeout=4)
print("CUT_ANSWERS", bool(ready), ray.get(actors[1].ip.remote(), timeout=10), flush=True)
assert sys.stdin.readline().strip() == "healed"
print("HEALED", ray.get(actors[0].ip.remote(), timeout=30), flush=True)
"""


def test_a_node_cut_off_by_a_partition_answers_again_once_healed():
    with NetnsCluster(worker_nodes=2) as cluster:
        first, second = cluster.nodes
        assert {first.ip, second.ip} == {f"{cluster.prefix}.11", f"{cluster.prefix}.12"}
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, cluster.address],
            env={**os.environ, **cluster.env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ips = probe.stdout.readline().strip().split(maxsplit=1)
        assert ips == ["IPS", f"{[first.ip, second.ip]}"]
        cluster.partition(first)
        probe.stdin.write("cut\n")
        probe.stdin.flush()
        # The cut-off node does not answer; the other one does.
        assert probe.stdout.readline().split() == ["CUT_ANSWERS", "False", second.ip]
        cluster.heal(first)
        probe.stdin.write("healed\n")
        probe.stdin.flush()
        assert probe.stdout.readline().split() == ["HEALED", first.ip]
        assert probe.wait(timeout=30) == 0
        namespaces = [first.ns, second.ns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert cluster.tag not in links, links


def test_without_the_tools_it_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "nft" else "/x")
    with pytest.raises(NetnsError) as e:
        NetnsCluster(worker_nodes=1)
    assert str(e.value) == (
        "a cluster with a network per node needs `nft` (Debian's nftables package)"
    )

"""Faults of the network on a Ray whose worker nodes each have a network namespace of their
own (orchestrator/chaos/netns.py): the example scenarios through the runner of `stalwart
chaos run`, their verdicts the assertion (finished, the failure-free digest, and what each
expects: a replacement within its bounds, or none at all).

One NetnsCluster for the module (3 worker nodes of 2 CPUs); the session's baseline cache
(tests/chaos/conftest.py: the 600-step job's failure-free run is timed.yaml's too).
partition.yaml runs alone (the cut-off node's ranks are replaced while it is cut; it heals
during the next generation); network.yaml holds the faults of loss.yaml,
partition-healed-early.yaml and flap.yaml in one job; delay.yaml alone (netem where the
kernel has it, else the delay line of orchestrator/chaos/delay_line.py, as here).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from stalwart.orchestrator.chaos.netns import NetnsCluster
from stalwart.orchestrator.chaos.runner import ChaosOptions, run_scenario
from stalwart.orchestrator.chaos.scenario import load_scenario
from stalwart.orchestrator.driver import ChaosRefused
from stalwart.orchestrator.observe.logs import log_files, parse_line
from tests.chaos.test_scenarios import EXAMPLES, _failed, _of, run_example

pytestmark = [pytest.mark.component, pytest.mark.timeout(900)]

# scenario run -> the scenarios whose faults it holds (their own runs would repeat it).
RUN = {
    "partition": (),
    "network": ("loss", "partition-healed-early", "flap"),
    "delay": (),
    "partition-supervisor": (),
}


@pytest.fixture(scope="module")
def netns():
    with NetnsCluster(worker_nodes=3) as cluster:
        yield cluster
    # Stopped: its namespaces, links and processes are gone.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n.ns in listed for n in cluster.nodes), listed
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert cluster.tag not in links, links


# Asks the nodes where they are, through actors pinned there, before, during and after a
# partition of the first (a driver of its own: this process may drive another cluster).
PROBE = """
import sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=0)
class Where:
    def ip(self):
        return ray.util.get_node_ip_address()

nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")),
               key=lambda n: n["NodeManagerAddress"])
on = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes[:2]]
actors = [Where.options(scheduling_strategy=s).remote() for s in on]
print("IPS", ray.get([a.ip.remote() for a in actors], timeout=60), flush=True)
assert sys.stdin.readline().strip() == "cut"
ready, _ = ray.wait([actors[0].ip.remote()], timeout=4)
print("CUT_ANSWERS", bool(ready), ray.get(actors[1].ip.remote(), timeout=10), flush=True)
assert sys.stdin.readline().strip() == "healed"
print("HEALED", ray.get(actors[0].ip.remote(), timeout=30), flush=True)
"""


def test_a_node_cut_off_by_a_partition_answers_again_once_healed(netns):
    """The partition is real at the socket level (nft rules in the node's namespace): the
    head cannot reach the cut-off node's actors while the other node's answer, and a heal
    before Ray gives up on the node brings it back."""
    netns.ensure_nodes()
    first, second = netns.nodes[:2]
    assert (first.ip, second.ip) == (f"{netns.prefix}.11", f"{netns.prefix}.12")
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, netns.address],
        env={**os.environ, **netns.env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert probe.stdout.readline().strip().split(maxsplit=1) == [
            "IPS",
            f"{[first.ip, second.ip]}",
        ]
        netns.partition(first)
        probe.stdin.write("cut\n")
        probe.stdin.flush()
        assert probe.stdout.readline().split() == ["CUT_ANSWERS", "False", second.ip]
        netns.heal(first)
        assert first.faults == set()
        probe.stdin.write("healed\n")
        probe.stdin.flush()
        assert probe.stdout.readline().split() == ["HEALED", first.ip]
        assert probe.wait(timeout=30) == 0
    finally:
        probe.kill()
        netns.heal(first)


def _run(name, netns, cache, tmp_path):
    netns.ensure_nodes()
    return run_example(name, netns.address, cache, tmp_path, netns=netns)[1:]


def test_a_partitioned_nodes_ranks_are_replaced_and_the_healed_node_is_not_rejoined(
    netns, cache, tmp_path
):
    verdict, result, events = _run("partition", netns, cache, tmp_path)
    assert verdict.passed, _failed(verdict)
    outage, row = verdict.faults
    assert outage.kind == "storage_unavailable" and outage.outcome == "injected"
    assert row.outcome == "injected" and row.target.endswith("(rank 1)")
    # Its node's ranks: found silent, replaced on the others from the copies in memory.
    assert row.failures >= 1 and {f["kind"] for f in result["failures"]} == {"node_lost"}
    [lost] = _of(events, "node_lost")
    assert "agent silent" in lost["reason"]
    assert row.restored_step is not None and row.tiers.get("memory")
    # It healed while the next generation trained; nothing put a rank back there.
    healed = json.loads((tmp_path / "partition" / "verdict.json").read_text())["faults"][1]
    assert healed["noticed"].startswith("1 window(s)")
    assert result["generations"] == 2
    placed = [r["node"] for e in _of(events, "replaced") for r in e["ranks"].values()]
    assert placed and lost["node"] not in placed
    # The write of step 40, retrying against the failed storage when the cut came, was
    # generation 1's, the cut-off node one of its writers: dropped when the node was found
    # lost (not left for the other writers' retries to run out into a persist_failed), and
    # the store holds only steps committed by the generation running then (the verdict
    # read it).
    [dropped] = _of(events, "persist_fenced")
    assert dropped["generation"] == 1 and dropped["path"] == "durable"
    [fenced] = [c for c in verdict.checks if c.name == "no write from a fenced generation"]
    assert fenced.ok and "durable (1 event)" in fenced.detail, fenced.detail
    assert result["persist"]["persisted"], result["persist"]


def test_a_job_rides_out_loss_a_short_cut_and_a_flapping_link(netns, cache, tmp_path):
    verdict, result, events = _run("network", netns, cache, tmp_path)
    assert verdict.passed, _failed(verdict)
    assert [r.outcome for r in verdict.faults] == ["injected"] * 3
    assert result["failures"] == [] and result["generations"] == 1
    assert _of(events, "node_lost") == [] and _of(events, "hang") == []
    flap = verdict.faults[2]
    assert flap.noticed.startswith("3 window(s)")
    # The lossy link is named (health/lossy_link.py) by the TCP segments sent again on its
    # node's links, which its round trips did not show: rank 1's node, first, and cleared.
    lossy = [e for e in _of(events, "slow_link") if e["signal"] == "loss"]
    assert lossy and 1 in lossy[0]["ranks"], lossy
    assert lossy[0]["loss"] >= 0.01 and lossy[0]["loss"] > 2 * lossy[0]["peers_loss"], lossy[0]
    assert "sent again" in lossy[0]["reason"] and "alert only" in lossy[0]["decision"]
    cleared = [e for e in _of(events, "slow_link_cleared") if e["signal"] == "loss"]
    assert lossy[0]["node"] in [e["node"] for e in cleared], cleared
    assert lossy[0]["node"] in {s["node"] for s in result["slow_links"] if s["signal"] == "loss"}


def test_a_delayed_link_slows_the_job_and_nothing_is_replaced(netns, cache, tmp_path):
    """200 ms on every packet one node sends (netem, or this machine's delay line): the
    job trains on, slower while it lasts, with no node lost, no hang and no straggler
    (compute time is what a straggler is judged by, and the node computes as fast). The
    slow link is named: the delayed rank's node, by its report round trips, once."""
    verdict, result, events = _run("delay", netns, cache, tmp_path)
    assert verdict.passed, _failed(verdict)
    assert result["failures"] == [] and result["generations"] == 1
    for kind in ("node_lost", "hang", "straggler"):
        assert _of(events, kind) == [], kind
    [slow] = [e for e in _of(events, "slow_link") if e["signal"] == "round_trip"]
    assert 1 in slow["ranks"], slow  # delay.yaml's rank
    # The delay's first round trips may be sent again (TCP's timer fires before the first
    # delayed answers): if that reads as a lossy link, it is the same node's.
    assert {e["node"] for e in _of(events, "slow_link")} == {slow["node"]}
    assert slow["rtt_s"] >= 0.2 > slow["peers_rtt_s"] * 3, slow
    assert "alert only" in slow["decision"]
    assert [s["node"] for s in result["slow_links"] if s["signal"] == "round_trip"] == [
        slow["node"]
    ]
    [cleared] = [e for e in _of(events, "slow_link_cleared") if e["signal"] == "round_trip"]
    assert cleared["node"] == slow["node"] and cleared["ts"] > slow["ts"]
    rates = sorted(e["steps_per_s"] for e in _of(events, "throughput") if e.get("steps_per_s"))
    assert rates[0] < rates[len(rates) // 2] / 3, rates  # the delayed stretch


def test_the_supervisors_node_cut_off_from_every_worker_loses_no_node(netns, cache, tmp_path):
    """Every agent silent at once is the supervisor's own link (health.isolated_timeout_s):
    nothing is replaced, the ranks train on among themselves, and once the link is back a
    node whose answer is still on its way gets its own heartbeat timeout."""
    verdict, result, events = _run("partition-supervisor", netns, cache, tmp_path)
    assert verdict.passed, _failed(verdict)
    assert result["failures"] == [] and result["lost_nodes"] == []
    [isolated] = _of(events, "supervisor_isolated")
    assert "this supervisor's own link, not 3 nodes lost" in isolated["reason"]
    assert len(_of(events, "supervisor_reconnected")) == 1
    # The ranks went on training while the supervisor heard nothing: one printed a step
    # past the newest the supervisor had heard of, stamped (by the rank) while the cut was
    # held. Not the supervisor's own view after the heal: TCP resends what the cut held
    # back in its own time, so its first news may still be of the step it last heard
    # (CI, 2026-12-07: the first throughput event after the reconnection read 51 -> 51).
    [row] = verdict.faults
    [(start, end)] = row.windows
    before = max(e["step"] for e in _of(events, "throughput") if e["ts"] <= isolated["ts"])
    lines = _rank_lines(tmp_path / "partition-supervisor" / "chaos")
    during = [(ts, step) for ts, step in lines if start < ts < end and step > before]
    assert during, (before, start, end, lines)


def _rank_lines(run_dir):
    """(time, step) of every "step N: loss" line the ranks printed (RUN_DIR/logs/rank-R.log,
    stamped by the rank when it printed)."""
    out = []
    for log in log_files(run_dir):
        for parsed in filter(None, map(parse_line, log.read_text().splitlines())):
            m = re.match(r"step (\d+): loss", parsed[3])
            if m:
                out.append((datetime.datetime.fromisoformat(parsed[0]).timestamp(), int(m[1])))
    return out


def test_network_faults_are_refused_on_a_cluster_without_namespaces(tmp_path):
    sc = load_scenario(EXAMPLES / "partition.yaml")
    opts = ChaosOptions(output=tmp_path, address="127.0.0.1:1", owns_cluster=True)
    with pytest.raises(ChaosRefused) as e:
        run_scenario(sc, opts)
    assert "partition faults are carried out on a cluster whose nodes have networks" in str(e.value)

"""Peer copies and peer restores over the agents' channel (orchestrator/agent/channel.py) on a
real Ray: two node agents, the copy of a shard sent by the replicator over the channel, a
restore fetch over it, and the Ray path for a peer that has no channel."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]


@pytest.fixture
def connected(ray_address):
    import ray

    ray.init(address=ray_address, namespace="stalwart-channel-test", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _snap(step: int):
    from stalwart.ckpt.snapshot import SnapshotBuffer

    state = {"w": torch.arange(1 << 20, dtype=torch.float32) * step, "step": step}
    snap = SnapshotBuffer().capture(step, state)
    snap.checksum = snap.payload_checksum()
    return snap


def _agent(ray, name: str, shm_root: str):
    from stalwart.orchestrator.agent.actor import NodeAgent

    return (
        ray.remote(NodeAgent)
        .options(num_cpus=0, max_concurrency=32)
        .remote(name * 8, "channel-test", shm_root=shm_root, lease_s=None)
    )


def _until(cond, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


def test_copies_and_restores_go_over_the_channel(connected, tmp_path):
    from stalwart.orchestrator.agent.channel import fetch_from_agent

    ray = connected
    here = ray.util.get_node_ip_address()
    a, b = _agent(ray, "a", str(tmp_path)), _agent(ray, "b", str(tmp_path))
    try:
        address = ray.get(b.channel_address.remote(here))
        assert address["host"] == "127.0.0.1"  # every caller is on this machine
        ray.get(a.set_peers.remote({"b": b}))
        snap = _snap(3)
        ray.get(a.put_shard.remote(0, snap))
        _until(lambda: ray.get(b.report.remote())["replicas"] == {0: [3]})
        rep = _until(lambda: (r := ray.get(a.report.remote())["replication"])["rounds"] and r)
        assert rep["sends"]["channel"] == 1 and rep["sends"]["ray"] == 0, rep
        assert rep["errors"] == 0 and rep["sent_bytes"] == snap.nbytes
        assert ray.get(b.get_shard.remote(0, 3)).digest() == snap.digest()
        # A restore from b (a peer of the restoring rank's node) over b's channel.
        got = fetch_from_agent(b, 0, 3, 30.0, here)
        assert got.digest() == snap.digest() and got.intact()
        assert fetch_from_agent(b, 0, 99, 30.0, here) is None
    finally:
        ray.get([x.close.remote() for x in (a, b)])


def test_a_peer_without_a_channel_gets_its_copies_through_ray(connected, tmp_path):
    ray = connected

    @ray.remote(num_cpus=0)
    class OldAgent:  # an agent without the channel (put_replica: the copy and its writer)
        def __init__(self):
            self.held = {}

        def put_replica(self, rank, snapshot, generation=None):
            self.held[(rank, snapshot.step)] = snapshot.digest()

        def held_digests(self):
            return self.held

    a, old = _agent(ray, "c", str(tmp_path)), OldAgent.remote()
    try:
        ray.get(a.set_peers.remote({"old": old}))
        snap = _snap(5)
        ray.get(a.put_shard.remote(1, snap))
        assert _until(lambda: ray.get(old.held_digests.remote())) == {(1, 5): snap.digest()}
        rep = ray.get(a.report.remote())["replication"]
        assert rep["sends"] == {"channel": 0, "ray": 1, "urgent": 0}, rep
        assert rep["errors"] == 0 and "no channel" in rep["last_channel_error"]
    finally:
        ray.get(a.close.remote())

"""The rendezvous store listens on the address its workers use and on no other interface."""

from __future__ import annotations

import socket

import pytest
import ray

from stalwart.orchestrator.supervisor.generation import open_rendezvous

pytestmark = pytest.mark.timeout(60)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def test_a_rendezvous_of_workers_on_this_machine_listens_on_loopback_only():
    here = ray.util.get_node_ip_address()
    assert here != "127.0.0.1", "needs a machine with an address besides loopback"
    store, info = open_rendezvous([{"node_ip": here}, {"node_ip": here}], timeout_s=10)
    assert info["host"] == "127.0.0.1" and info["gloo_host"] == "127.0.0.1"
    assert _answers("127.0.0.1", info["port"]) and not _answers(here, info["port"])
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_a_rendezvous_across_nodes_listens_on_the_nodes_address_only():
    here = ray.util.get_node_ip_address()
    _store, info = open_rendezvous([{"node_ip": here}, {"node_ip": "10.255.0.9"}], timeout_s=10)
    assert info["host"] == here and "gloo_host" not in info
    assert _answers(here, info["port"]) and not _answers("127.0.0.1", info["port"])

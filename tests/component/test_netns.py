"""orchestrator/chaos/netns.py's refusal: without root or the tools a network-namespace
cluster is refused, naming what is missing (never a silent no-op). The cluster itself, a
partition at the socket level and its clean-up: tests/chaos/test_network.py."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.chaos import netns
from stalwart.orchestrator.chaos.netns import NetnsCluster, NetnsError

pytestmark = [pytest.mark.component, pytest.mark.timeout(60)]


def test_without_the_tools_it_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "nft" else "/x")
    with pytest.raises(NetnsError) as e:
        NetnsCluster(worker_nodes=1)
    assert str(e.value) == (
        "a cluster with a network per node needs `nft` (Debian's nftables package)"
    )


def test_a_heal_undoes_only_its_own_fault_on_a_node(monkeypatch):
    """Faults that overlap on one node (a loss, then a cut) end each at its own time: the
    commands a heal runs, without a cluster."""
    ran: list[tuple] = []
    monkeypatch.setattr(netns, "_run", lambda *cmd, ns=None, **kw: ran.append((ns, cmd)) or "")
    cluster = object.__new__(NetnsCluster)
    node = netns.NetNode("stwx-n1", "10.231.9.11", "stwxv1", faults={"cut", "loss"})
    cluster.heal(node, only="cut")
    assert ran == [("stwx-n1", ("nft", "delete", "table", "inet", "stalwart_chaos_cut"))]
    assert node.faults == {"loss"}
    cluster.heal(node, only="delay")  # not on it: nothing to undo
    assert len(ran) == 1
    cluster.heal(node)
    # A loss lives on the bridge, in the root namespace (netns.lose).
    assert ran[-1] == (None, ("nft", "delete", "table", "bridge", "stalwart_chaos_loss_stwxv1"))
    assert node.faults == set()

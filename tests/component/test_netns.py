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

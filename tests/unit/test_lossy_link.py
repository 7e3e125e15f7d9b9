"""health/lossy_link.py and supervisor/losses.py: which node's link drops packets, from the
TCP segments each node (and the supervisor's) sent again, per peer; agent/tcp_stats.py's
read of the kernel's counters (sock_diag, real sockets)."""

from __future__ import annotations

import socket

import pytest

from stalwart.health.lossy_link import LossConfig, lossy_nodes, lossy_window, pair_counts
from stalwart.orchestrator.agent.tcp_stats import TcpStats
from stalwart.orchestrator.supervisor.losses import LossWatch

pytestmark = pytest.mark.timeout(30)

CFG = LossConfig(threshold=0.01, min_segments=200, window_s=5.0, consecutive_windows=2)


def _views(lossy: str | None, nodes=("a", "b", "c", "s"), sent=1000, rate=0.05):
    """Every node sends `sent` data segments to every other; the links of `lossy` lose
    `rate` of them, sent again by whichever end sent them."""
    views = {}
    for me in nodes:
        views[me] = {}
        for peer in nodes:
            if peer != me:
                again = int(sent * rate) if lossy in (me, peer) else 0
                views[me][peer] = (sent, again)
    return views


def test_the_node_on_every_lossy_link_is_named_and_its_peers_are_not():
    w = lossy_window(_views("b"), CFG)
    assert w.named == ("b",)
    assert w.rates[("a", "b")] == 0.05 and w.rates[("a", "c")] == 0.0
    assert w.node_rates["b"] == 0.05 and w.node_rates["a"] == pytest.approx(0.0167, abs=1e-4)


def test_a_burst_that_leaves_one_link_of_the_lossy_node_clean_names_it_and_not_its_peer():
    """A window read off a 4-node job with 5 % loss on node b's link: b's link to a read
    clean by chance (the losses came in bursts), its link to c carried most of the data.
    b is named (2 of its 3 measured links lossy, 3.8 % over all of them); c is not, though
    its one lossy link, to b, carried most of its data too (1 of 2; a and c each sent s
    too few segments to be measured)."""
    views = {
        "a": {"b": (1200, 3), "c": (1100, 0), "s": (60, 0)},
        "b": {"a": (1287, 2), "c": (4300, 210), "s": (110, 4)},
        "c": {"a": (1236, 0), "b": (4381, 215), "s": (100, 0)},
        "s": {"a": (76, 0), "b": (106, 3), "c": (96, 0)},
    }
    w = lossy_window(views, CFG)
    assert w.named == ("b",)
    assert w.links == {"a": (0, 2), "b": (2, 3), "c": (1, 2), "s": (1, 1)}
    assert w.node_rates["b"] == pytest.approx(0.0384, abs=1e-4)
    assert w.node_rates["c"] >= CFG.threshold  # its share is high; it is not named
    named, why = lossy_nodes([w, w], CFG)
    assert named == ("b",) and "sent again 3.8% of the data segments" in why
    assert "(2 of its 3 measured links lossy, threshold 1.0%; 0.0% on the links" in why
    assert w.rest_rates["b"] == 0.0 and w.rest_rates["c"] == pytest.approx(0.0044, abs=1e-4)


def test_both_ends_of_a_pair_count_and_small_pairs_are_not_judged():
    pairs = pair_counts({"a": {"b": (100, 3)}, "b": {"a": (150, 4), "b": (9, 9)}})
    assert pairs == {("a", "b"): [250, 7]}
    quiet = _views("b", sent=50)  # 100 segments a pair in the window: not measured
    assert lossy_window(quiet, CFG).rates == {} and lossy_window(quiet, CFG).named == ()


def test_two_nodes_alone_or_every_link_lossy_names_nobody():
    two = lossy_window(_views("a", nodes=("a", "b")), CFG)
    assert two.rates == {("a", "b"): 0.05} and two.named == ()
    everything = {me: {p: (1000, 40) for p in "abc" if p != me} for me in "abc"}
    assert lossy_window(everything, CFG).named == ()


def test_a_node_is_flagged_only_in_consecutive_windows_with_the_reason():
    lossy, clean = lossy_window(_views("c"), CFG), lossy_window(_views(None), CFG)
    assert lossy_nodes([lossy], CFG)[0] == ()
    assert lossy_nodes([clean, lossy], CFG)[0] == ()
    named, why = lossy_nodes([lossy, lossy], CFG)
    assert named == ("c",)
    assert why.startswith("node c sent again 5.0% of the data segments on its links")
    assert "in 2 consecutive windows of 5 s" in why
    assert lossy_nodes([clean, clean], CFG)[1].startswith("no lossy link (highest: node")


def _report(node, ip, counts):
    return {"node": node, "ip": ip, "tcp": counts}


def test_the_watch_turns_addresses_into_nodes_flags_once_and_clears():
    """Agents' cumulative counters per peer address, the supervisor's node's own read; the
    windows' growth is judged; a flag is news once and its end once."""
    ips = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "s": "10.0.0.9"}
    totals = {n: {ips[p]: [0, 0] for p in ips if p != n} for n in ips}

    def advance(lossy):
        for me, peers in totals.items():
            for ip, t in peers.items():
                peer = next(n for n, a in ips.items() if a == ip)
                t[0] += 1000
                t[1] += 50 if lossy in (me, peer) else 0

    def reports():
        return [_report(n, ips[n], {k: tuple(v) for k, v in totals[n].items()}) for n in "abc"]

    watch = LossWatch(
        CFG, own=("s", ips["s"], lambda: {k: tuple(v) for k, v in totals["s"].items()})
    )
    events = []
    for t, lossy in enumerate(["b", "b", "b", "b", None, None, None]):
        watch.absorb(reports())
        verdict = watch.judge(5.0 * t)
        if verdict is not None:
            events.append((verdict[0], verdict[1]))
        if t == 2:  # each node's own share of segments sent again, every peer
            assert watch.sent_again == {"a": 0.0167, "b": 0.05, "c": 0.0167, "s": 0.0167}
        advance(lossy)
    # The first judge opens the window; then one verdict per window.
    assert events == [([], []), (["b"], []), ([], []), ([], []), ([], []), ([], ["b"])]
    assert watch.flagged == {}


def test_nodes_sharing_one_address_are_not_judged():
    watch = LossWatch(CFG, own=("s", "10.0.0.1", lambda: {}))
    watch.absorb([_report("a", "10.0.0.1", {}), _report("b", "10.0.0.1", {})])
    watch.judge(0.0)
    watch.absorb([_report("a", "10.0.0.1", {"10.0.0.1": (5000, 500)})])
    assert watch.judge(6.0)[0] == [] and watch.last.rates == {}


def test_a_lost_nodes_address_is_free_for_the_node_that_takes_it_next():
    watch = LossWatch(CFG)
    watch.absorb([_report("a", "10.0.0.1", {}), _report("b", "10.0.0.2", {})])
    watch.forget("b")
    watch.absorb([_report("b2", "10.0.0.2", {})])  # a restarted raylet, the same address
    assert watch._node_of == {"10.0.0.1": "a", "10.0.0.2": "b2"} and not watch._shared


def test_the_kernels_counters_are_read_for_real_connections():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        stats = TcpStats(min_interval_s=0)
        port = client.getsockname()[1]
        before = [s for s in stats._read() if s[0][1] == port]
        for _ in range(20):
            client.send(b"x" * 100)
            accepted.recv(1000)
        after = [s for s in stats._read() if s[0][1] == port]
        assert len(before) == len(after) == 1
        assert after[0][1] - before[0][1] == 20 and after[0][2] == 0  # sent, none again
        # Loopback is within the node: never a peer (other tests' connections may be).
        counts = stats.report()
        assert stats.error is None and not any(p.startswith("127.") for p in counts)
    finally:
        for s in (client, accepted, server):
            s.close()

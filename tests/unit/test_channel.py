"""The agents' direct channel (orchestrator/agent/channel.py): two ends in one process on
127.0.0.1, no Ray."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from stalwart.ckpt.snapshot import SnapshotBuffer
from stalwart.orchestrator.agent import channel as ch
from stalwart.orchestrator.agent.channel import ChannelError, ChannelServer, PeerLink, StaleCopy
from stalwart.orchestrator.agent.replication import ReplicaStore

pytestmark = pytest.mark.timeout(60)
HERE = "127.0.0.1"


def _snap(step: int, nbytes: int = 1 << 20):
    state = {
        "step": step,
        "w": torch.arange(nbytes // 8, dtype=torch.float64) + step,
        "note": f"at {step}",
    }
    snap = SnapshotBuffer().capture(step, state)
    snap.checksum = snap.payload_checksum()
    return snap


class _Agent:
    """What an agent hands its channel: a replica store to put into, shards to get."""

    def __init__(self, key: bytes | None = None):
        self.replicas = ReplicaStore()
        self.own: dict[tuple[int, int], object] = {}
        self.server = ChannelServer(
            key or os.urandom(ch.KEY_BYTES),
            on_put=self.replicas.adopt,
            on_get=self._get,
            reserve=self.replicas.reserve,
            here=HERE,
            timeout_s=5.0,
        )

    def _get(self, rank: int, step: int):
        return self.own.get((rank, step)) or self.replicas.get(rank, step)


@pytest.fixture
def agent():
    a = _Agent()
    yield a
    a.server.close()


def test_listens_on_loopback_for_a_caller_on_this_machine():
    assert ch.bind_host("192.0.2.2", "192.0.2.2") == "127.0.0.1"
    assert ch.bind_host("127.0.0.1", "192.0.2.9") == "127.0.0.1"
    assert ch.bind_host("192.0.2.2", "192.0.2.9") == "192.0.2.2"


def test_put_and_get_round_trip_bit_exact(agent):
    address = agent.server.address(HERE)
    assert address["host"] == HERE and address["port"] > 0
    link = PeerLink(address)
    snaps = [_snap(s) for s in (4, 8)]
    for snap in snaps:
        link.put(3, snap, timeout_s=10)  # the same connection twice
    assert agent.replicas.stored() == {3: [4, 8]}
    held = agent.replicas.get(3, 8)
    assert held.digest() == snaps[1].digest() and held.intact()
    back = PeerLink(address).get(3, 4, timeout_s=10)
    assert back.digest() == snaps[0].digest() and back.checksum == snaps[0].checksum
    assert PeerLink(address).get(3, 99, timeout_s=10) is None  # not held: nothing, no error
    link.close()


def test_a_put_reads_into_the_replica_stores_own_buffer(agent):
    # The buffer of a dropped copy is taken again: the payload lands in place, no copy.
    link = PeerLink(agent.server.address(HERE))
    link.put(0, _snap(1), timeout_s=10)
    first = agent.replicas.get(0, 1).payload
    agent.replicas.drop_below(2)
    link.put(0, _snap(2), timeout_s=10)
    assert agent.replicas.get(0, 2).payload is first


def test_a_wrong_key_is_refused_and_given_nothing(agent):
    agent.own[(0, 1)] = _snap(1)
    address = {**agent.server.address(HERE), "key": os.urandom(ch.KEY_BYTES)}
    with pytest.raises(ChannelError, match="refused: not authenticated"):
        PeerLink(address).get(0, 1, timeout_s=5)
    with pytest.raises(ChannelError, match="not authenticated"):
        PeerLink(address).put(0, _snap(2), timeout_s=5)
    assert agent.replicas.stored() == {}


def test_a_server_without_the_key_is_not_trusted(agent):
    # A caller checks the server's proof too: an impostor on the port gets no shard.
    impostor = ChannelServer(os.urandom(ch.KEY_BYTES), lambda r, s: None, lambda r, s: None)
    try:
        address = {**impostor.address(HERE), "key": agent.server.address(HERE)["key"]}
        with pytest.raises(ChannelError):
            PeerLink(address).put(0, _snap(1), timeout_s=5)
    finally:
        impostor.close()


def test_a_corrupted_payload_is_refused(agent):
    snap = _snap(5)
    snap.checksum ^= 1  # the bytes no longer match what the sender says they are
    link = PeerLink(agent.server.address(HERE))
    with pytest.raises(ChannelError, match="checksum does not match"):
        link.put(0, snap, timeout_s=10)
    assert agent.replicas.stored() == {}
    # A corrupt shard held by the server is refused on the fetching side too.
    agent.own[(0, 5)] = snap
    with pytest.raises(ChannelError, match="checksum does not match"):
        PeerLink(agent.server.address(HERE)).get(0, 5, timeout_s=10)
    link.put(0, _snap(6), timeout_s=10)  # the link reconnects after an error
    assert agent.replicas.stored() == {0: [6]}


def _fake_server(behaviour: str):
    """A peer that authenticates, then dies or stalls half-way through a transfer."""
    key = os.urandom(ch.KEY_BYTES)
    listener = socket.create_server((HERE, 0))
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            ours = os.urandom(ch.NONCE_BYTES)
            ch._send(conn, None, {"v": 1, "nonce": ours.hex()})
            theirs = bytes.fromhex(ch._recv(conn, None)["nonce"])
            proof = ch._mac(key, b"server", ours, theirs).hex()
            ch._send(conn, None, {"ok": True, "mac": proof})
            head = ch._recv(conn, None)
            if head["op"] == "get":
                n = 8 << 20
                fields = {"step": 1, "metas": 2, "skel": 0, "nbytes": n, "checksum": 0}
                ch._send(conn, None, {"ok": True, "found": True, **fields}, b"[]", b"")
                conn.sendall(bytes(n // 2))
            else:
                conn.recv(1 << 16)
            if behaviour == "stall":
                stop.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = {"host": HERE, "port": listener.getsockname()[1], "key": key}
    return address, listener, stop


@pytest.mark.parametrize("behaviour", ["die", "stall"])
@pytest.mark.parametrize("op", ["get", "put"])
def test_a_peer_that_dies_or_stalls_mid_transfer_is_an_error_within_the_timeout(op, behaviour):
    address, listener, stop = _fake_server(behaviour)
    try:
        link = PeerLink(address)
        t0 = time.monotonic()
        kind = ch.ChannelTimeout if behaviour == "stall" else ChannelError
        with pytest.raises(kind):
            if op == "get":
                link.get(0, 1, timeout_s=1.5)
            else:
                link.put(0, _snap(1, 64 << 20), timeout_s=1.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        stop.set()
        listener.close()


def test_a_large_payload_round_trips(agent):
    snap = _snap(7, 64 << 20)
    address = agent.server.address(HERE)
    PeerLink(address).put(2, snap, timeout_s=30)
    back = PeerLink(address).get(2, 7, timeout_s=30)
    assert back.nbytes == snap.nbytes >= 64 << 20
    assert back.digest() == snap.digest()
    assert isinstance(back.payload, np.ndarray) and back.payload.flags.writeable


def test_a_closed_server_refuses_connections(agent):
    address = agent.server.address(HERE)
    agent.server.close()
    with pytest.raises(ChannelError):
        PeerLink(address).get(0, 1, timeout_s=2)


def test_a_copy_from_a_fenced_off_generation_is_refused_and_the_link_stays_usable():
    """A node cut off by a partition sends its old generation's shards once it heals: the
    peer (whose fence a recovery raised to 3) reads them, keeps nothing, makes no room for
    them, and says why; the same connection then carries a current copy, and an old
    generation's copy of a step at or below the restore point (the job's history)."""
    made_room: list = []
    store = ReplicaStore(lean=True)

    def fenced(gen, step):  # generation 3 restarted from step 6
        return None if gen is None or gen >= 3 or step <= 6 else f"generation {gen} fenced off"

    server = ChannelServer(
        os.urandom(ch.KEY_BYTES),
        on_put=store.adopt,
        on_get=lambda r, s: None,
        reserve=store.reserve,
        here=HERE,
        timeout_s=5.0,
        before_put=lambda r, s: made_room.append((r, s)) or store.make_room(r, s),
        fenced=fenced,
    )
    try:
        link = PeerLink(server.address(HERE))
        link.put(1, _snap(5), timeout_s=10, generation=3)
        with pytest.raises(StaleCopy, match="refused the copy: generation 2 fenced off"):
            link.put(1, _snap(7), timeout_s=10, generation=2)
        assert store.stored() == {1: [5]} and made_room == [(1, 5)]
        link.put(1, _snap(8), timeout_s=10, generation=3)  # the same link, in step
        assert store.stored() == {1: [5, 8]}  # lean: the newest before 8 stays
        link.put(2, _snap(6), timeout_s=10, generation=1)
        assert store.stored() == {1: [5, 8], 2: [6]}
        link.close()
    finally:
        server.close()


def test_a_copy_a_peer_fenced_off_is_failed_and_not_sent_again_through_ray(monkeypatch):
    """The sender's side: a StaleCopy answer ends the copy (it commits nothing, is not
    tried again) and it does not go through Ray instead, where it would be refused again."""
    from stalwart.orchestrator.agent.replication import Replicator

    snap = _snap(7, nbytes=1 << 10)
    store = type("S", (), {"get": lambda self, r, s: snap, "stored": lambda self: {}})()
    rep = Replicator(store)

    class _Fenced:
        def put(self, rank, s, timeout_s, generation=None):
            raise StaleCopy(f"the peer refused the copy: generation {generation} fenced off")

    through_ray: list = []
    monkeypatch.setattr(rep, "_link", lambda node, peer: _Fenced())
    monkeypatch.setattr(rep, "_send_through_ray", lambda *a: through_ray.append(a) or {})
    try:
        _, outcome = rep._send(1, 7, {"peer": object()}, 2)
        assert outcome == "fenced" and through_ray == []
        assert "generation 2 fenced off" in rep.status()["last_error"]
    finally:
        rep.close()

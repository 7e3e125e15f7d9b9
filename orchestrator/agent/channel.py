"""A direct TCP channel between node agents (and from a restoring worker to an agent).

A shard copied to a peer through Ray crosses the object store on both ends (one serialized
copy on the sender, one read on the receiver, and the replica store copies it once more),
and a restore from a peer pays the same: 0.61 s for 250 MB here. Over this channel the
sender writes the payload with `sendall` straight from where it lives (the rank's slot in
shared memory) and the receiver reads it with `recv_into` straight into its destination (a
buffer of the replica store, the restoring worker's array): one copy in the kernel.

Where it listens. Each agent serves one listening socket, bound on first use (port 0, an
ephemeral port) to the node's address that Ray uses, or to 127.0.0.1 when that address is a
loopback or the caller is on this machine: the rule of the supervisor's rendezvous
(supervisor/generation.py), applied per caller, since an agent does not know the job's
nodes. A caller from another machine after a loopback one opens the node address too.

Who may talk to it. Each agent draws a random 32-byte key at start. Its address and key are
handed out only by a Ray call to the agent (`NodeAgent.channel_address`), so only the
processes of the Ray cluster (the ones that could already call `get_shard`) learn them. A
connection starts with an HMAC-SHA256 challenge-response both ways (each side proves it
holds the key over the other's fresh nonce); a caller that fails it is sent nothing but the
refusal. The key is never logged nor put in an error message.

Framing. Every message is a 4-byte big-endian length and a JSON header; a put or a get's
answer is followed by the tensor layout (`metas_to_json`, never unpickled), the skeleton
and the payload, whose lengths the header gives with the payload's checksum
(`payload_checksum`), checked on receipt: a copy damaged or cut short on the way is refused.
Every operation runs under a deadline (the caller's timeout): a peer that dies or stalls
mid-transfer is an error within it, never a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from stalwart.ckpt.ring import metas_from_json, metas_to_json
from stalwart.ckpt.snapshot import Snapshot, payload_checksum

KEY_BYTES = 32
NONCE_BYTES = 16
PREAUTH_MAX = 4096  # the largest message read from a caller not yet authenticated
HEADER_MAX = 1 << 16
SECTION_MAX = 64 << 20  # a layout or a skeleton, at most
AUTH_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 120.0  # the server's bound on one request's transfer
_LEN = struct.Struct("!I")


class ChannelError(Exception):
    """The channel failed (refused, cut, timed out, a copy damaged on the way)."""


class ChannelTimeout(ChannelError):
    """The peer did not answer in time (stalled, hung or unreachable)."""


class ChecksumMismatch(ChannelError):
    """A copy's bytes do not match its checksum (all of them were read: the connection
    is still in step)."""


def bind_host(here: str, caller: str | None) -> str:
    """The address to listen on for `caller`: loopback when this node's address is one or
    the caller is on this machine, else the node's address."""
    try:
        loop = ipaddress.ip_address(here).is_loopback
    except ValueError:
        loop = False
    return "127.0.0.1" if loop or caller == here else here


def _mac(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    msg = b"stalwart-channel/1 " + role + server_nonce + client_nonce
    return hmac.new(key, msg, hashlib.sha256).digest()


def _arm(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelTimeout("timed out")
    sock.settimeout(left)


def _send(sock: socket.socket, deadline: float | None, header: dict, *sections: Any) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    _arm(sock, deadline)
    # The header and the small sections in one write; a payload straight from its memory.
    small = list(sections[:-1])
    sock.sendall(b"".join([_LEN.pack(len(raw)), raw, *small]))
    if sections:
        _arm(sock, deadline)
        sock.sendall(sections[-1])


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got, n = 0, len(view)
    while got < n:
        _arm(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k


def _recv_bytes(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    if n > SECTION_MAX:
        raise ChannelError(f"a section of {n} bytes is over the limit")
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _recv(
    sock: socket.socket, deadline: float | None, limit: int = HEADER_MAX, eof_ok: bool = False
) -> dict | None:
    head = bytearray(_LEN.size)
    _arm(sock, deadline)
    k = sock.recv_into(head, _LEN.size, socket.MSG_WAITALL)
    if k == 0 and eof_ok:
        return None
    if k < _LEN.size:
        _recv_into(sock, memoryview(head)[k:], deadline)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ChannelError(f"a message of {n} bytes is over the limit")
    msg = json.loads(_recv_bytes(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ChannelError("malformed message")
    return msg


def _payload_bytes(payload: Any) -> np.ndarray:
    """The payload as a flat uint8 array over its own memory (no copy)."""
    raw = payload.numpy() if hasattr(payload, "numpy") else payload
    return np.asarray(raw).reshape(-1).view(np.uint8)


def _body(snap: Snapshot) -> tuple[dict, bytes, bytes, np.ndarray]:
    """A shard's header fields and sections."""
    payload = _payload_bytes(snap.payload)
    checksum = snap.checksum if snap.checksum is not None else payload_checksum(payload)
    metas = metas_to_json(tuple(snap.metas))
    skeleton = bytes(snap.skeleton)
    head = {
        "step": snap.step,
        "metas": len(metas),
        "skel": len(skeleton),
        "nbytes": payload.nbytes,
        "checksum": checksum,
    }
    return head, metas, skeleton, payload


def _read_shard(
    sock: socket.socket,
    head: dict,
    deadline: float | None,
    reserve: Callable[[int], np.ndarray],
) -> Snapshot:
    """Read a shard's sections after its header; the payload into a `reserve`d buffer.
    Raises ChannelError when its checksum does not match (every byte is read first, so the
    connection stays in step)."""
    metas = metas_from_json(_recv_bytes(sock, int(head["metas"]), deadline))
    skeleton = _recv_bytes(sock, int(head["skel"]), deadline)
    buf = reserve(int(head["nbytes"]))
    _recv_into(sock, memoryview(buf), deadline)
    checksum = int(head["checksum"])
    if payload_checksum(buf) != checksum:
        raise ChecksumMismatch(f"step {head['step']}: the payload's checksum does not match")
    return Snapshot(int(head["step"]), skeleton, metas, buf, checksum)


def _channel_error(e: Exception) -> ChannelError:
    kind = ChannelTimeout if isinstance(e, TimeoutError) else ChannelError
    return kind(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _new_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class StaleCopy(ChannelError):
    """A peer refused a copy: a recovery fenced off the generation that wrote it."""


class ChannelServer:
    """An agent's end: serves puts into its replica store and gets of the shards it holds.

    `reserve(nbytes)`: a buffer a put's payload is read into; `on_put(rank, snapshot)`
    takes it (the snapshot owns that buffer); `on_get(rank, step)`: the shard, or None;
    `before_put(rank, step)`: told of a put before its payload is read; `fenced(generation,
    step)`: why a copy of `step` written by `generation` is refused (a recovery rolled that
    generation back to before it), or None: such a put is read (the connection stays in
    step) and answered with the reason."""

    def __init__(
        self,
        key: bytes,
        on_put: Callable[[int, Snapshot], Any],
        on_get: Callable[[int, int], Snapshot | None],
        reserve: Callable[[int], np.ndarray] = _new_buffer,
        here: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        before_put: Callable[[int, int], Any] | None = None,
        fenced: Callable[[int | None, int], str | None] | None = None,
    ):
        assert len(key) == KEY_BYTES
        self._key = key
        self._on_put, self._on_get, self._reserve = on_put, on_get, reserve
        self._before_put, self._fenced = before_put, fenced
        self._here = here
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._listeners: dict[str, socket.socket] = {}  # bound address -> listening socket
        self._conns: set[socket.socket] = set()
        self._closed = False

    def address(self, caller: str | None = None) -> dict[str, Any]:
        """{host, port, key} for a caller on `caller` (its node's address; None: this
        machine), listening there first if this is the first such caller."""
        if self._here is None:
            self._here = ray.util.get_node_ip_address()
        host = bind_host(self._here, self._here if caller is None else caller)
        with self._lock:
            if self._closed:
                raise ChannelError("the channel is closed")
            if host not in self._listeners:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, 0))
                sock.listen(64)
                self._listeners[host] = sock
                threading.Thread(
                    target=self._accept, args=(sock,), name="stalwart-channel", daemon=True
                ).start()
            port = self._listeners[host].getsockname()[1]
        return {"host": host, "port": port, "key": self._key}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [*self._listeners.values(), *self._conns]
            self._listeners.clear()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="stalwart-channel-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if not self._authenticate(conn):
                return
            # A persistent connection: wait for the next request as long as the peer lives.
            while (head := _recv(conn, None, eof_ok=True)) is not None:
                deadline = time.monotonic() + self._timeout_s
                op = head.get("op")
                if op == "put":
                    self._put(conn, head, deadline)
                elif op == "get":
                    self._get(conn, head, deadline)
                else:
                    _send(conn, deadline, {"ok": False, "error": f"unknown op {op!r}"})
                    return
        except (OSError, ChannelError, ValueError, KeyError, TypeError):
            return  # the connection is dropped; the caller reports its side
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _authenticate(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + AUTH_TIMEOUT_S
        ours = os.urandom(NONCE_BYTES)
        _send(conn, deadline, {"v": 1, "nonce": ours.hex()})
        msg = _recv(conn, deadline, PREAUTH_MAX)
        theirs = bytes.fromhex(str(msg.get("nonce", "")))
        mac = bytes.fromhex(str(msg.get("mac", "")))
        if len(theirs) != NONCE_BYTES or not hmac.compare_digest(
            mac, _mac(self._key, b"client", ours, theirs)
        ):
            _send(conn, deadline, {"ok": False, "error": "not authenticated"})
            return False
        _send(conn, deadline, {"ok": True, "mac": _mac(self._key, b"server", ours, theirs).hex()})
        return True

    def _put(self, conn: socket.socket, head: dict, deadline: float) -> None:
        gen = head.get("gen")
        step = int(head["step"])
        fenced = self._fenced(None if gen is None else int(gen), step) if self._fenced else None
        if self._before_put is not None and fenced is None:
            self._before_put(int(head["rank"]), step)
        try:
            snap = _read_shard(conn, head, deadline, _new_buffer if fenced else self._reserve)
        except ChecksumMismatch as e:  # cut or timed out: raised, the connection is dropped
            _send(conn, deadline, {"ok": False, "error": str(e)})
            return
        if fenced is not None:  # read (the connection stays in step), not kept
            _send(conn, deadline, {"ok": False, "error": fenced, "fenced": True})
            return
        try:
            self._on_put(int(head["rank"]), snap)
        except Exception as e:  # the store refused: the caller reports it
            _send(conn, deadline, {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
            return
        _send(conn, deadline, {"ok": True})

    def _get(self, conn: socket.socket, head: dict, deadline: float) -> None:
        snap = self._on_get(int(head["rank"]), int(head["step"]))
        if snap is None:
            _send(conn, deadline, {"ok": True, "found": False})
            return
        fields, metas, skeleton, payload = _body(snap)
        _send(conn, deadline, {"ok": True, "found": True, **fields}, metas, skeleton, payload)


class PeerLink:
    """A caller's end: one persistent, authenticated connection to an agent's channel,
    opened on first use and again after an error."""

    def __init__(self, address: dict[str, Any]):
        self.host, self.port = str(address["host"]), int(address["port"])
        self._key = bytes(address["key"])
        self._sock: socket.socket | None = None

    def __repr__(self) -> str:  # never the key
        return f"PeerLink({self.host}:{self.port})"

    def put(
        self, rank: int, snap: Snapshot, timeout_s: float, generation: int | None = None
    ) -> None:
        """Copy `rank`'s shard (written by `generation`) into the peer's replica store;
        returns once it holds it."""
        fields, metas, skeleton, payload = _body(snap)
        header = {"op": "put", "rank": rank, "gen": generation, **fields}
        reply = self._call(timeout_s, header, metas, skeleton, memoryview(payload))
        if not reply.get("ok"):
            refused = StaleCopy if reply.get("fenced") else ChannelError
            raise refused(f"the peer refused the copy: {reply.get('error')}")

    def get(
        self,
        rank: int,
        step: int,
        timeout_s: float,
        reserve: Callable[[int], np.ndarray] = _new_buffer,
    ) -> Snapshot | None:
        """`rank`'s shard of `step` from the peer (None: it does not hold it), its payload
        read into a `reserve`d buffer and checked against its checksum."""
        deadline = time.monotonic() + timeout_s
        reply = self._call(timeout_s, {"op": "get", "rank": rank, "step": step})
        if not reply.get("ok"):
            self.close()
            raise ChannelError(f"the peer refused: {reply.get('error')}")
        if not reply.get("found"):
            return None
        with self._closed_on_error():
            return _read_shard(self._sock, reply, deadline, reserve)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _call(self, timeout_s: float, header: dict, *sections: Any) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._closed_on_error():
            if self._sock is None:
                self._sock = self._connect(deadline)
            _send(self._sock, deadline, header, *sections)
            return _recv(self._sock, deadline)

    @contextlib.contextmanager
    def _closed_on_error(self):
        """A connection that failed mid-message is closed (the next call opens another);
        the error is a ChannelError."""
        try:
            yield
        except (OSError, ValueError, KeyError) as e:
            self.close()
            raise _channel_error(e) from e
        except ChannelError:
            self.close()
            raise

    def _connect(self, deadline: float) -> socket.socket:
        timeout = min(CONNECT_TIMEOUT_S, max(0.001, deadline - time.monotonic()))
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            hello = _recv(sock, deadline, PREAUTH_MAX)
            theirs = bytes.fromhex(str(hello["nonce"]))
            ours = os.urandom(NONCE_BYTES)
            mac = _mac(self._key, b"client", theirs, ours)
            _send(sock, deadline, {"nonce": ours.hex(), "mac": mac.hex()})
            reply = _recv(sock, deadline, PREAUTH_MAX)
            if not reply.get("ok"):
                raise ChannelError(f"refused: {reply.get('error')}")
            proof = bytes.fromhex(str(reply.get("mac", "")))
            if not hmac.compare_digest(proof, _mac(self._key, b"server", theirs, ours)):
                raise ChannelError("the peer did not prove it holds the key")
        except BaseException:
            sock.close()
            raise
        return sock


def fetch_from_agent(
    agent: Any, rank: int, step: int, timeout_s: float, caller: str | None
) -> Snapshot | None:
    """`rank`'s shard of `step` from `agent` (a Ray handle) over its channel: its address
    asked once over Ray, then one connection, all within `timeout_s`. Raises ChannelError
    when there is no channel or it fails (the caller falls back to Ray)."""
    deadline = time.monotonic() + timeout_s
    try:
        address = ray.get(agent.channel_address.remote(caller), timeout=timeout_s)
    except Exception as e:  # no such method, the agent is gone or busy
        raise ChannelError(f"no channel address: {type(e).__name__}") from e
    if not address:
        raise ChannelError("the agent serves no channel")
    link = PeerLink(address)
    try:
        return link.get(rank, step, max(0.001, deadline - time.monotonic()))
    finally:
        link.close()

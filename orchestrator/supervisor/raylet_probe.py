"""Whether a silent agent's node is still up: a TCP connection to its raylet, off the
control loop.

A node agent that leaves the supervisor's report requests unanswered for
health.heartbeat_timeout_s has lost its node, or is starved of CPU on a node that is still
there: on a machine whose cores are all taken (ranks training while replacements import
torch beside them) an agent waited 3.1 s for its turn and its node was declared lost, its
healthy ranks replaced and the node cordoned (the storm scenario, a full run of the suite,
2026-12-07). A node that is gone does not accept a connection to its raylet: a crashed or
cut-off host lets it time out, a killed raylet refuses it. One that is up accepts it, in its
kernel, however busy its processes are. So once an agent has been silent for half its
timeout, its raylet is asked for a connection every PROBE_EVERY_S, given
CONNECT_TIMEOUT_S, every silent node's at once, in a thread of its own; the control loop
takes the newest answers and never waits (health/liveness.py starved_nodes decides what
they mean).

Addresses come from Ray's node table as the supervisor's reader of it last had them
(ray_nodes.py): taking them never waits on the GCS.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping

PROBE_EVERY_S = 0.5  # a silent node's raylet is asked this often
CONNECT_TIMEOUT_S = 0.5  # a connection not made by then: no answer
MAX_AT_ONCE = 256  # connections tried at once (a process may have 1,024 descriptors)


def connect(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port is made within `timeout_s`."""
    return bool(connect_all({"": (host, port)}, timeout_s))


def connect_all(addresses: Mapping[str, tuple[str, int]], timeout_s: float) -> set[str]:
    """Those of `addresses` (key -> (host, port)) that accept a TCP connection within
    `timeout_s`, tried all at once (non-blocking connects, one selector): a round takes
    `timeout_s` at most whether one node is silent or a switch cut off hundreds (taken
    MAX_AT_ONCE at a time, within the process's descriptors)."""
    answered: set[str] = set()
    items = list(addresses.items())
    for first in range(0, len(items), MAX_AT_ONCE):
        answered |= _connect_batch(items[first : first + MAX_AT_ONCE], timeout_s)
    return answered


def _connect_batch(items: list[tuple[str, tuple[str, int]]], timeout_s: float) -> set[str]:
    answered: set[str] = set()
    with selectors.DefaultSelector() as selector:
        try:
            for key, (host, port) in items:
                try:
                    family, kind, proto, _, sockaddr = socket.getaddrinfo(
                        host, port, type=socket.SOCK_STREAM
                    )[0]
                    sock = socket.socket(family, kind, proto)
                except OSError:
                    continue  # not an address (or none left to open): no answer
                sock.setblocking(False)
                code = sock.connect_ex(sockaddr)
                if code == 0:
                    answered.add(key)
                    sock.close()
                elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                    selector.register(sock, selectors.EVENT_WRITE, key)
                else:
                    sock.close()  # refused at once: a dead raylet on a live host
            deadline = time.monotonic() + timeout_s
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for ready, _ in selector.select(left):
                    sock = ready.fileobj
                    assert isinstance(sock, socket.socket)
                    selector.unregister(sock)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        answered.add(ready.data)
                    sock.close()
        finally:
            for ready in list(selector.get_map().values()):
                ready.fileobj.close()  # type: ignore[union-attr]
    return answered


class RayletProbe:
    def __init__(
        self,
        addresses: Callable[[], Mapping[str, tuple[str, int]]],
        connect: Callable[[Mapping[str, tuple[str, int]], float], set[str]] = connect_all,
        clock: Callable[[], float] = time.time,
    ):
        """`addresses()`: node id -> its raylet's (address, port), without waiting
        (RayNodeTable.raylets)."""
        self._connect, self._addresses, self._clock = connect, addresses, clock
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        self._answered: dict[str, float] = {}  # node -> when its newest answered try began
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, nodes: Iterable[str]) -> None:
        """Probe exactly `nodes` from now on (the silent ones); starts the thread on the
        first call that names a node."""
        wanted = set(nodes)
        with self._lock:
            new = wanted - self._wanted
            self._wanted = wanted
        if new:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="stalwart-raylet-probe", daemon=True
                )
                self._thread.start()
            self._wake.set()

    def take(self) -> dict[str, float]:
        """node -> the time its newest answered probe began, for the answers that came in
        since the last call."""
        with self._lock:
            answered, self._answered = self._answered, {}
        return answered

    def up(self, nodes: Iterable[str]) -> set[str]:
        """Those of `nodes` whose raylet accepts a connection now (asked from the calling
        thread, CONNECT_TIMEOUT_S at most): a dead worker's node whose agent did not
        answer a ping in time (supervisor/recovery.py)."""
        return set(self._ask(nodes))

    def probe_once(self) -> None:
        """One round: each watched node's raylet asked once, all at once (the thread's
        body)."""
        with self._lock:
            wanted = sorted(self._wanted)
        answered = self._ask(wanted)
        with self._lock:
            for node, began in answered.items():
                self._answered[node] = max(began, self._answered.get(node, began))

    def _ask(self, nodes: Iterable[str]) -> dict[str, float]:
        """node -> when the connection its raylet accepted was begun, for those of `nodes`
        that accepted one (a node Ray's table has not listed yet is not asked)."""
        known = self._addresses()
        addresses = {n: known[n] for n in nodes if n in known}
        if not addresses:
            return {}
        began = self._clock()
        return dict.fromkeys(self._connect(addresses, CONNECT_TIMEOUT_S), began)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._wanted
            if idle:
                self._wake.wait()
                self._wake.clear()
                continue
            self.probe_once()
            self._stop.wait(PROBE_EVERY_S)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

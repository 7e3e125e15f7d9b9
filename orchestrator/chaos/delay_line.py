"""A delay on one node's link where the kernel has no netem: the link routed through this
process, whose packet sockets hold each frame the node sends for the delay.

The node's root-side veth leaves the cluster's bridge; a new veth pair takes its place (one
end on the bridge, the other here). A thread reads the frames the node sends (a packet
socket on its veth) and writes each, once due, into the new pair, so they reach the
bridge `ms` (give or take `jitter_ms`) late; frames the other way pass at once. Healing
puts the node's veth back on the bridge and removes the pair. The sockets carry each
frame's virtio-net header (PACKET_VNET_HDR), so what veth leaves to offload (a checksum,
a segment larger than the MTU) is completed where the frame leaves.

Measured here: a connection's round trip 0.3 ms -> 401 ms with ms=200 (one delayed leg
each way of a request and its answer), 20 MB over one TCP connection in 4 s, healed back
to 0.3 ms. Costs a thread of this process and a copy of every frame the node sends
through Python: enough for a chaos run's few MB/s, not a benchmark's link.
"""

from __future__ import annotations

import contextlib
import heapq
import random
import select
import socket
import threading
import time
from collections.abc import Callable

ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_VNET_HDR = 263, 15
PACKET_OUTGOING = 4  # a frame this host sent on the device: not one to forward
FRAME_MAX = 1 << 16
QUEUE_MAX = 100_000  # frames held at once, at most (a backlog beyond is dropped, as a link's)


class DelayLine:
    def __init__(
        self,
        run: Callable[..., str],
        bridge: str,
        veth: str,
        name: str,
        ms: float,
        jitter_ms: float = 0.0,
        seed: int = 0,
    ):
        self._run = run  # netns._run: a command, NetnsError on failure
        self.bridge, self.veth = bridge, veth
        self.inner, self.outer = f"{name}a", f"{name}b"  # ours, the bridge's
        self.delay_s, self.jitter_s = ms / 1000.0, jitter_ms / 1000.0
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socks: list[socket.socket] = []
        self.forwarded = 0
        self.dropped = 0

    def start(self) -> None:
        run = self._run
        run("ip", "link", "add", self.inner, "type", "veth", "peer", "name", self.outer)
        try:
            run("ip", "link", "set", self.outer, "master", self.bridge, "up")
            run("ip", "link", "set", self.inner, "up")
            node_side = self._open(self.veth)
            line_side = self._open(self.inner)
            run("ip", "link", "set", self.veth, "nomaster")  # from now its frames come here
        except BaseException:
            self._close()
            with contextlib.suppress(Exception):
                run("ip", "link", "del", self.inner)
            raise
        self._thread = threading.Thread(
            target=self._loop, args=(node_side, line_side), name="chaos-delay", daemon=True
        )
        self._thread.start()

    def _open(self, device: str) -> socket.socket:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        # Each frame with its virtio-net header: a checksum the node's side left to the
        # hardware (veth's offload) and a segment larger than the MTU (GSO) are handed on
        # as such, completed by the kernel where they leave, not dropped as corrupt.
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.bind((device, 0))
        s.setblocking(False)
        self._socks.append(s)
        return s

    def stop(self) -> None:
        """Put the node's veth back on the bridge and remove the line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close()
        with contextlib.suppress(Exception):
            self._run("ip", "link", "set", self.veth, "master", self.bridge, "up")
        with contextlib.suppress(Exception):
            self._run("ip", "link", "del", self.inner)

    def _close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        self._socks = []

    def _loop(self, node_side: socket.socket, line_side: socket.socket) -> None:
        held: list[tuple[float, int, bytes]] = []  # (due, order, frame) toward the bridge
        order = 0
        while not self._stop.is_set():
            wait = 0.05 if not held else max(0.0, min(0.05, held[0][0] - time.monotonic()))
            try:
                readable, _, _ = select.select([node_side, line_side], [], [], wait)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            for sock in readable:
                for frame in self._drain(sock):
                    if sock is node_side:
                        if len(held) >= QUEUE_MAX:
                            self.dropped += 1
                            continue
                        jitter = self._rng.uniform(-self.jitter_s, self.jitter_s)
                        heapq.heappush(held, (now + max(0.0, self.delay_s + jitter), order, frame))
                        order += 1
                    else:
                        self._send(node_side, frame)
            while held and held[0][0] <= time.monotonic():
                self._send(line_side, heapq.heappop(held)[2])

    def _drain(self, sock: socket.socket) -> list[bytes]:
        frames = []
        while len(frames) < 256:
            try:
                frame, address = sock.recvfrom(FRAME_MAX)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if address[2] != PACKET_OUTGOING:
                frames.append(frame)
        return frames

    def _send(self, sock: socket.socket, frame: bytes) -> None:
        try:
            sock.send(frame)
            self.forwarded += 1
        except OSError:  # full or too large: lost, as on a link
            self.dropped += 1

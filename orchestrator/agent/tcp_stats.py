"""TCP retransmissions per peer address, as this node's kernel counts them.

A link that drops a few percent of its packets hardly moves the round trips of small
requests (TCP's tail-loss probes recover most losses in milliseconds), but every lost
segment is sent again, and the kernel counts it on the socket. Summed per peer address
over every established connection of the node's network namespace (Ray's, the ranks'
collectives', the agents' channels), the ratio of segments sent again to data segments
sent says which of the node's links lose packets. One end's view cannot say which end is
at fault; the supervisor puts every node's view together (health/lossy_link.py).

Read with the kernel's socket diagnostics (NETLINK_SOCK_DIAG, what `ss -ti` uses): no
process to start, no tool to install. Where that is refused (a kernel without it, a
sandbox), the reason is kept and nothing is counted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import time

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
TCP_ESTABLISHED = 1
# struct tcp_info (linux/tcp.h), whose layout only ever grows at its end.
TOTAL_RETRANS_AT = 100  # __u32 tcpi_total_retrans
DATA_SEGS_OUT_AT = 156  # __u32 tcpi_data_segs_out (Linux 4.6)
MIN_INFO = DATA_SEGS_OUT_AT + 4

Counts = dict[str, tuple[int, int]]  # peer address -> (data segments sent, sent again)


def _request(family: int, seq: int) -> bytes:
    # struct inet_diag_req_v2: family, protocol, ext, pad, states, then an empty sockid.
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 1 << 1)
    body += b"\0" * 48
    header = struct.pack(
        "=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0
    )
    return header + body


def parse_dump(data: bytes, family: int) -> tuple[list[tuple[tuple, int, int]], bool]:
    """The (connection, data segments sent, sent again) of each socket in one read of a
    dump's answer, and whether it was the last (NLMSG_DONE)."""
    out = []
    at = 0
    width = 4 if family == socket.AF_INET else 16
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if length < 16:
            break
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", data, at + 16)
            raise OSError(-errno, os.strerror(-errno))
        msg = at + 16
        # struct inet_diag_msg: family, state, timer, retrans, then the sockid (ports in
        # network order, addresses in 16 bytes each), if, cookie; expires, queues, uid, inode.
        sport, dport = struct.unpack_from("!HH", data, msg + 4)
        src = data[msg + 8 : msg + 8 + width]
        dst = data[msg + 24 : msg + 24 + width]
        attr = msg + 72
        end = at + length
        while attr + 4 <= end:
            alen, atype = struct.unpack_from("=HH", data, attr)
            if alen < 4:
                break
            if atype == INET_DIAG_INFO and alen - 4 >= MIN_INFO:
                info = attr + 4
                (retrans,) = struct.unpack_from("=I", data, info + TOTAL_RETRANS_AT)
                (segs,) = struct.unpack_from("=I", data, info + DATA_SEGS_OUT_AT)
                key = (bytes(src), sport, bytes(dst), dport)
                out.append((key, segs, retrans))
            attr += (alen + 3) & ~3
        at += (length + 3) & ~3
    return out, False


def _address(raw: bytes) -> str:
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


class TcpStats:
    """Cumulative (data segments sent, sent again) per peer address of this namespace's
    established TCP connections, from the counters of each connection seen at two reads
    (a connection seen once counts from its first read on)."""

    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self.error: str | None = None
        self._last: dict[tuple, tuple[int, int]] = {}
        self._totals: dict[str, list[int]] = {}
        self._read_at = 0.0
        self._seq = 0
        self._ip: str | None = None

    def ip(self) -> str | None:
        """This node's address as Ray knows it (the peers' counters name it so)."""
        if self._ip is None:
            with contextlib.suppress(Exception):  # no Ray here (a test of the agent alone)
                import ray

                self._ip = ray.util.get_node_ip_address()
        return self._ip

    def report(self) -> Counts | None:
        """The totals for a report; None where they cannot be read."""
        counts = self.sample()
        return None if self.error is not None else counts

    def sample(self) -> Counts:
        """The totals, read again when the last read is older than min_interval_s."""
        now = time.monotonic()
        if self.error is None and now - self._read_at >= self.min_interval_s:
            self._read_at = now
            try:
                self._absorb(self._read())
            except OSError as e:
                self.error = f"cannot read this node's TCP counters (sock_diag): {e}"
        return {peer: (t[0], t[1]) for peer, t in self._totals.items()}

    def _read(self) -> list[tuple[tuple, int, int]]:
        sockets = []
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
            s.settimeout(2.0)
            for family in (socket.AF_INET, socket.AF_INET6):
                self._seq += 1
                s.send(_request(family, self._seq))
                while True:
                    got, done = parse_dump(s.recv(1 << 16), family)
                    sockets += got
                    if done:
                        break
        return sockets

    def _absorb(self, sockets: list[tuple[tuple, int, int]]) -> None:
        seen = {}
        for key, segs, retrans in sockets:
            peer = _address(key[2])
            if peer.startswith("127.") or peer == "::1":
                continue  # within the node
            seen[key] = (segs, retrans)
            before = self._last.get(key)
            if before is None:
                continue
            total = self._totals.setdefault(peer, [0, 0])
            total[0] += max(0, segs - before[0])
            total[1] += max(0, retrans - before[1])
        self._last = seen

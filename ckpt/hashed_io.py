"""Files read and written in chunks, hashed as the bytes pass: a 1 GB payload streams
without being copied (the durable tier, ckpt/durable.py and ckpt/legacy_shard.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from stalwart.ckpt.lazy import LazyModule, is_tensor

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

CHUNK = 4 << 20  # bytes per write/read/hash call


def flat_bytes(payload: Any) -> memoryview:
    """The payload's bytes as a flat memoryview, without copying a CPU buffer."""
    if is_tensor(payload):
        payload = payload.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    arr = np.ascontiguousarray(payload).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    return memoryview(arr).cast("B")


def read_into(f, mv: memoryview, h) -> int:
    """Fill `mv` from `f` (hashing what was read); returns the bytes read (short at EOF)."""
    readinto = getattr(f, "readinto", None)
    pos = 0
    while pos < len(mv):
        want = min(CHUNK, len(mv) - pos)
        if readinto is not None:
            got = readinto(mv[pos : pos + want]) or 0
        else:
            data = f.read(want)
            got = len(data)
            mv[pos : pos + got] = data
        if not got:
            break
        h.update(mv[pos : pos + got])
        pos += got
    return pos


def hash_rest(f, h) -> int:
    buf = memoryview(bytearray(CHUNK))
    total = 0
    while got := read_into(f, buf, h):
        total += got
        if got < len(buf):
            break
    return total

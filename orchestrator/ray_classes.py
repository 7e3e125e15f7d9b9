"""Ray actor classes made once per process.

`ray.remote(cls)` makes a new actor class each time, which Ray pickles, disassembles for
its collision id and exports again at its first `.remote()` (25 ms of the supervisor's CPU
per worker started, measured; 2.6 ms with the class made once). Ray exports a class once
per actor class and job, so the supervisor, the workers and the agents each get theirs here.
"""

from __future__ import annotations

import functools
from typing import Any

import ray


@functools.cache
def actor_class(cls: type) -> Any:
    """`ray.remote(cls)`, made once for this process."""
    return ray.remote(cls)

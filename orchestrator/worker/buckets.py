"""A DDP's gradients reduced in stalwart's own fixed buckets, overlapped with the backward.

Why not DDP's buckets: DDP rebuilds its bucket layout after its first iteration (from the
order the gradients became ready), so the DDP every rank builds again in a recovery and a
long-lived one reduce different buffers for a step. Gloo's ring all-reduce (NCCL's too)
splits a buffer into chunks by its size and sums each chunk in a different rank order, so
a different layout changes the bits of the sums, and a recovered run would stop matching a
failure-free one.

So the layout here depends only on the model's parameters and DDP's ``bucket_cap_mb``:
the parameters in reverse registration order (the order a backward usually produces their
gradients), grouped by dtype and device, cut at the cap (each group's first bucket by DDP's
own rule: 1 MiB unless ``bucket_cap_mb`` was given), launched in the order they are
expected to fill. DDP still calls its comm hook (``BucketReducer``) per DDP bucket as
gradients become ready; the hook copies that bucket's gradients into the stalwart buckets
they belong to and launches a stalwart bucket's reduction as soon as all its gradients are
in, in bucket order (every rank issues its collectives in the same order), while the
backward goes on with earlier layers. Where DDP's bucket holds exactly one stalwart
bucket's parameters in its order (DDP's rebuilt layout is this one for a model whose
gradients arrive in reverse registration order), DDP's own buffer is reduced in place, with
no copy: the same bytes, so the same sums. A DDP bucket's future completes when every
stalwart bucket it touches is reduced and its gradients hold the averaged values; an abort
of the generation fails the pending all-reduces (ElasticGroup), hence every DDP bucket's
future, with GroupAborted.

A comm hook of the user's own (``register_comm_hook``: torch's fp16/bf16 compression,
PowerSGD, any function of ``(state, bucket)``) runs on stalwart's buckets instead of DDP's
(``Bucket`` offers what ``dist.GradBucket`` does), its collectives on the group the user
gave it, stalwart's abortable default group when that is None. A user hook's buckets run
one after another: a hook may issue more collectives from its futures' callbacks
(PowerSGD does, and waits on them there), and only one bucket at a time keeps their order
the same on every rank (torch's own DDP with PowerSGD on gloo loses it and fails with a
size mismatch, or hangs), and keeps gloo's two worker threads from all
waiting in such a callback. torch's hooks that issue their one collective from their body
(``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``) need none of that and
overlap one another as the default reduction does (one at a time, the bf16 hook's step
was 8-14 % longer than torch's DDP's with it: docs/benchmarks.md).

What a rank waits for: the bucket all-reduces overlap its backward, so the time they are in
flight is not time it waits; what it waits is from the end of its backward (DDP's last
bucket handed over) until every bucket is reduced, when DDP's reducer stops blocking the
training thread. That is what `ElasticGroup.waited` hears (straggler detection subtracts
it from the step time).

The default reduction divides before it sums, as DDP's own and torch's ``allreduce_hook``
do (no fp16 overflow in the sum). That division is one pass over the gradients that DDP
without a hook fuses into its copy; it is what this path costs against DDP's own on CPU
(docs/benchmarks.md, "DDP: overlap and comm hooks").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

log = logging.getLogger("stalwart.worker")

# Hooks whose collectives are all issued from their body, in the order they are called:
# their buckets may overlap one another (the module docstring says why others may not).
_BODY_ONLY = (
    default_hooks.allreduce_hook,
    default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook,
)

# DDP's first bucket when bucket_cap_mb is its default (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES)
FIRST_BUCKET_BYTES = 1 << 20


def bucket_layout(
    params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Indices into `params` per bucket, in launch order, each bucket's in reverse
    registration order: per (dtype, device), parameters from the last registered on until
    a bucket holds `cap_bytes` (its group's first bucket `first_cap_bytes`), as DDP cuts
    its buckets when it rebuilds them from the order gradients arrived; buckets ordered by
    when they fill if gradients arrive in reverse registration order (their last member's
    place in it)."""
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    started: set[tuple[torch.dtype, torch.device]] = set()  # groups past their first bucket
    closed: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
        if filled[key] >= (cap_bytes if key in started else first_cap_bytes):
            closed.append(open_.pop(key))
            filled[key] = 0
            started.add(key)
    closed += open_.values()
    closed.sort(key=lambda members: -members[-1])
    return closed


class Bucket:
    """One of stalwart's buckets as a comm hook sees it: what ``dist.GradBucket`` offers
    (``buffer``, ``set_buffer``, ``gradients`` as views of the current buffer,
    ``parameters``, ``index``, ``is_last``). `flat` is its own memory, where DDP's
    gradients are copied when DDP's bucket is not this one (allocated then, dropped while
    DDP's is: a copy of the gradients, which on a large model is memory worth having
    back); each launch sets the buffer again, to `flat` or to DDP's bucket's (a hook may
    have set another, as torch's fp16/bf16 wrappers do)."""

    def __init__(self, index: int, count: int, params: list[torch.Tensor]):
        self._index, self._count = index, count
        self._params = params
        self._shapes = [p.shape for p in params]
        self._offsets = list(accumulate((p.numel() for p in params), initial=0))
        self.dtype, self.device = params[0].dtype, params[0].device
        self.flat: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None

    def own_memory(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = torch.empty(self._offsets[-1], dtype=self.dtype, device=self.device)
        return self.flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        o = self._offsets
        return [self._buffer[o[k] : o[k + 1]].view(s) for k, s in enumerate(self._shapes)]

    def span(self, k: int) -> slice:
        """Where parameter `k` of this bucket lies in its buffer."""
        return slice(self._offsets[k], self._offsets[k + 1])

    def __len__(self) -> int:
        return len(self._params)


class _Waiter:
    """A DDP bucket waiting for the stalwart buckets its gradients are in: `pairs` (its
    parameters and gradient views) to copy the averages back into, or, when DDP's bucket
    is stalwart bucket `whole` itself, none: that one was reduced in DDP's `buffer`."""

    def __init__(self, buffer: torch.Tensor, future: torch.futures.Future):
        self.buffer, self.future = buffer, future
        self.remaining = 0  # stalwart buckets not reduced yet
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.whole: int | None = None
        self.error: BaseException | None = None


class BucketReducer:
    """DDP comm hook state (the module docstring says why and how).

    `group` is the ElasticGroup (duck-typed: ``new_future``, ``all_reduce_async``,
    ``world_size``, ``abort_error``, ``waited``): its all-reduces are abortable."""

    def __init__(
        self,
        group: Any,
        params: Sequence[torch.Tensor],
        cap_bytes: int,
        first_cap_bytes: int,
    ):
        self.group = group
        order = bucket_layout(params, cap_bytes, first_cap_bytes)
        self.buckets = [
            Bucket(i, len(order), [params[j] for j in members]) for i, members in enumerate(order)
        ]
        self._where = {
            id(p): (i, k) for i, b in enumerate(self.buckets) for k, p in enumerate(b._params)
        }
        self._same = {tuple(map(id, b._params)): i for i, b in enumerate(self.buckets)}
        self._hook: Callable[[Any, Bucket], torch.futures.Future] | None = None
        self._state: Any = None
        self._one_by_one = False  # a bucket launched only once the one before is reduced
        self._lock = threading.Lock()
        self._pumping = self._again = False
        self._new_step()

    def use(self, state: Any, hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        """A comm hook of the user's own, run on stalwart's buckets from the next backward."""
        if not callable(hook):
            raise TypeError("DistributedDataParallel.register_comm_hook: the hook must be callable")
        if self._hook is not None:
            raise ValueError(
                "DistributedDataParallel.register_comm_hook: this DDP has a comm hook already "
                "(DDP takes one)"
            )
        self._hook, self._state = hook, state
        self._one_by_one = hook not in _BODY_ONLY

    def _new_step(self) -> None:
        n = len(self.buckets)
        with self._lock:
            self._arrived = [0] * n
            self._source: list[torch.Tensor | None] = [None] * n  # what each one reduces
            self._next = 0  # the next bucket to launch
            self._settled = [False] * n
            self._results: list[torch.Tensor | None] = [None] * n
            self._waiters: list[list[_Waiter]] = [[] for _ in range(n)]
            self._open = 0  # DDP buckets handed over and not reduced yet
            self._backward_done: float | None = None  # when DDP handed over its last one

    def __call__(self, bucket: Any) -> torch.futures.Future:
        """DDP's hook for its bucket `bucket` (a ``dist.GradBucket``), called in bucket order
        as the backward makes them ready."""
        if bucket.index() == 0:  # a new backward: DDP starts every one with its bucket 0
            self._new_step()
        params = bucket.parameters()
        waiter = _Waiter(bucket.buffer(), self.group.new_future())
        whole = self._same.get(tuple(map(id, params)))
        if whole is not None:
            # DDP's bucket is this stalwart bucket (DDP's rebuilt layout often is ours):
            # reduce DDP's buffer in place, no copies. The same bytes: the same sums.
            waiter.whole, waiter.remaining = whole, 1
            self._source[whole] = waiter.buffer
            self.buckets[whole].flat = None
            touched = {whole: len(params)}
        else:
            waiter.pairs = list(zip(params, bucket.gradients(), strict=True))
            touched = {}
            for p, g in waiter.pairs:
                i, k = self._where[id(p)]
                if self._source[i] is None:
                    self._source[i] = self.buckets[i].own_memory()
                self._source[i][self.buckets[i].span(k)].copy_(g.reshape(-1))
                touched[i] = touched.get(i, 0) + 1
            waiter.remaining = len(touched)
        with self._lock:
            for i, n in touched.items():
                self._arrived[i] += n
                self._waiters[i].append(waiter)
            self._open += 1
            if bucket.is_last():
                self._backward_done = time.monotonic()
        self._pump()
        return waiter.future

    def _pump(self) -> None:
        """Launch every bucket that is full and whose turn it is; one thread at a time (a
        launch may complete at once and call this again: it then only asks for a look)."""
        with self._lock:
            if self._pumping:
                self._again = True
                return
            self._pumping = True
        while True:
            with self._lock:
                i = self._next
                ready = (
                    i < len(self.buckets)
                    and self._arrived[i] == len(self.buckets[i])
                    and (not self._one_by_one or i == 0 or self._settled[i - 1])
                )
                if not ready:
                    if not self._again:
                        self._pumping = False
                        return
                    self._again = False
                    continue
                self._next = i + 1
            self._launch(i)

    def _launch(self, i: int) -> None:
        b, source = self.buckets[i], self._source[i]
        b.set_buffer(source)
        try:
            if self._hook is None:
                source.div_(self.group.world_size)
                fut = self.group.all_reduce_async(source)
            else:
                fut = self._hook(self._state, b)
        except Exception as e:  # GroupAborted once aborted, a hook's own error: DDP raises it
            self._settle(i, None, e)
            return
        fut.add_done_callback(lambda f: self._reduced(i, f))

    def _reduced(self, i: int, fut: torch.futures.Future) -> None:
        try:
            value = fut.value()
        except Exception as e:  # GroupAborted, a transport error: the DDP buckets fail with it
            self._settle(i, None, e)
            return
        self._settle(i, value[0] if isinstance(value, list) else value, None)

    def _settle(self, i: int, result: torch.Tensor | None, error: BaseException | None) -> None:
        if error is not None:
            # After an abort, GroupAborted, whatever a hook's future chain wrapped it in.
            error = self.group.abort_error() or error
        finished = []
        with self._lock:
            self._results[i] = result
            self._settled[i] = True
            for w in self._waiters[i]:
                w.remaining -= 1
                if error is not None and w.error is None:
                    w.error = error
                if w.remaining == 0:
                    finished.append(w)
        if self._one_by_one:
            self._pump()  # the next bucket's turn (before DDP may start the next step)
        for w in finished:
            self._finish(w)

    def _finish(self, w: _Waiter) -> None:
        with self._lock:
            self._open -= 1
            done, waited = self._backward_done, self._open == 0
            if waited:
                self._backward_done = None
        if waited and done is not None:  # the training thread waited since the backward
            self.group.waited(max(0.0, time.monotonic() - done))
        if w.error is not None:
            w.future.set_exception(w.error)
            return
        if w.whole is not None:
            result = self._results[w.whole]
            if result is not w.buffer:  # a hook that answered in a tensor of its own
                w.buffer.copy_(result)
        for p, g in w.pairs:
            i, k = self._where[id(p)]
            g.copy_(self._results[i][self.buckets[i].span(k)].view_as(g))
        w.future.set_result(w.buffer)


def reduce_hook(state, bucket):
    # No annotations: DDP inspects them and rejects the strings `from __future__` makes.
    return state(bucket)


def reduce_in_buckets(
    ddp: torch.nn.parallel.DistributedDataParallel,
    group: Any,
    register: Callable[..., None],
) -> BucketReducer | None:
    """Make `ddp` reduce its gradients through a BucketReducer on `group` (registered with
    `register`, DDP's own register_comm_hook); None, with a warning, when DDP reduces through
    a comm hook of its own already (``mixed_precision=...``)."""
    if ddp._comm_hooks:
        ddp._stalwart_reducer = None
        log.warning(
            "DistributedDataParallel: it reduces gradients through a comm hook of its own "
            "(mixed_precision?), not stalwart's fixed buckets: a recovery may not be exact"
        )
        return None
    ignored = ddp.parameters_to_ignore
    params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    # DDP's own first-bucket rule (1 MiB unless bucket_cap_mb was given), so that its rebuilt
    # layout is often this one and its buckets are reduced in place.
    first = FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap
    reducer = BucketReducer(group, params, ddp.bucket_bytes_cap, first)
    register(ddp, reducer, reduce_hook)
    ddp._stalwart_reducer = reducer
    return reducer

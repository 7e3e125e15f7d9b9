"""A DDP on stalwart's group reduces in stalwart's fixed buckets (worker/buckets.py): the
same averages as torch's own DDP up to rounding, the same bits in a DDP built again in a
second generation (a recovery) as in a long-lived one, with torch's bf16 hook, a hook of
one's own and PowerSGD too (its state restored), a mixed-dtype model on the same path,
DDP's own buffers reduced in place where its buckets are stalwart's, communication issued
before the backward ends, and an abort releasing a rank blocked in a user hook's
collective. Three real gloo processes on loopback (with two, a+b = b+a and no bucket
layout could change a sum)."""

from __future__ import annotations

import copy
import datetime
import functools
import os
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.orchestrator.worker.buckets import FIRST_BUCKET_BYTES, bucket_layout

pytestmark = pytest.mark.timeout(300)

WORLD = 3
CAP_MB = 0.02  # 20 KiB: a Linear(64, 64)'s weight and bias per bucket, several buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MLP(torch.nn.Module):
    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(layers))
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Reversed(MLP):
    """Its layers run in the reverse of their registration order, so gradients arrive in
    registration order: DDP's rebuilt buckets then cut across stalwart's (copies, not
    DDP's buffers reduced in place)."""

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return self.head(x)


class Mixed(torch.nn.Module):
    """A bf16 embedding under fp32 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 64, dtype=torch.bfloat16)
        self.body = MLP(3)

    def forward(self, x):
        return self.body(self.embed(x).float().mean(1))


VARIANTS = (
    ("default", MLP),
    ("reversed", Reversed),
    ("bf16", MLP),
    ("own", MLP),
    ("powersgd", MLP),
    ("mixed", Mixed),
)


def _batch(model: torch.nn.Module, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    y = torch.randint(0, 4, (8,), generator=g)
    if isinstance(model, Mixed):
        return torch.randint(0, 50, (8, 5), generator=g), y
    return torch.randn(8, 64, generator=g), y


def _step(ddp, opt, step: int, rank: int) -> None:
    x, y = _batch(ddp.module, step, rank)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _bits(module: torch.nn.Module) -> list[bytes]:
    return [p.detach().view(torch.uint8).numpy().tobytes() for p in module.parameters()]


def _blocked(call, group) -> tuple[str, bool]:
    """Run `call` (a step the peers never join); abort once a collective is pending; what it
    raised and whether a collective was pending (the rank blocked) when the abort came."""
    pending: list[bool] = []

    def abort() -> None:
        deadline = time.monotonic() + 60
        while group.pending_since() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the condition, with a deadline
        pending.append(group.pending_since() is not None)
        group.abort("a peer died")

    aborter = threading.Thread(target=abort)
    aborter.start()
    try:
        call()
    except Exception as e:
        aborter.join()
        return f"{type(e).__name__}: {str(e)[:300]}", pending[0]
    aborter.join()
    return "returned", pending[0]


def _worker(rank: int, port: int, out) -> None:
    keep: list = []
    try:
        out.put((rank, "ok", _scenarios(rank, port, keep)))
    except Exception:
        out.put((rank, "error", traceback.format_exc()))
    out.close()
    out.join_thread()
    # No teardown: an aborted generation's gloo threads may stay blocked on a socket, and
    # destroying its group (kept in `keep`) would join them.
    os._exit(0)


SEEN: list[tuple[int, bool]] = []  # (index, is_last) of each bucket _own_hook was given


def _own_hook(group, bucket):
    """A user's hook: the average through torch.distributed on the group it was given."""
    SEEN.append((bucket.index(), bucket.is_last()))
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    return (
        dist.all_reduce(buffer, group=group, async_op=True)
        .get_future()
        .then(lambda f: f.value()[0])
    )


def _bf16_twin(state, bucket):
    # torch's bf16_compress_hook under another name: DDP refuses that name without NCCL,
    # and torch's own DDP here runs on gloo (stalwart's reducer does not ask).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _scenarios(rank: int, port: int, keep: list) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState,
        powerSGD_hook,
    )

    from stalwart.orchestrator.worker import torchrun
    from stalwart.orchestrator.worker.collective import ElasticGroup, _wrap_backend, make_ddp
    from stalwart.orchestrator.worker.stateful import stateful

    torch.set_num_threads(1)
    torchrun.install()
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
    group = ElasticGroup()
    keep.append(group)
    timeout = datetime.timedelta(seconds=120)
    cpu = torch.device("cpu")
    res: dict = {}

    def generation(gen: int) -> None:
        prefixed = dist.PrefixStore(f"gen{gen}", store)
        group.configure(prefixed, rank, WORLD, gen, "gloo", cpu, "127.0.0.1", timeout)

    def plain_group(gen: int) -> dist.ProcessGroup:
        # torch's own DDP runs on a plain gloo group (stalwart patches only DDPs on its own).
        prefixed = dist.PrefixStore(f"plain{gen}", store)
        return _wrap_backend(prefixed, rank, WORLD, "gloo", timeout, cpu, "127.0.0.1")[0]

    def ddp_of(model, pg=None, hook=None):
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=pg, bucket_cap_mb=CAP_MB
        )
        if hook is not None:
            ddp.register_comm_hook(*hook)
        return ddp

    def new(kind, seed: int = 0):
        torch.manual_seed(seed)
        model = kind()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def powersgd() -> PowerSGDState:
        return PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=7,
        )

    def bf16():
        return (None, default_hooks.bf16_compress_hook)

    # Generation 1: long-lived DDPs, each variant's state kept at step 3.
    generation(1)
    plain = plain_group(1)
    at3: dict = {}
    straight: dict = {}
    hooks = {"bf16": bf16, "own": lambda: (None, _own_hook)}
    for name, kind in VARIANTS:
        model, opt = new(kind)
        if name == "powersgd":
            state = powersgd()
            ddp = ddp_of(model, hook=(state, powerSGD_hook))
        else:
            ddp = ddp_of(model, hook=hooks.get(name, lambda: None)())
        reducer = ddp._stalwart_reducer
        res.setdefault("dtypes", {})[name] = sorted({str(b.dtype) for b in reducer.buckets})
        res.setdefault("nbuckets", {})[name] = len(reducer.buckets)
        # torch's DDP beside it, same start, same data: the averaged gradients compared.
        twin, twin_opt = new(kind)
        twin_hook = {"bf16": (plain, _bf16_twin), "own": (plain, _own_hook)}.get(name)
        torch_ddp = ddp_of(twin, pg=plain, hook=twin_hook)
        diffs = []
        for step in range(6):
            if step == 3:
                at3[name] = {
                    "model": copy.deepcopy(model.state_dict()),
                    "opt": copy.deepcopy(opt.state_dict()),
                    **(
                        {"hook": copy.deepcopy(stateful("p", state).state_dict())}
                        if name == "powersgd"
                        else {}
                    ),
                }
            if step == 5:  # what the default reduction all-reduces: its copies or DDP's
                sources: list[str] = []
                issue = group.all_reduce_async
                own = {id(b.flat) for b in reducer.buckets if b.flat is not None}

                def recorded(tensor, op=dist.ReduceOp.SUM, issue=issue, own=own, sources=sources):
                    sources.append("copy" if id(tensor) in own else "ddp's buffer")
                    return issue(tensor, op)

                group.all_reduce_async = recorded
            SEEN.clear()
            _step(ddp, opt, step, rank)
            if step == 5:
                del group.all_reduce_async
                res.setdefault("sources", {})[name] = sources
                res.setdefault("seen", {})[name] = list(SEEN)
            # torch's own DDP with PowerSGD does not run on gloo with several buckets: its
            # hook's chained all-reduces come in another order on each rank.
            if name != "powersgd":
                _step(torch_ddp, twin_opt, step, rank)
                diffs.append(
                    max(
                        ((p.grad.float() - q.grad.float()).abs().max() / q.grad.abs().max()).item()
                        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
                    )
                )
        straight[name] = _bits(model)
        res.setdefault("vs_torch", {})[name] = diffs
        res.setdefault("ranks_agree", {})[name] = straight[name]
    # A second comm hook is refused, as DDP refuses it.
    ddp = ddp_of(MLP(), hook=bf16())
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except ValueError as e:
        res["second_hook"] = str(e)
    # prepare_model's DDP gets the reducer too.
    res["make_ddp"] = hasattr(make_ddp(MLP(), group, cpu), "_stalwart_reducer")

    # Overlap: the buckets' all-reduces against the moment the backward reaches the first
    # layer (the last gradient it computes), in the order they happened.
    model, opt = new(MLP)
    ddp = ddp_of(model)
    events: list[tuple[int, str]] = []
    issue = group.all_reduce_async

    def recorded(tensor, op=dist.ReduceOp.SUM):
        events.append((len(events), "all_reduce"))
        return issue(tensor, op)

    group.all_reduce_async = recorded
    model.layers[0].weight.register_post_accumulate_grad_hook(
        lambda p: events.append((len(events), "first layer's gradient"))
    )
    orders = []
    for step in range(3):
        events.clear()
        _step(ddp, opt, step, rank)
        orders.append([e for _, e in events])
    del group.all_reduce_async
    res["overlap"] = orders
    res["overlap_buckets"] = len(ddp._stalwart_reducer.buckets)

    # Generation 2 (a recovery): every DDP built again, the step-3 state restored.
    generation(2)
    res["resumed"], res["torch_resumed"] = {}, {}
    plain2 = plain_group(2)
    for name, kind in VARIANTS:
        for restore_hook in (True, False) if name == "powersgd" else (True,):
            model, opt = new(kind, seed=1)
            if name == "powersgd":
                state = powersgd()
                ddp = ddp_of(model, hook=(state, powerSGD_hook))
                if restore_hook:
                    stateful("p", state).load_state_dict(copy.deepcopy(at3[name]["hook"]))
            else:
                ddp = ddp_of(model, hook=hooks.get(name, lambda: None)())
            model.load_state_dict(at3[name]["model"])
            opt.load_state_dict(at3[name]["opt"])
            for step in range(3, 6):
                _step(ddp, opt, step, rank)
            key = name if restore_hook else "powersgd_state_lost"
            res["resumed"][key] = _bits(model) == straight[name]
    # torch's own DDP, for comparison: a long-lived one, and one built again at step 3
    # from that one's state (on gen 2's plain group).
    model, opt = new(MLP)
    ddp = ddp_of(model, pg=plain)
    for step in range(6):
        if step == 3:
            kept = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        _step(ddp, opt, step, rank)
    res["torch_resumed"]["long"] = _bits(model)
    model, opt = new(MLP, seed=1)
    model.load_state_dict(kept[0])
    opt.load_state_dict(kept[1])
    ddp = ddp_of(model, pg=plain2)
    for step in range(3, 6):
        _step(ddp, opt, step, rank)
    res["torch_resumed"]["fresh"] = _bits(model)

    # Generations 3 and 4: rank 1 steps alone, blocked in a user hook's collective (bf16's
    # all-reduce; PowerSGD's, once it compresses), released by the abort.
    for gen, name in ((3, "bf16"), (4, "powersgd")):
        generation(gen)
        model, opt = new(MLP)
        state = powersgd() if name == "powersgd" else None
        hook = (state, powerSGD_hook) if name == "powersgd" else bf16()
        ddp = ddp_of(model, hook=hook)  # construction is collective: every rank builds it
        together = 2 if name == "powersgd" else 0  # PowerSGD compresses from step 2
        for step in range(together):
            _step(ddp, opt, step, rank)
        if rank == 1:
            res[f"blocked_{name}"] = _blocked(
                functools.partial(_step, ddp, opt, together, rank), group
            )
            store.set(f"released{gen}", "1")
        else:
            store.wait([f"released{gen}"])
    return res


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=280) for _ in range(WORLD)), key=lambda g: g[0])
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, status, detail in got:
        assert status == "ok", f"rank {rank}:\n{detail}"
    return [g[2] for g in got]


def test_the_layout_is_fixed_by_the_parameters_and_the_caps():
    f32 = [torch.zeros(256) for _ in range(6)]  # 1 KiB each
    # Reverse registration order, cut at the cap, the first bucket at its own cap.
    assert bucket_layout(f32, cap_bytes=2048, first_cap_bytes=1024) == [[5], [4, 3], [2, 1], [0]]
    assert bucket_layout(f32, cap_bytes=10**9, first_cap_bytes=10**9) == [[5, 4, 3, 2, 1, 0]]
    # Per dtype: each its own buckets (and first bucket), ordered by when they fill.
    mixed = [
        torch.zeros(512, dtype=torch.bfloat16),
        *f32[:3],
        torch.zeros(512, dtype=torch.bfloat16),
    ]
    assert bucket_layout(mixed, cap_bytes=2048, first_cap_bytes=1024) == [
        [4],
        [3],
        [2, 1],
        [0],
    ]
    assert FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


def test_the_averages_are_torchs_up_to_rounding(ranks):
    for name in ("default", "reversed", "bf16", "own", "mixed"):
        for res in ranks:
            assert len(res["vs_torch"][name]) == 6
            # bf16: both sides compress, in different buckets; fp32: summation order only.
            bound = 1e-2 if name == "bf16" else 1e-5
            assert max(res["vs_torch"][name]) < bound, (name, res["vs_torch"][name])
    for name, _ in VARIANTS:
        assert ranks[0]["ranks_agree"][name] == ranks[1]["ranks_agree"][name]
        assert ranks[0]["ranks_agree"][name] == ranks[2]["ranks_agree"][name]
        assert ranks[0]["nbuckets"][name] > 2


def test_a_recovered_ddp_reduces_bit_exactly_with_and_without_a_hook(ranks):
    for res in ranks:
        for name, _ in VARIANTS:
            assert res["resumed"][name] is True, name
        # PowerSGD's own state (error feedback, Q, its iteration) is part of the result:
        # without it restored (ctx.register(powersgd=state)) the run does not match.
        assert res["resumed"]["powersgd_state_lost"] is False
    # Three ranks make the layout matter: torch's own DDP, built again from the same
    # state, ends with other bits than its long-lived twin.
    assert ranks[0]["torch_resumed"]["fresh"] != ranks[0]["torch_resumed"]["long"]


def test_ddps_own_buffer_is_reduced_in_place_where_its_bucket_is_stalwarts(ranks):
    for res in ranks:
        # A model run in registration order: DDP's rebuilt buckets are stalwart's.
        assert set(res["sources"]["default"]) == {"ddp's buffer"}
        assert set(res["sources"]["mixed"]) == {"ddp's buffer"}
        # Run in reverse, DDP's buckets cut across stalwart's: gradients are copied.
        assert set(res["sources"]["reversed"]) == {"copy"}
        assert len(res["sources"]["reversed"]) == res["nbuckets"]["reversed"]


def test_a_mixed_dtype_model_is_on_the_same_path(ranks):
    assert ranks[0]["dtypes"]["mixed"] == ["torch.bfloat16", "torch.float32"]
    assert ranks[0]["dtypes"]["default"] == ["torch.float32"]


def test_a_hook_of_ones_own_sees_stalwarts_buckets_in_order_once_each(ranks):
    for res in ranks:
        n = res["nbuckets"]["own"]
        assert res["seen"]["own"] == [(i, i == n - 1) for i in range(n)]


def test_a_second_comm_hook_is_refused_and_prepare_model_reduces_in_buckets(ranks):
    assert "has a comm hook already" in ranks[0]["second_hook"]
    assert ranks[0]["make_ddp"] is True


def test_buckets_are_all_reduced_while_the_backward_still_runs(ranks):
    for res in ranks:
        n = res["overlap_buckets"]
        first, *later = res["overlap"]
        # Step 0: DDP has one bucket of everything until it rebuilds, so it calls the hook
        # once, at the backward's end: nothing to overlap yet.
        assert first.index("first layer's gradient") == 0
        for order in later:
            assert order.count("all_reduce") == n
            # Every bucket but the one holding the first layer is issued before its
            # gradient exists.
            assert order.index("first layer's gradient") >= n - 1, order


@pytest.mark.parametrize("hook", ["bf16", "powersgd"])
def test_an_abort_releases_a_rank_blocked_in_a_user_hooks_collective(ranks, hook):
    raised, was_pending = ranks[1][f"blocked_{hook}"]
    assert was_pending, "no collective was pending when the abort came"
    assert "a peer died" in raised, raised

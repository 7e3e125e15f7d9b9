"""torch.distributed as a train loop calls it, on stalwart's group (worker/torch_group.py,
worker/torchrun.py): init_process_group hands back the generation's group, every
collective works and is released by an abort, a DDP the loop builds broadcasts rank 0's
state and resumes bit-exactly on a second generation. Two real gloo processes on loopback."""

from __future__ import annotations

import copy
import datetime
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.orchestrator.worker import torchrun
from stalwart.orchestrator.worker.collective import ElasticGroup, GroupAborted

pytestmark = pytest.mark.timeout(120)

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configure(group: ElasticGroup, store, rank: int, gen: int) -> None:
    group.configure(
        dist.PrefixStore(f"gen{gen}", store),
        rank,
        WORLD,
        gen,
        "gloo",
        torch.device("cpu"),
        "127.0.0.1",
        datetime.timedelta(seconds=60),
    )


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)
        self.bn = torch.nn.BatchNorm1d(4)
        self.drop = torch.nn.Dropout(0.2)
        self.fc = torch.nn.Linear(4 * 6, 3)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def _steps(ddp, opt, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        torch.manual_seed(10_000 + 100 * step + rank)  # dropout
        x, y = torch.randn(5, 2, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()


def _params(module: torch.nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in module.parameters()]


def _blocked(call, group: ElasticGroup) -> tuple[str, float, bool]:
    """Run `call` (a collective the peer never joins); abort once it is pending; what it
    raised, how long after the abort, and whether it was pending (blocked) when aborted."""
    aborted_at: list[float] = []
    pending: list[bool] = []

    def abort() -> None:
        deadline = time.monotonic() + 20
        while group.pending_since() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the condition, with a deadline
        pending.append(group.pending_since() is not None)
        aborted_at.append(time.monotonic())
        group.abort("a peer died")

    aborter = threading.Thread(target=abort)
    aborter.start()
    try:
        call()
    except Exception as e:
        aborter.join()
        return type(e).__name__ + ": " + str(e)[:200], time.monotonic() - aborted_at[0], pending[0]
    aborter.join()
    return "returned", 0.0, pending[0]


def _worker(rank: int, port: int, out) -> None:
    try:
        torchrun.install()
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
        group = ElasticGroup()
        res: dict = {}
        _configure(group, store, rank, 1)
        # What a torchrun script does first.
        dist.init_process_group(backend="gloo")
        dist.init_process_group("nccl", rank=rank, world_size=WORLD)  # warned, not refused
        try:
            dist.init_process_group(world_size=WORLD + 1)
        except ValueError as e:
            res["wrong_world"] = str(e)
        res["identity"] = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["all_reduce"] = t.tolist()
        t = torch.full((2,), float(rank))
        dist.broadcast(t, src=1)
        res["broadcast"] = t.tolist()
        parts = [torch.zeros(2) for _ in range(WORLD)]
        dist.all_gather(parts, torch.full((2,), float(rank)))
        res["all_gather"] = [p.tolist() for p in parts]
        whole = torch.zeros(2 * WORLD)
        dist.all_gather_into_tensor(whole, torch.full((2,), float(rank)))
        res["all_gather_into_tensor"] = whole.tolist()
        mine = torch.zeros(2)
        dist.reduce_scatter_tensor(mine, torch.arange(4.0) * (rank + 1))
        res["reduce_scatter_tensor"] = mine.tolist()
        got = torch.zeros(1)
        dist.reduce_scatter(got, [torch.full((1,), float(r + rank)) for r in range(WORLD)])
        res["reduce_scatter"] = got.tolist()
        objects: list = [None] * WORLD
        dist.all_gather_object(objects, {"rank": rank})
        res["all_gather_object"] = objects
        dist.barrier()
        # A DDP the loop builds: rank 0's parameters and buffers are broadcast.
        torch.manual_seed(rank)  # a rank-dependent init, as careless code has
        net = Net()
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        res["buckets"] = getattr(ddp, "_stalwart_reducer", None) is not None
        res["init"] = _params(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        _steps(ddp, opt, rank, range(3))
        at3 = {
            "model": {k: v.clone() for k, v in net.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()),
        }
        _steps(ddp, opt, rank, range(3, 6))
        res["straight"] = _params(net)
        dist.destroy_process_group()  # a script's last line: stalwart's group stays
        res["after_destroy"] = dist.is_initialized()
        # Generation 2: everything built again, the step-3 state restored, same end.
        _configure(group, store, rank, 2)
        dist.init_process_group("gloo")
        net2 = Net()
        ddp2 = torch.nn.parallel.DistributedDataParallel(net2)
        net2.load_state_dict(at3["model"])
        opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
        opt2.load_state_dict(at3["opt"])
        _steps(ddp2, opt2, rank, range(3, 6))
        res["resumed"] = _params(net2)
        # A collective the peer never joins, released by an abort (rank 1 only; rank 0
        # waits in the store meanwhile).
        if rank == 1:
            res["barrier"] = _blocked(dist.barrier, group)
        store.set(f"done{rank}", "1")
        store.wait([f"done{1 - rank}"])
        _configure(group, store, rank, 3)
        if rank == 1:
            res["all_reduce_blocked"] = _blocked(lambda: dist.all_reduce(torch.ones(4)), group)
        store.set(f"done3-{rank}", "1")
        store.wait([f"done3-{1 - rank}"])
        _configure(group, store, rank, 4)
        if rank == 1:
            res["reduce_scatter_blocked"] = _blocked(
                lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4)), group
            )
        store.set(f"done4-{rank}", "1")
        store.wait([f"done4-{1 - rank}"])
        _configure(group, store, rank, 5)
        if rank == 1:
            net3 = Net()
            ddp3 = torch.nn.parallel.DistributedDataParallel(net3, broadcast_buffers=False)
            store.set("ddp3", "1")

            def backward() -> None:
                loss = ddp3(torch.randn(5, 2, 8)).sum()
                loss.backward()

            res["backward_blocked"] = _blocked(backward, group)
        else:
            # Rank 0 builds its DDP too (construction is collective), then never steps.
            torch.nn.parallel.DistributedDataParallel(Net(), broadcast_buffers=False)
            store.wait(["ddp3"])
        res["aborted_type"] = GroupAborted.__name__
        out.put((rank, "ok", res))
    except Exception:
        out.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=100) for _ in range(WORLD)), key=lambda g: g[0])
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, status, detail in got:
        assert status == "ok", f"rank {rank}:\n{detail}"
    return [g[2] for g in got]


def test_init_process_group_hands_back_the_generations_group(ranks):
    for rank, res in enumerate(ranks):
        assert res["identity"] == (rank, WORLD, "gloo")
        assert "world_size is 2" in res["wrong_world"] and "WORLD_SIZE" in res["wrong_world"]
        assert res["after_destroy"] is True


def test_every_collective_a_loop_calls_gives_torchs_answer(ranks):
    r0, r1 = ranks
    for res in ranks:
        assert res["all_reduce"] == [3.0, 3.0, 3.0]
        assert res["broadcast"] == [1.0, 1.0]
        assert res["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert res["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert res["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
    # sum over ranks of arange(4) * (rank + 1) = [0, 3, 6, 9], split in halves.
    assert r0["reduce_scatter_tensor"] == [0.0, 3.0] and r1["reduce_scatter_tensor"] == [6.0, 9.0]
    assert r0["reduce_scatter"] == [1.0] and r1["reduce_scatter"] == [3.0]


def test_a_ddp_the_loop_builds_is_consistent_and_resumes_bit_exactly(ranks):
    r0, r1 = ranks
    assert r0["buckets"] and r1["buckets"]
    assert r0["init"] == r1["init"]  # rank 0's parameters, broadcast at construction
    assert r0["straight"] == r1["straight"]
    assert r0["resumed"] == r0["straight"] and r1["resumed"] == r1["straight"]


@pytest.mark.parametrize(
    "call", ["barrier", "all_reduce_blocked", "reduce_scatter_blocked", "backward_blocked"]
)
def test_a_collective_the_peer_never_joins_is_released_by_the_abort(ranks, call):
    raised, after_s, was_pending = ranks[1][call]
    assert was_pending, "the collective was not blocked when the abort came"
    assert "a peer died" in raised, raised
    # Released by the abort itself, not by gloo's 60 s timeout.
    assert after_s < 30, after_s


def test_a_collective_that_returns_no_work_is_passed_through():
    """NCCL returns no Work for a synchronous collective (asyncOp False: ordered on the
    caller's stream), and torch's all_reduce then waits for nothing. The group hands the
    None back instead of failing on it: on an H200, FSDP2's all-reduce on a replicate
    dimension of one rank raised AttributeError in the group before this."""
    from stalwart.orchestrator.worker.collective import local_group
    from stalwart.orchestrator.worker.torch_group import AbortableProcessGroup

    real = local_group()
    issued = []

    class NoWork(dist.ProcessGroup):
        def allreduce(self, *args, **kwargs):
            issued.append(args)
            return None

    group = AbortableProcessGroup(
        NoWork(0, 1),
        [
            (
                torch.device("cpu"),
                dist.ProcessGroup.BackendType.GLOO,
                real._get_backend(torch.device("cpu")),
            )
        ],
        "gloo",
        ready=lambda: None,
        track=lambda fut: fut,
    )
    assert group.allreduce([torch.ones(2)], dist.AllreduceOptions()) is None
    assert len(issued) == 1
    # A collective that does return a Work is still owned (its future tracked).
    owned = AbortableProcessGroup(
        real,
        [
            (
                torch.device("cpu"),
                dist.ProcessGroup.BackendType.GLOO,
                real._get_backend(torch.device("cpu")),
            )
        ],
        "gloo",
        ready=lambda: None,
        track=lambda fut: fut,
    )
    t = torch.ones(2)
    work = owned.allreduce([t], dist.AllreduceOptions())
    assert work is not None and work.wait() and torch.equal(t, torch.ones(2))

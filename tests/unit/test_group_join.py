"""A rank joining a generation's group blocks until every rank has joined; a peer killed
before it joined would hold the others there for the whole collective timeout. An abort
of that generation releases the join at once (ElasticGroup._join), as it releases a
collective. Real gloo on a loopback TCPStore; the missing peer, when it joins (late, or in
time), is another process."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.orchestrator.worker.collective import ElasticGroup, GroupAborted, _wrap_backend

pytestmark = pytest.mark.timeout(60)

# Far longer than the test may take: a join released by its timeout would fail it.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def _store() -> dist.TCPStore:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=JOIN_TIMEOUT)


def _peer(port: int, generation: int, joined) -> None:
    """Rank 1 of generation `generation`, in a process of its own."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=JOIN_TIMEOUT)
    _wrap_backend(
        dist.PrefixStore(f"gen{generation}", store),
        1,
        2,
        "gloo",
        JOIN_TIMEOUT,
        torch.device("cpu"),
        "127.0.0.1",
    )
    joined.set()


def _start_peer(store: dist.TCPStore, generation: int):
    ctx = mp.get_context("spawn")
    joined = ctx.Event()
    proc = ctx.Process(target=_peer, args=(store.port, generation, joined), daemon=True)
    proc.start()
    return proc, joined


def _configure(group: ElasticGroup, store, generation: int) -> None:
    group.configure(
        dist.PrefixStore(f"gen{generation}", store),
        0,
        2,
        generation,
        "gloo",
        torch.device("cpu"),
        "127.0.0.1",
        JOIN_TIMEOUT,
    )


def test_an_abort_releases_a_rank_waiting_for_a_peer_that_never_joins():
    store, group = _store(), ElasticGroup()
    joining = threading.Event()
    raised: list[BaseException] = []

    def rank0() -> None:
        joining.set()
        try:
            _configure(group, store, 3)
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    assert joining.wait(10)
    # The join is under way (its helper thread waits in gloo for rank 1's address).
    deadline = threading.Event()
    while group._joining is None and not deadline.wait(0.01):
        pass
    group.abort("rank 1 died", generation=3)
    t.join(10)
    assert not t.is_alive(), "the abort did not release the join"
    assert len(raised) == 1 and isinstance(raised[0], GroupAborted), raised
    assert "rank 1 died" in str(raised[0])

    # Rank 1 joins after all: the abandoned group is built, and kept in the graveyard
    # (never destroyed on a training thread), not installed.
    proc, joined = _start_peer(store, 3)
    try:
        assert joined.wait(60), "the late peer did not join"
        done = threading.Event()
        while not group._graveyard and not done.wait(0.01):
            pass
        assert len(group._graveyard) == 1
        assert group.generation == 0  # still unconfigured: nothing of generation 3 took hold
    finally:
        proc.join(10)
        proc.kill()


def test_an_abort_that_comes_before_the_join_refuses_it():
    store, group = _store(), ElasticGroup()
    group.abort("rank 1 died before we started", generation=5)
    with pytest.raises(GroupAborted, match="before we started"):
        _configure(group, store, 5)
    assert group._joining is None


def test_an_abort_of_an_older_generation_leaves_the_join_alone():
    store, group = _store(), ElasticGroup()
    group.abort("the last generation's failure", generation=4)
    proc, _ = _start_peer(store, 5)
    try:
        _configure(group, store, 5)
        assert group.generation == 5 and group.aborted is None
    finally:
        proc.join(10)
        proc.kill()
        from stalwart.orchestrator.worker.collective import forget_group

        forget_group(group.process_group)

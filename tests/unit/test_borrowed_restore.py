"""A restore copies the snapshot's tensors once, into the objects' own (orchestrator/worker/
restore.py load_into): restore() hands out views of the payload (borrowed), a module copies
them into its parameters, a torch optimizer gets its state copied into the tensors it has,
or the last generation's optimizer had (a survivor allocates nothing), and anything that
may keep what it is given gets copies.
Nothing may end up pointing into the payload: the ring reuses its slot for a later step."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from stalwart.ckpt.snapshot import SnapshotBuffer, restore
from stalwart.orchestrator.worker.restore import load_into, owned

pytestmark = pytest.mark.timeout(60)


def _trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _snapshot(model, opt):
    state = {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}}
    return SnapshotBuffer().capture(2, state)


def _step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(500 + step)
    model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _bits(model) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def _inside(t: torch.Tensor, payload: torch.Tensor) -> bool:
    start = payload.data_ptr()
    return start <= t.data_ptr() < start + payload.numel()


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _tensors(v)


def _built(seed: int = 1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.mark.parametrize("case", ["survivor", "same objects", "fresh process"])
def test_a_borrowed_restore_goes_on_bit_for_bit_and_keeps_nothing_of_the_payload(case):
    model, opt = _trained()
    snap = _snapshot(model, opt)
    reference = copy.deepcopy((model, opt))
    retired = []
    if case == "survivor":  # the loop built its objects again; the last ones are retired
        old_model, old_opt = _trained()
        _step(old_model, old_opt, 99)
        retired = [old_opt]
        before = {id(t) for s in old_opt.state.values() for t in s.values()}
        live_model, live_opt = _built()
    elif case == "same objects":  # a loop that keeps its objects across generations
        live_model, live_opt = _trained()
        _step(live_model, live_opt, 99)
        retired = [live_opt]
        before = {id(t) for s in live_opt.state.values() for t in s.values()}
    else:  # a spare: the model built, an optimizer without state, nothing retired
        live_model, live_opt = _built()
    params = [id(p) for p in live_model.parameters()]

    state = restore(snap, borrow=True)
    assert all(_inside(t, snap.payload) for t in _tensors(state["objects"]))
    load_into(live_model, state["objects"]["model"], retired)
    load_into(live_opt, state["objects"]["optimizer"], retired)

    assert [id(p) for p in live_model.parameters()] == params
    held = [t for s in live_opt.state.values() for t in s.values() if torch.is_tensor(t)]
    assert held and not any(_inside(t, snap.payload) for t in held)
    assert len({id(t) for t in held}) == len(held)  # no tensor serves two
    if case != "fresh process":  # copied into tensors that were there: nothing allocated
        assert {id(t) for t in held} == before
    # The payload's slot is reused for a later step: what was restored does not change.
    snap.payload.fill_(7)
    ref_model, ref_opt = reference
    for step in range(3):
        _step(ref_model, ref_opt, step)
        _step(live_model, live_opt, step)
    assert _bits(live_model) == _bits(ref_model)


def test_an_object_that_keeps_what_it_is_given_gets_copies():
    class Keeper:
        def load_state_dict(self, state):
            self.state = state

    keeper = Keeper()
    payload = torch.arange(6, dtype=torch.float32)
    load_into(keeper, {"w": payload[:3], "nested": [payload[3:]]})
    payload.fill_(0)
    assert keeper.state["w"].tolist() == [0.0, 1.0, 2.0]
    assert keeper.state["nested"][0].tolist() == [3.0, 4.0, 5.0]


def test_owned_keeps_the_containers_and_a_state_dicts_metadata():
    Pair = collections.namedtuple("Pair", "a b")
    sd = collections.OrderedDict(w=torch.ones(2))
    sd._metadata = {"": {"version": 1}}
    out = owned({"sd": sd, "pair": Pair(torch.zeros(1), 3), "t": (torch.ones(1), "x")})
    assert type(out["sd"]) is collections.OrderedDict and out["sd"]._metadata == sd._metadata
    assert out["sd"]["w"] is not sd["w"] and torch.equal(out["sd"]["w"], sd["w"])
    assert isinstance(out["pair"], Pair) and out["pair"].b == 3
    assert type(out["t"]) is tuple and out["t"][1] == "x"

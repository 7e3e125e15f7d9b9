"""ckpt/snapshot.py: capture/restore round trips, buffer reuse, digests, safe unpickling."""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import random

import numpy as np
import pytest
import torch

from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, TensorRef, restore, state_digest


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert b.device.type == "cpu"
    assert torch.equal(a, b)


def assert_same_tree(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b or (a != a and b != b)  # NaN == NaN for this purpose


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


def test_round_trip_model_optimizer_and_nested_values(trained):
    model, opt = trained
    assert opt.state_dict()["state"], "optimizer state must exist after one step"
    state = {
        "step": 12,
        "objects": {"model": model.state_dict(), "optimizer": opt.state_dict()},
        "rng": {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "nested": (1, [2.5, None, "x", (True, b"\x00\xff")], {7: "int key", -1: None}),
        },
        "nan": float("nan"),
        "big": 2**70,
        "neg_zero": -0.0,
    }
    snap = SnapshotBuffer().capture(12, state)
    assert snap.step == 12
    back = restore(snap)
    assert_same_tree(state, back)

    # Restored tensors are copies: they neither alias the live state nor the buffer.
    w = back["objects"]["model"]["0.weight"]
    assert w.data_ptr() != model.state_dict()["0.weight"].data_ptr()
    w.add_(1.0)
    assert torch.equal(restore(snap)["objects"]["model"]["0.weight"], model[0].weight.detach())


def test_restored_state_loads_into_fresh_model_and_optimizer(trained):
    model, opt = trained
    snap = SnapshotBuffer().capture(1, {"m": model.state_dict(), "o": opt.state_dict()})
    back = restore(snap)

    torch.manual_seed(123)
    model2 = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(back["m"])
    opt2.load_state_dict(back["o"])

    x = torch.randn(3, 8)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    ],
)
def test_bit_exact_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point or dtype.is_complex:
        t = (torch.randn(7, 3, generator=g) * 1e3).to(dtype)
    elif dtype is torch.bool:
        t = torch.randint(0, 2, (7, 3), generator=g).bool()
    else:
        t = torch.randint(0, 100, (7, 3), generator=g).to(dtype)
    back = restore(SnapshotBuffer().capture(0, {"t": t}))["t"]
    assert_same_tensor(t, back)


def test_bit_exact_special_floats():
    t = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-45])
    back = restore(SnapshotBuffer().capture(0, [t]))[0]
    assert back.dtype == t.dtype
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))


def test_scalar_tensor():
    t = torch.tensor(3.5)
    back = restore(SnapshotBuffer().capture(0, {"s": t}))["s"]
    assert back.shape == ()
    assert_same_tensor(t, back)


def test_non_contiguous_tensors():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    views = {
        "transposed": base.t(),
        "strided": base[:, ::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(4, 2),
        "offset": base[2:4, 1:5],
    }
    for v in views.values():
        assert not v.is_contiguous() or v.storage_offset() > 0
    back = restore(SnapshotBuffer().capture(0, views))
    for name, v in views.items():
        assert_same_tensor(v, back[name])
        assert back[name].is_contiguous()


def test_zero_size_tensors():
    state = {
        "empty": torch.empty(0),
        "empty2d": torch.empty(0, 3, dtype=torch.int64),
        "after": torch.tensor([1, 2, 3], dtype=torch.int16),
    }
    back = restore(SnapshotBuffer().capture(0, state))
    for k, v in state.items():
        assert_same_tensor(v, back[k])


def test_only_zero_size_tensors():
    # The payload is empty (0 bytes); restore must still rebuild the empty tensors.
    back = restore(SnapshotBuffer().capture(0, {"e": torch.empty(0, 2)}))
    assert back["e"].shape == (0, 2)
    assert back["e"].dtype == torch.float32


def test_no_tensors():
    snap = SnapshotBuffer().capture(3, {"a": 1, "b": [None, "s"]})
    assert snap.metas == ()
    assert restore(snap) == {"a": 1, "b": [None, "s"]}


def test_same_tensor_twice():
    t = torch.arange(4)
    back = restore(SnapshotBuffer().capture(0, {"a": t, "b": t}))
    assert torch.equal(back["a"], t)
    assert torch.equal(back["b"], t)


def test_ordered_dict_and_containers_survive():
    state = collections.OrderedDict(
        [("z", torch.ones(2)), ("a", {1: (torch.zeros(1), [torch.full((2,), 7)])})]
    )
    back = restore(SnapshotBuffer().capture(0, state))
    assert isinstance(back, collections.OrderedDict)
    assert list(back) == ["z", "a"]
    assert_same_tree(state, back)


def test_allowed_skeleton_types():
    state = {
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "complex": 1 + 2j,
        "slice": slice(1, 10, 2),
        "od": collections.OrderedDict(a=1),
    }
    assert restore(SnapshotBuffer().capture(0, state)) == state


def test_tensor_metadata_and_alignment():
    state = [torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.float64)]
    snap = SnapshotBuffer().capture(0, state)
    m0, m1 = snap.metas
    assert (m0.offset, m0.nbytes, m0.dtype, m0.shape) == (0, 3, "uint8", (3,))
    assert (m1.offset, m1.nbytes, m1.dtype, m1.shape) == (64, 40, "float64", (5,))
    assert m0.device == "cpu"
    assert snap.nbytes == 128


def test_capture_is_a_copy_of_the_live_state():
    t = torch.arange(5.0)
    buf = SnapshotBuffer()
    snap = buf.capture(0, {"t": t})
    t.add_(100)
    assert torch.equal(restore(snap)["t"], torch.arange(5.0))


def test_buffer_reused_when_size_fits():
    buf = SnapshotBuffer()
    s1 = buf.capture(1, {"w": torch.ones(100)})
    ptr = s1.payload.data_ptr()
    s2 = buf.capture(2, {"w": torch.full((100,), 2.0)})
    assert s2.payload.data_ptr() == ptr
    s3 = buf.capture(3, {"w": torch.full((10,), 3.0)})  # smaller: still fits
    assert s3.payload.data_ptr() == ptr
    assert torch.equal(restore(s3)["w"], torch.full((10,), 3.0))
    # The previous snapshot of the same buffer is a view that now holds the new bytes:
    # a capture is only valid until the next capture into the same buffer.
    assert s2.payload.data_ptr() == ptr


def test_buffer_grows_when_needed():
    buf = SnapshotBuffer()
    s1 = buf.capture(1, {"w": torch.ones(16)})
    s2 = buf.capture(2, {"w": torch.ones(10_000)})
    assert s2.nbytes >= 40_000
    assert torch.equal(restore(s2)["w"], torch.ones(10_000))
    assert s1.nbytes < s2.nbytes


def test_snapshot_digest_tracks_content():
    buf = SnapshotBuffer()
    state = {"w": torch.arange(10.0), "n": 3}
    da = buf.capture(0, state).digest()
    assert buf.capture(0, state).digest() == da
    assert buf.capture(0, {"w": torch.arange(10.0), "n": 4}).digest() != da
    state["w"][3] = -1
    assert buf.capture(0, state).digest() != da


def test_snapshot_digest_same_state_same_digest_across_buffers():
    # Two buffers whose memory held different bytes before (e.g. earlier, larger captures).
    # The same state captured into each must digest the same: the alignment padding between
    # tensors must not leak stale bytes into the digest.
    a, b = SnapshotBuffer(), SnapshotBuffer()
    a.capture(0, {"fill": torch.full((256,), 0xAA, dtype=torch.uint8)})
    b.capture(0, {"fill": torch.full((256,), 0x55, dtype=torch.uint8)})
    state = {"small": torch.ones(3, dtype=torch.uint8), "w": torch.arange(4.0)}
    sa, sb = a.capture(1, state), b.capture(1, state)
    assert sa.skeleton == sb.skeleton
    assert sa.metas == sb.metas
    assert sa.digest() == sb.digest()


def test_restore_from_numpy_payload():
    snap = SnapshotBuffer().capture(5, {"w": torch.arange(6, dtype=torch.int32).reshape(2, 3)})
    copy = Snapshot(snap.step, snap.skeleton, snap.metas, snap.payload.numpy().copy())
    assert copy.nbytes == snap.nbytes
    assert copy.digest() == snap.digest()
    assert_same_tensor(torch.arange(6, dtype=torch.int32).reshape(2, 3), restore(copy)["w"])


# --- state_digest ----------------------------------------------------------------------------


def test_state_digest_stable_under_dict_order():
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    b = {"y": torch.ones(2, 2), "x": torch.arange(4.0)}
    assert state_digest(a) == state_digest(b)
    assert len(state_digest(a)) == 64


def test_state_digest_sensitive_to_one_value():
    a = {"x": torch.arange(1000.0), "y": torch.ones(3)}
    b = {"x": torch.arange(1000.0), "y": torch.ones(3)}
    b["x"][517] += 1e-3
    assert state_digest(a) != state_digest(b)


def test_state_digest_sensitive_to_name_dtype_and_shape():
    base = state_digest({"x": torch.zeros(4)})
    assert state_digest({"z": torch.zeros(4)}) != base
    assert state_digest({"x": torch.zeros(4, dtype=torch.float64)}) != base
    assert state_digest({"x": torch.zeros(2, 2)}) != base


def test_state_digest_non_contiguous_equals_contiguous():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert state_digest({"t": t}) == state_digest({"t": t.contiguous()})


def test_state_digest_zero_size():
    assert state_digest({"e": torch.empty(0)}) != state_digest({"e": torch.empty(0, 1)})


def test_state_digest_of_model_with_scalar_buffer():
    # BatchNorm keeps `num_batches_tracked` as a 0-dim int64 tensor; model_digest() hashes
    # state_dicts like this one.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    assert sd["1.num_batches_tracked"].dim() == 0
    assert state_digest(sd) == state_digest(dict(reversed(list(sd.items()))))


def test_state_digest_scalar_value_matters():
    assert state_digest({"s": torch.tensor(1.0)}) != state_digest({"s": torch.tensor(2.0)})


# --- the skeleton unpickler -----------------------------------------------------------------


class Custom:
    def __init__(self):
        self.x = 1


class RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def forged(obj) -> Snapshot:
    return Snapshot(0, pickle.dumps(obj, protocol=5), (), np.empty(0, dtype=np.uint8))


@pytest.mark.parametrize(
    "obj",
    [Custom(), {"ok": [1, 2], "bad": Custom()}, [datetime.date(2020, 1, 2), Custom()]],
    ids=["custom", "nested-custom", "beside-a-date"],
)
def test_skeleton_refuses_classes_outside_allowed_list(obj):
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        restore(forged(obj))


def test_skeleton_refuses_os_system(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match=r"system, refused"):
        restore(forged({"state": RunsShell(marker)}))
    assert not marker.exists()


def test_skeleton_allows_tensor_ref():
    snap = SnapshotBuffer().capture(0, [torch.ones(1)])
    assert isinstance(pickle.loads(snap.skeleton)[0], TensorRef)


def test_a_handed_over_payload_keeps_its_checksum_and_a_flipped_byte_breaks_it():
    import numpy as np

    from stalwart.ckpt.snapshot import Snapshot, payload_checksum

    payload = np.arange(4096, dtype=np.uint8)
    snap = Snapshot(3, b"", (), payload, payload_checksum(payload))
    assert snap.intact()
    assert Snapshot(3, b"", (), payload).intact()  # none taken: nothing to check
    payload[100] ^= 0xFF
    assert not snap.intact()

"""ckpt/skeleton.py: what a state dict may hold round-trips through a snapshot; anything else
is refused when it is captured, with the path of the value, never at the first restore."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import fractions
import pathlib
import pickle
import threading
import uuid

import numpy as np
import pytest
import torch

from stalwart.ckpt.skeleton import UnsafeState, format_path
from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer, TensorRef, restore
from stalwart.orchestrator.worker.context import _unsafe_message


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = 2


class Opaque:
    def __init__(self):
        self.x = 1


def roundtrip(state):
    return restore(SnapshotBuffer().capture(3, state))


def test_what_a_sampler_or_scheduler_keeps_round_trips():
    rng = np.random.default_rng(7)
    rng.random(5)
    state = {
        "perm": np.random.default_rng(0).permutation(10),
        "weights": np.linspace(0, 1, 4, dtype=np.float32),
        "names": np.array(["a", "bc"]),
        "epoch": np.int64(3),
        "lr": np.float32(0.5),
        "flag": np.bool_(True),
        "rng": rng,
        "legacy_rng": np.random.RandomState(3),
        "bitgen": np.random.default_rng(1).bit_generator.state,
        "phase": Phase.MAIN,
        "started": datetime.datetime(2026, 12, 1, 8, 0, tzinfo=datetime.UTC),
        "day": datetime.date(2026, 12, 1),
        "every": datetime.timedelta(minutes=5),
        "root": pathlib.Path("/data/shards"),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "cost": decimal.Decimal("1.25"),
        "share": fractions.Fraction(1, 3),
        "recent": collections.deque([1, 2], maxlen=5),
        "nested": [{"t": torch.arange(3), "s": {1, 2}, "c": 1 + 2j}, (None, "x", 1.5)],
    }
    back = roundtrip(state)
    for key in ("perm", "weights", "names"):
        assert isinstance(back[key], np.ndarray) and back[key].dtype == state[key].dtype
        np.testing.assert_array_equal(back[key], state[key])
    for key in ("epoch", "lr", "flag"):
        assert type(back[key]) is type(state[key]) and back[key] == state[key]
    # Generators continue exactly where they were.
    assert back["rng"].random() == state["rng"].random()
    assert back["legacy_rng"].randint(1000) == state["legacy_rng"].randint(1000)
    assert back["bitgen"] == state["bitgen"]
    assert back["phase"] is Phase.MAIN
    for key in ("started", "day", "every", "root", "id", "cost", "share"):
        assert back[key] == state[key] and type(back[key]) is type(state[key])
    assert back["recent"] == state["recent"] and back["recent"].maxlen == 5
    assert torch.equal(back["nested"][0]["t"], torch.arange(3))
    assert back["nested"][0]["s"] == {1, 2} and back["nested"][1] == (None, "x", 1.5)


def test_an_unknown_object_is_refused_at_capture_with_its_path():
    state = {"objects": {"sched": {"ok": 1, "hooks": [0.5, Opaque()]}}}
    with pytest.raises(UnsafeState) as e:
        SnapshotBuffer().capture(0, state)
    assert e.value.path == ("objects", "sched", "hooks", 1)
    assert "test_skeleton.Opaque" in e.value.what and "does not restore" in e.value.what


def test_a_value_pickle_cannot_take_is_refused_at_capture_with_its_path():
    state = {"objects": {"loader": {"lock": threading.Lock()}}, "rng": {}}
    with pytest.raises(UnsafeState) as e:
        SnapshotBuffer().capture(0, state)
    assert e.value.path == ("objects", "loader", "lock")
    assert "cannot be pickled" in e.value.what


def test_an_object_array_is_refused_unless_its_items_are_values():
    assert list(roundtrip({"a": np.array([1, "x"], dtype=object)})["a"]) == [1, "x"]
    with pytest.raises(UnsafeState) as e:
        SnapshotBuffer().capture(0, {"a": np.array([Opaque()], dtype=object)})
    assert e.value.path == ("a",)


def test_an_enum_of_a_module_not_imported_is_refused_on_restore():
    # A checkpoint never makes the restoring process import a module: forge a skeleton that
    # names a class in a module nobody imported (same length as the real one's name).
    data = pickle.dumps({"k": TensorRef(0)}, protocol=5).replace(
        b"stalwart.ckpt.snapshot", b"absent_plugin.enums_xy"
    )
    forged = Snapshot(0, data, (), np.empty(0, dtype=np.uint8))
    with pytest.raises(
        pickle.UnpicklingError, match=r"absent_plugin\.enums_xy\.TensorRef, refused"
    ):
        restore(forged)


def test_the_users_message_names_the_registered_object_and_the_key_path():
    e = UnsafeState(("objects", "sched", "hooks", 1), "a mymod.Thing, which ...")
    text = _unsafe_message(e)
    assert text.startswith("ctx.register(sched=...): sched.state_dict()['hooks'][1] is a mymod")
    assert "convert the value in state_dict()/load_state_dict()" in text
    assert format_path(("a", 0)) == "['a'][0]"


def test_the_check_runs_when_a_kind_of_value_first_appears(monkeypatch):
    import stalwart.ckpt.snapshot as snapshot

    calls = []
    real = snapshot.check
    monkeypatch.setattr(snapshot, "check", lambda *a: calls.append(1) or real(*a))
    buf = SnapshotBuffer()
    for step in range(5):  # values change, kinds do not: checked once
        buf.capture(step, {"step": step, "lr": 0.1 * step, "w": torch.ones(2)})
    assert len(calls) == 1
    buf.capture(5, {"step": 5, "when": datetime.date(2026, 1, 1)})  # a new kind: checked
    assert len(calls) == 2
    # A value of an already-passed kind that is refused still cannot slip through later.
    with pytest.raises(UnsafeState) as e:
        buf.capture(6, {"step": 6, "hook": Opaque()})
    assert e.value.path == ("hook",)


def test_containers_of_arbitrary_items_are_checked_at_every_capture():
    buf = SnapshotBuffer()
    buf.capture(0, {"recent": collections.deque([1, 2]), "seen": {1}})
    with pytest.raises(UnsafeState) as e:
        buf.capture(1, {"recent": collections.deque([Opaque()]), "seen": {1}})
    assert e.value.path == ("recent",)
    buf.capture(2, {"a": np.array([1, "x"], dtype=object)})
    with pytest.raises(UnsafeState):
        buf.capture(3, {"a": np.array([Opaque()], dtype=object)})

"""Fencing on a real Ray (issue 24): what a node cut off by a partition still does once it
heals, against the node agents and the durable tier of the generation that replaced it.
Each path refuses it and says so with an event: the ring (a rank's hand-over), the replicas
(a copy for a peer), the durable store (a write the old generation started). The
supervisor's path (a replaced process's calls) is tests/unit/test_fence.py's, and the whole
story on a real partition is tests/chaos/test_network.py's partition scenario."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.chaos.fencing import audit, check
from tests.component.test_channel import _agent, _snap, _until, connected  # noqa: F401

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]


def test_a_healed_nodes_old_generation_is_refused_by_every_path(connected, tmp_path):  # noqa: F811
    from stalwart.orchestrator.agent.channel import StaleCopy
    from stalwart.orchestrator.spec import PersistSpec
    from stalwart.orchestrator.supervisor.persist import Persister

    ray = connected
    live, cut = _agent(ray, "l", str(tmp_path)), _agent(ray, "c", str(tmp_path))
    events: list = []
    persister = Persister(
        PersistSpec(uri=str(tmp_path / "durable"), every_steps=10),
        "job",
        lambda kind, **kw: events.append({"type": kind, **kw}),
        run="run-1",
    )
    try:
        # Generation 1 trains; the cut node holds rank 0's step 10, and its write to
        # storage is asked for before the cut.
        persister.fence(1)
        ray.get(cut.put_shard.remote(0, _snap(10), 1))
        persister.start(10, 1, {"c": (cut, [0])})
        # The cut: generation 2 restarts from step 8 on the live node (the cut node is
        # never told: it is unreachable).
        ray.get(live.prune.remote(above=8, seq=(0, 1), fence=2))
        persister.fence(2, restore_step=8)
        # The cut node heals: its old ranks hand over step 12, its agent sends the copy.
        ray.get(live.put_shard.remote(0, _snap(12), 1))
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(live.put_replica.remote(1, _snap(12), 1))
        assert isinstance(e.value.cause, StaleCopy)
        assert "written by generation 1, fenced off: generation 2 restarted from step 8" in str(
            e.value.cause
        )
        rep = ray.get(live.report.remote())
        assert rep["stored"] == {} and rep["replicas"] == {}  # neither kept
        notes = {n["path"]: n for n in rep["notes"]}
        assert set(notes) == {"ring", "replicas"} and all(
            n["type"] == "fenced" and n["generation"] == 1 for n in notes.values()
        )
        # The write generation 1 asked for ends on the cut node: dropped, never committed.
        [dropped] = [e for e in events if e["type"] == "persist_fenced"]
        assert dropped["path"] == "durable" and dropped["generation"] == 1
        _until(lambda: list((tmp_path / "durable" / "job").glob("step-*/__0_0.gen1.distcp")))
        persister.poll()
        assert persister.idle() and persister.store.split_complete([10]) == ([], [10])
        gens = [{"type": "generation", "generation": g, "ts": 0.0} for g in (1, 2)]
        ok, detail = check(audit(str(tmp_path / "durable"), "job", "run-1"), gens + events)
        assert ok and detail.startswith("0 steps on "), detail
        assert "1 file(s) no manifest lists" in detail
    finally:
        ray.get([x.close.remote() for x in (live, cut)])

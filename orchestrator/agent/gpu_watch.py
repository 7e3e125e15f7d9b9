"""A node agent's watch on its node's GPUs: a probe thread (health/gpu_probe.py) keeps the
latest reading per GPU and the Xids seen since the last report, which the agent's report
hands to the supervisor's health checks."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from stalwart.health.gpu_probe import FakeGpuProbe, GpuProbe, make_probe
from stalwart.health.xid import GpuReading


class GpuWatch:
    def __init__(self, probe: str, node_id: str, interval_s: float):
        """`probe`: health.gpu.probe (none, nvml, fake)."""
        self.node_id = node_id
        self._interval = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._latest: dict[int, GpuReading] = {}
        self._xids: dict[int, list[int]] = {}
        self.error: str | None = None  # why the probe cannot read, if it cannot
        try:
            self.probe: GpuProbe | None = make_probe(probe, node_id)
        except RuntimeError as e:
            self.probe, self.error = None, str(e)
        if self.probe is not None:
            threading.Thread(target=self._loop, daemon=True, name="gpu-probe").start()

    @property
    def kind(self) -> str | None:
        return self.probe.kind if self.probe else None

    def read_once(self) -> None:
        readings = self.probe.read()
        with self._lock:
            for r in readings:
                self._latest[r.index] = r
                if r.xids:
                    self._xids.setdefault(r.index, []).extend(r.xids)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.read_once()
            except Exception as e:  # a probe that cannot read is reported, not fatal
                self.error = f"{type(e).__name__}: {e}"
            self._stop.wait(self._interval)

    def inject(self, index: int, xid: int) -> None:
        """Chaos: the fake probe reports Xid `xid` on GPU `index` (read at once)."""
        if not isinstance(self.probe, FakeGpuProbe):
            raise RuntimeError(
                f"gpu_xid faults need the fake GPU probe; node {self.node_id[:12]} uses "
                f"{self.kind or 'none'} (set health.gpu.probe: fake)"
            )
        self.probe.inject(index, xid=xid)
        self.read_once()

    def report(self) -> list[dict[str, Any]]:
        """Each GPU's latest reading, with the Xids seen since the last report."""
        with self._lock:
            xids, self._xids = self._xids, {}
            latest = sorted(self._latest.items())
        return [{**dataclasses.asdict(r), "xids": xids.get(i, [])} for i, r in latest]

    def close(self) -> None:
        self._stop.set()
        if self.probe is not None:
            self.probe.close()

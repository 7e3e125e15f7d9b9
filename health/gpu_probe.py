"""GPU probes: read each GPU of a node into GpuReadings. Judgment lives in health/xid.py.

Two implementations behind one interface:

- NvmlGpuProbe (nvidia-ml-py): Xid critical-error events, volatile uncorrected ECC
  counts, retired pages, row-remapping failure, temperature, power; a GPU that stops
  answering (NVML_ERROR_GPU_IS_LOST) is reported lost.
- FakeGpuProbe: for machines without GPUs; its faults come from the chaos injector
  (``gpu_xid``), so the whole path from probe to cordon runs on CPU-only machines.

NVML sees every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, so one probe per
node (in the node agent) covers all ranks there; ranks say which GPU index they use.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Protocol

from stalwart.health.xid import GpuReading


class GpuProbe(Protocol):
    kind: str

    def read(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


class FakeGpuProbe:
    """A node's GPUs as the chaos injector says they are: healthy (a constant
    IDLE_TEMPERATURE_C and IDLE_POWER_W, so the readings' path is exercised end to end)
    until a fault is injected."""

    kind = "fake"
    IDLE_TEMPERATURE_C = 35.0
    IDLE_POWER_W = 60.0

    def __init__(self, node: str, n_gpus: int = 8, clock=time.time):
        self.node = node
        self.n_gpus = n_gpus
        self._clock = clock
        self._lock = threading.Lock()
        self._xids: dict[int, list[int]] = {}
        self._lost: set[int] = set()
        self._ecc: dict[int, int] = {}

    def inject(self, index: int, xid: int | None = None, lost: bool = False, ecc: int = 0) -> None:
        with self._lock:
            if xid is not None:
                self._xids.setdefault(index, []).append(xid)
            if lost:
                self._lost.add(index)
            self._ecc[index] = self._ecc.get(index, 0) + ecc

    def read(self) -> list[GpuReading]:
        with self._lock:
            xids, self._xids = self._xids, {}
            now = self._clock()
            return [
                GpuReading(
                    self.node,
                    i,
                    now,
                    xids=tuple(xids.get(i, ())),
                    temperature_c=None if i in self._lost else self.IDLE_TEMPERATURE_C,
                    power_w=None if i in self._lost else self.IDLE_POWER_W,
                    ecc_uncorrected=self._ecc.get(i, 0),
                    lost=i in self._lost,
                )
                for i in range(self.n_gpus)
            ]

    def close(self) -> None:
        pass


class NvmlGpuProbe:
    """The real probe. `nvml` is the pynvml module (injectable for tests)."""

    kind = "nvml"

    def __init__(self, node: str, nvml: Any = None, clock=time.time):
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        self.node = node
        self._clock = clock
        nvml.nvmlInit()
        self.count = nvml.nvmlDeviceGetCount()
        self.handles: list[Any] = []
        for i in range(self.count):
            try:
                self.handles.append(nvml.nvmlDeviceGetHandleByIndex(i))
            except nvml.NVMLError:
                self.handles.append(None)  # reported lost by read()
        self._events = None
        self.xid_events: list[int] = []  # GPUs whose Xid events are watched
        with contextlib.suppress(nvml.NVMLError):
            # Xid events need root or a supported GPU; the other readings still work.
            self._events = nvml.nvmlEventSetCreate()
        for i, h in enumerate(self.handles):
            if self._events is None or h is None:
                continue
            with contextlib.suppress(nvml.NVMLError):  # this GPU cannot report Xids
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
                self.xid_events.append(i)
        if self._events is not None and not self.xid_events:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(self._events)
            self._events = None

    def _drain_xids(self) -> dict[int, list[int]]:
        nvml, out = self.nvml, {}
        if self._events is None:
            return out
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as e:
                if getattr(e, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    out.setdefault(-1, []).append(0)  # unreadable: reported below
                break
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:
                index = -1  # a GPU that cannot say its index: reported below
            out.setdefault(index, []).append(int(data.eventData))
        return out

    def _read_one(self, i: int, xids: tuple[int, ...], now: float) -> GpuReading:
        nvml, h = self.nvml, self.handles[i]
        if h is None:
            return GpuReading(self.node, i, now, xids=xids, lost=True, error="no NVML handle")
        fields: dict[str, Any] = {}
        errors = []

        def get(name: str, fn, *args) -> None:
            try:
                fields[name] = fn(h, *args)
            except nvml.NVMLError as e:
                if getattr(e, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
                    fields["lost"] = True
                elif getattr(e, "value", None) != nvml.NVML_ERROR_NOT_SUPPORTED:
                    errors.append(f"{name}: {e}")

        get("temperature_c", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        get("power_mw", nvml.nvmlDeviceGetPowerUsage)
        get(
            "ecc_uncorrected",
            nvml.nvmlDeviceGetTotalEccErrors,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        get(
            "retired",
            nvml.nvmlDeviceGetRetiredPages,
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        get("remapped", nvml.nvmlDeviceGetRemappedRows)
        remapped = fields.get("remapped")
        return GpuReading(
            self.node,
            i,
            now,
            xids=xids,
            temperature_c=fields.get("temperature_c"),
            power_w=fields["power_mw"] / 1000 if "power_mw" in fields else None,
            ecc_uncorrected=int(fields.get("ecc_uncorrected", 0)),
            retired_pages=len(fields.get("retired", ())),
            remap_failure=bool(remapped[3]) if remapped else False,
            lost=bool(fields.get("lost")),
            error="; ".join(errors) or None,
        )

    def read(self) -> list[GpuReading]:
        now = self._clock()
        xids = self._drain_xids()
        readings = [self._read_one(i, tuple(xids.get(i, ())), now) for i in range(self.count)]
        if -1 in xids:
            readings.append(
                GpuReading(
                    self.node,
                    -1,
                    now,
                    xids=tuple(x for x in xids[-1] if x),
                    error="Xid events from an unknown GPU, or the event wait failed",
                )
            )
        return readings

    def close(self) -> None:
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def make_probe(kind: str, node: str, nvml: Any = None) -> GpuProbe | None:
    """`kind` from the job spec: auto, nvml, fake or none.

    auto: NVML when it initialises and sees at least one GPU, else the fake probe.
    nvml: NVML or a RuntimeError saying why not.
    """
    if kind == "none":
        return None
    if kind == "fake":
        return FakeGpuProbe(node)
    try:
        probe = NvmlGpuProbe(node, nvml)
    except Exception as e:  # no library, no driver, no permission
        if kind == "nvml":
            raise RuntimeError(f"health.gpu.probe=nvml, but NVML is not usable here: {e}") from e
        return FakeGpuProbe(node)
    if probe.count == 0 and kind == "auto":
        probe.close()
        return FakeGpuProbe(node)
    return probe

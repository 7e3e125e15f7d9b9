"""health/gpu_probe.py: the fake probe, the NVML probe over a fake pynvml, and make_probe."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from stalwart.health.gpu_probe import FakeGpuProbe, NvmlGpuProbe, make_probe
from stalwart.health.xid import GpuReading, judge_gpus

# --- a fake pynvml ----------------------------------------------------------------------------


class NVMLError(Exception):
    """pynvml's error: `.value` is the NVML return code."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            FakeNvml.NVML_ERROR_UNKNOWN: "Unknown Error",
            FakeNvml.NVML_ERROR_TIMEOUT: "Timeout",
            FakeNvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
            FakeNvml.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            FakeNvml.NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
            FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        }.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    temperature_c: int = 55
    power_mw: int = 250_000
    ecc_uncorrected: int = 0
    retired: list[int] = field(default_factory=list)
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    # nvml function name -> NVML error code it raises for this GPU
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Handle:
    index: int


class FakeNvml:
    """Just enough of pynvml for NvmlGpuProbe, with calls recorded."""

    NVMLError = NVMLError
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_UNKNOWN = 999
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlEventTypeSingleBitEccError = 0x1
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, n_gpus: int = 2):
        self.gpus = [FakeGpu() for _ in range(n_gpus)]
        self.calls: list[tuple] = []
        self.init_error: int | None = None
        self.count_error: int | None = None
        self.event_set_error: int | None = None
        self.register_error: int | None = None
        self.wait_error: int | None = None  # raised once the queue is empty (TIMEOUT if None)
        self.events: list[SimpleNamespace] = []
        self.registered: list[tuple[Handle, int, object]] = []
        self.freed: list[object] = []
        self.shutdowns = 0

    # -- test helpers --
    def xid(self, index: int, code: int) -> None:
        self.events.append(
            SimpleNamespace(
                device=Handle(index), eventType=self.nvmlEventTypeXidCriticalError, eventData=code
            )
        )

    def _gpu(self, handle: Handle, fn: str) -> FakeGpu:
        self.calls.append((fn, handle.index))
        gpu = self.gpus[handle.index]
        if fn in gpu.errors:
            raise NVMLError(gpu.errors[fn])
        return gpu

    # -- pynvml API --
    def nvmlInit(self) -> None:
        self.calls.append(("nvmlInit",))
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise NVMLError(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Handle:
        return Handle(i)

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:
        return handle.index

    def nvmlEventSetCreate(self) -> object:
        if self.event_set_error is not None:
            raise NVMLError(self.event_set_error)
        self.event_set = object()
        return self.event_set

    def nvmlDeviceRegisterEvents(self, handle: Handle, types: int, event_set: object) -> None:
        if self.register_error is not None:
            raise NVMLError(self.register_error)
        self.registered.append((handle, types, event_set))

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self.calls.append(("wait", timeout_ms))
        assert event_set is self.event_set
        if self.events:
            return self.events.pop(0)
        raise NVMLError(self.wait_error if self.wait_error is not None else self.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.freed.append(event_set)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter: int) -> int:
        assert error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == self.NVML_VOLATILE_ECC
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc_uncorrected

    def nvmlDeviceGetRetiredPages(self, handle: Handle, cause: int) -> list[int]:
        assert cause == self.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return list(self._gpu(handle, "nvmlDeviceGetRetiredPages").retired)

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:
        # (corrected rows, uncorrected rows, remap pending, remap failure occurred)
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped


def fixed_clock() -> float:
    return 123.0


def nvml_probe(nvml: FakeNvml, node: str = "node-a") -> NvmlGpuProbe:
    return NvmlGpuProbe(node, nvml=nvml, clock=fixed_clock)


# --- FakeGpuProbe -----------------------------------------------------------------------------


def test_fake_probe_reads_every_gpu_healthy(clock):
    probe = FakeGpuProbe("node-a", n_gpus=4, clock=clock)
    readings = probe.read()
    idle = {"temperature_c": probe.IDLE_TEMPERATURE_C, "power_w": probe.IDLE_POWER_W}
    assert readings == [GpuReading("node-a", i, clock.now, **idle) for i in range(4)]
    assert probe.kind == "fake"


def test_fake_probe_defaults_to_eight_gpus():
    assert len(FakeGpuProbe("node-a").read()) == 8


def test_fake_probe_xids_are_cleared_after_one_read(clock):
    probe = FakeGpuProbe("node-a", n_gpus=2, clock=clock)
    probe.inject(1, xid=79)
    probe.inject(1, xid=13)
    first = probe.read()
    assert first[1].xids == (79, 13)
    assert first[0].xids == ()
    clock.advance(2.0)
    second = probe.read()
    assert [r.xids for r in second] == [(), ()]
    assert second[1].at == clock.now


def test_fake_probe_lost_persists(clock):
    probe = FakeGpuProbe("node-a", n_gpus=2, clock=clock)
    probe.inject(0, lost=True)
    for _ in range(3):
        assert [r.lost for r in probe.read()] == [True, False]


def test_fake_probe_ecc_accumulates_and_persists(clock):
    probe = FakeGpuProbe("node-a", n_gpus=2, clock=clock)
    probe.inject(1, ecc=2)
    assert probe.read()[1].ecc_uncorrected == 2
    probe.inject(1, ecc=3)
    assert [r.ecc_uncorrected for r in probe.read()] == [0, 5]
    assert probe.read()[1].ecc_uncorrected == 5


def test_fake_probe_inject_without_fault_changes_nothing(clock):
    probe = FakeGpuProbe("node-a", n_gpus=1, clock=clock)
    probe.inject(0)
    assert probe.read() == [GpuReading("node-a", 0, clock.now, temperature_c=35.0, power_w=60.0)]


def test_fake_probe_feeds_judgment(clock):
    probe = FakeGpuProbe("node-b", n_gpus=2, clock=clock)
    previous = {(r.node, r.index): r.ecc_uncorrected for r in probe.read()}
    probe.inject(1, xid=79)
    verdict, _ = judge_gpus(probe.read(), previous, 95.0)
    assert set(verdict.fatal) == {("node-b", 1)}
    probe.close()  # a no-op, but part of the interface


# --- NvmlGpuProbe -----------------------------------------------------------------------------


def test_nvml_probe_init_registers_xid_events_for_every_gpu():
    nvml = FakeNvml(n_gpus=3)
    probe = nvml_probe(nvml)
    assert probe.kind == "nvml"
    assert probe.count == 3
    assert probe.handles == [Handle(0), Handle(1), Handle(2)]
    assert [(h.index, t) for h, t, _ in nvml.registered] == [
        (0, nvml.nvmlEventTypeXidCriticalError),
        (1, nvml.nvmlEventTypeXidCriticalError),
        (2, nvml.nvmlEventTypeXidCriticalError),
    ]
    assert all(s is nvml.event_set for _, _, s in nvml.registered)


def test_nvml_probe_healthy_readings():
    nvml = FakeNvml(n_gpus=2)
    nvml.gpus[1].temperature_c = 71
    nvml.gpus[1].power_mw = 612_500
    readings = nvml_probe(nvml, "node-x").read()
    assert readings == [
        GpuReading("node-x", 0, 123.0, temperature_c=55, power_w=250.0),
        GpuReading("node-x", 1, 123.0, temperature_c=71, power_w=612.5),
    ]


def test_nvml_probe_xid_events_land_on_their_gpu():
    nvml = FakeNvml(n_gpus=4)
    nvml.xid(2, 79)
    nvml.xid(0, 13)
    nvml.xid(2, 48)
    probe = nvml_probe(nvml)
    readings = probe.read()
    assert [r.xids for r in readings] == [(13,), (), (79, 48), ()]
    assert [r.index for r in readings] == [0, 1, 2, 3]
    # Drained: the next read sees none.
    assert [r.xids for r in probe.read()] == [(), (), (), ()]
    # Polled without blocking.
    assert all(c[1] == 0 for c in nvml.calls if c[0] == "wait")


def test_nvml_probe_ignores_other_event_types():
    nvml = FakeNvml(n_gpus=2)
    ecc_event = nvml.nvmlEventTypeSingleBitEccError
    nvml.events.append(SimpleNamespace(device=Handle(1), eventType=ecc_event, eventData=0))
    nvml.xid(1, 31)
    readings = nvml_probe(nvml).read()
    assert readings[1].xids == (31,)
    assert len(readings) == 2


def test_nvml_probe_counters():
    nvml = FakeNvml(n_gpus=2)
    nvml.gpus[0].ecc_uncorrected = 3
    nvml.gpus[0].retired = [0x1000, 0x2000, 0x3000]
    nvml.gpus[1].remapped = (4, 1, 0, 1)
    r0, r1 = nvml_probe(nvml).read()
    assert (r0.ecc_uncorrected, r0.retired_pages, r0.remap_failure) == (3, 3, False)
    assert (r1.ecc_uncorrected, r1.retired_pages, r1.remap_failure) == (0, 0, True)


def test_nvml_probe_remap_pending_is_not_a_failure():
    nvml = FakeNvml(n_gpus=1)
    nvml.gpus[0].remapped = (2, 1, 1, 0)
    assert nvml_probe(nvml).read()[0].remap_failure is False


def test_nvml_probe_gpu_is_lost_from_any_call_marks_it_lost():
    nvml = FakeNvml(n_gpus=2)
    nvml.gpus[1].errors["nvmlDeviceGetTotalEccErrors"] = nvml.NVML_ERROR_GPU_IS_LOST
    r0, r1 = nvml_probe(nvml).read()
    assert r0.lost is False
    assert r1.lost is True
    assert r1.error is None  # lost is the finding, not a probe error
    assert r1.temperature_c == 55  # what could be read still is


def test_nvml_probe_lost_gpu_answering_nothing():
    nvml = FakeNvml(n_gpus=1)
    for fn in (
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRemappedRows",
    ):
        nvml.gpus[0].errors[fn] = nvml.NVML_ERROR_GPU_IS_LOST
    (r,) = nvml_probe(nvml, "node-q").read()
    assert r == GpuReading("node-q", 0, 123.0, lost=True)
    verdict, _ = judge_gpus([r], {}, 95.0)
    assert verdict.fatal == {("node-q", 0): "GPU lost (stopped answering)"}


def test_nvml_probe_not_supported_is_silent():
    nvml = FakeNvml(n_gpus=1)
    for fn in ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPowerUsage"):
        nvml.gpus[0].errors[fn] = nvml.NVML_ERROR_NOT_SUPPORTED
    (r,) = nvml_probe(nvml).read()
    assert r.error is None
    assert r.lost is False
    assert (r.retired_pages, r.remap_failure, r.power_w) == (0, False, None)
    assert r.temperature_c == 55


def test_nvml_probe_other_errors_go_to_error():
    nvml = FakeNvml(n_gpus=2)
    nvml.gpus[0].errors["nvmlDeviceGetTemperature"] = nvml.NVML_ERROR_UNKNOWN
    nvml.gpus[0].errors["nvmlDeviceGetTotalEccErrors"] = nvml.NVML_ERROR_NO_PERMISSION
    r0, r1 = nvml_probe(nvml).read()
    assert r0.error == "temperature_c: Unknown Error; ecc_uncorrected: Insufficient Permissions"
    assert r0.temperature_c is None
    assert r0.ecc_uncorrected == 0
    assert r0.lost is False
    assert r0.power_w == 250.0
    assert r1.error is None


def test_nvml_probe_without_event_support_still_reads():
    nvml = FakeNvml(n_gpus=2)
    nvml.register_error = nvml.NVML_ERROR_NOT_SUPPORTED
    nvml.xid(0, 79)  # never delivered: nobody listens
    probe = nvml_probe(nvml)
    readings = probe.read()
    assert [r.xids for r in readings] == [(), ()]
    assert [r.temperature_c for r in readings] == [55, 55]
    assert not any(c[0] == "wait" for c in nvml.calls)
    probe.close()
    assert len(nvml.freed) == 1  # freed at once (no GPU could report Xids), not again
    assert nvml.shutdowns == 1


def test_nvml_probe_without_event_set_still_reads():
    nvml = FakeNvml(n_gpus=1)
    nvml.event_set_error = nvml.NVML_ERROR_NO_PERMISSION
    (r,) = nvml_probe(nvml).read()
    assert r.temperature_c == 55
    assert r.error is None


def test_nvml_probe_event_wait_failure_is_reported_as_an_extra_reading():
    nvml = FakeNvml(n_gpus=2)
    nvml.xid(1, 43)
    nvml.wait_error = nvml.NVML_ERROR_UNKNOWN
    readings = nvml_probe(nvml, "node-e").read()
    assert len(readings) == 3
    assert readings[1].xids == (43,)  # what was read before the failure is kept
    assert readings[2] == GpuReading(
        "node-e", -1, 123.0, error="Xid events from an unknown GPU, or the event wait failed"
    )
    verdict, _ = judge_gpus(readings, {}, 95.0)
    assert verdict.info == {
        ("node-e", -1): "probe error: Xid events from an unknown GPU, or the event wait failed"
    }
    assert verdict.application == {("node-e", 1): "Xid 43: GPU stopped processing (reset channel)"}


def test_nvml_probe_close_frees_events_and_shuts_down():
    nvml = FakeNvml(n_gpus=1)
    probe = nvml_probe(nvml)
    probe.close()
    assert nvml.freed == [nvml.event_set]
    assert nvml.shutdowns == 1


def test_nvml_probe_close_swallows_nvml_errors():
    nvml = FakeNvml(n_gpus=1)

    def broken_shutdown():
        raise NVMLError(nvml.NVML_ERROR_UNKNOWN)

    nvml.nvmlShutdown = broken_shutdown
    nvml_probe(nvml).close()  # does not raise


def test_nvml_probe_init_failure_raises():
    nvml = FakeNvml()
    nvml.init_error = nvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NVMLError):
        nvml_probe(nvml)


def test_nvml_probe_uses_its_clock():
    nvml = FakeNvml(n_gpus=2)
    ticks = iter([10.0, 20.0])
    probe = NvmlGpuProbe("node-a", nvml=nvml, clock=lambda: next(ticks))
    assert {r.at for r in probe.read()} == {10.0}
    assert {r.at for r in probe.read()} == {20.0}


# --- make_probe -------------------------------------------------------------------------------


def test_make_probe_none():
    nvml = FakeNvml()
    assert make_probe("none", "node-a", nvml) is None
    assert nvml.calls == []  # NVML never touched


def test_make_probe_fake():
    nvml = FakeNvml()
    probe = make_probe("fake", "node-a", nvml)
    assert isinstance(probe, FakeGpuProbe)
    assert probe.node == "node-a"
    assert nvml.calls == []


@pytest.mark.parametrize("kind", ["auto", "nvml"])
def test_make_probe_nvml_when_it_works(kind):
    nvml = FakeNvml(n_gpus=2)
    probe = make_probe(kind, "node-a", nvml)
    assert isinstance(probe, NvmlGpuProbe)
    assert probe.kind == "nvml"
    assert probe.node == "node-a"
    assert probe.count == 2


def test_make_probe_auto_falls_back_to_fake_when_nvml_fails():
    nvml = FakeNvml()
    nvml.init_error = nvml.NVML_ERROR_DRIVER_NOT_LOADED
    probe = make_probe("auto", "node-a", nvml)
    assert isinstance(probe, FakeGpuProbe)
    assert probe.node == "node-a"


def test_make_probe_nvml_failure_is_a_runtime_error_naming_the_setting():
    nvml = FakeNvml()
    nvml.init_error = nvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(RuntimeError, match=r"health\.gpu\.probe") as info:
        make_probe("nvml", "node-a", nvml)
    assert "Driver Not Loaded" in str(info.value)
    assert isinstance(info.value.__cause__, NVMLError)


def test_make_probe_auto_with_zero_gpus_is_fake_and_releases_nvml():
    nvml = FakeNvml(n_gpus=0)
    probe = make_probe("auto", "node-a", nvml)
    assert isinstance(probe, FakeGpuProbe)
    assert nvml.shutdowns == 1


def test_make_probe_nvml_with_zero_gpus_stays_nvml():
    nvml = FakeNvml(n_gpus=0)
    probe = make_probe("nvml", "node-a", nvml)
    assert isinstance(probe, NvmlGpuProbe)
    assert probe.read() == []

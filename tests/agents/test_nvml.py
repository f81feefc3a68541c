"""NVML collector against a stand-in at the pynvml boundary replaying H100-class values."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest

from guard.agents.nvml import NvmlCollector
from guard.schemas import GpuSample, encode, parse_message
from guard.schemas.nvml_codes import XID_GPU_LOST

from .nvml_standin import NvmlStandIn

TS = 1767225600.0


@pytest.fixture
def standin() -> NvmlStandIn:
    return NvmlStandIn()


@pytest.fixture
def collector(standin: NvmlStandIn) -> Iterator[NvmlCollector]:
    c = NvmlCollector("h100-07", nvml=standin)
    yield c
    c.close()


def _by_gpu(samples: list[GpuSample]) -> dict[int, GpuSample]:
    return {s.gpu: s for s in samples}


def test_every_contract_field_comes_from_its_nvml_call(collector: NvmlCollector) -> None:
    samples = _by_gpu(collector.sample(TS, "job-1"))
    assert sorted(samples) == list(range(8))
    s = samples[1]
    assert (s.node, s.job, s.ts) == ("h100-07", "job-1", TS)
    assert s.uuid == "GPU-8f2c61b0-4a4e-1d7b-7c1a-3e5d0c9b2a01"
    assert s.temp_c == 61 and s.power_w == pytest.approx(671.834) and s.power_limit_w == 700.0
    assert (s.sm_clock_mhz, s.sm_clock_max_mhz, s.mem_clock_mhz) == (1980, 1980, 2619)
    assert (s.util_pct, s.mem_util_pct) == (100, 43)
    assert s.clock_event_reasons == 0 and s.pcie_replay_total == 12
    assert (s.ecc_sbe_total, s.ecc_dbe_total) == (0, 0)
    idle = samples[7]
    assert (
        idle.clock_event_reasons == pynvml.nvmlClocksEventReasonGpuIdle and idle.sm_clock_mhz == 345
    )
    for sample in samples.values():
        assert parse_message(encode(sample)) == sample


def test_not_supported_is_asked_once_and_reported_as_null(
    collector: NvmlCollector, standin: NvmlStandIn
) -> None:
    for _ in range(3):
        samples = _by_gpu(collector.sample(TS, None))
        standin.advance()
    assert samples[6].util_pct is None and samples[6].mem_util_pct is None
    assert samples[6].temp_c == 52  # the rest of that GPU is read
    assert samples[7].pcie_replay_total is None
    assert standin.calls["nvmlDeviceGetUtilizationRates:6"] == 1
    assert standin.calls["nvmlDeviceGetPcieReplayCounter:7"] == 1
    assert standin.calls["nvmlDeviceGetUtilizationRates:0"] == 3
    assert standin.calls["nvmlDeviceGetMaxClockInfo:0"] == 1  # static: read once


def test_a_lost_gpu_becomes_an_xid_79_sample_not_a_crash(
    collector: NvmlCollector, standin: NvmlStandIn
) -> None:
    collector.sample(TS, None)
    standin.advance()
    collector.sample(TS + 1, None)
    standin.advance()  # GPU 4 falls off the bus
    for second in range(3):
        samples = _by_gpu(collector.sample(TS + 2 + second, None))
        lost = samples[4]
        assert lost.xid == XID_GPU_LOST and lost.temp_c is None and lost.power_w is None
        assert samples[3].temp_c is not None and len(samples) == 8
        standin.advance()


def test_xid_events_arrive_through_the_event_set(
    collector: NvmlCollector, standin: NvmlStandIn
) -> None:
    collector.sample(TS, None)
    standin.advance()  # Xid 13 on GPU 5
    deadline = time.monotonic() + 10
    while collector.xids is not None and not collector.xids._last and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = _by_gpu(collector.sample(TS + 1, None))
    assert samples[5].xid == 13
    assert all(s.xid is None for g, s in samples.items() if g != 5)
    assert _by_gpu(collector.sample(TS + 2, None))[5].xid is None  # only in its interval


def test_other_nvml_errors_null_the_field_and_are_counted(
    collector: NvmlCollector, standin: NvmlStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def flaky(handle: object, sensor: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    monkeypatch.setattr(standin, "nvmlDeviceGetTemperatureV", flaky)
    samples = collector.sample(TS, None)
    assert all(s.temp_c is None and s.power_w is not None for s in samples)
    assert collector.errors == 8
    monkeypatch.undo()
    assert all(s.temp_c is not None for s in collector.sample(TS + 1, None))


def test_an_old_driver_without_temperature_v_falls_back_to_the_old_call(
    collector: NvmlCollector, standin: NvmlStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(handle: object, sensor: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(standin, "nvmlDeviceGetTemperatureV", missing)
    first = _by_gpu(collector.sample(TS, None))
    assert first[0].temp_c is None and first[1].temp_c == 61  # found out on GPU 0
    again = _by_gpu(collector.sample(TS + 1, None))
    assert again[0].temp_c == 58 and collector.errors == 0

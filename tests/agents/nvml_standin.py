"""A stand-in for the ``pynvml`` module at the library boundary, replaying fixture values.

Same function names and signatures as nvidia-ml-py, the real ``pynvml`` constants and error
classes (``pynvml.NVMLError(code)`` builds the same subclass NVML would raise). Each call to
``advance()`` moves every GPU to its next recorded cycle.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "nvml" / "h100_sxm5_node.json"


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


class NvmlStandIn:
    """Replays ``h100_sxm5_node.json``; records which functions were called."""

    def __init__(self, fixture: Path = FIXTURE) -> None:
        self.doc = json.loads(fixture.read_text())
        self.gpus = {g["index"]: g for g in self.doc["gpus"]}
        self.cycle = 0
        self.calls: dict[str, int] = {}
        self._events: deque[Any] = deque()
        self._event_ready = threading.Condition()
        self.initialised = False
        # The real constants and error classes.
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocksEventReason")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError

    # --- replay control --------------------------------------------------------------------

    def advance(self) -> None:
        self.cycle += 1
        for event in self.doc.get("xid_events", []):
            if event["before_cycle"] == self.cycle:
                self.push_xid(event["index"], event["xid"])

    def push_xid(self, index: int, xid: int) -> None:
        with self._event_ready:
            self._events.append(
                SimpleNamespace(
                    device=self._handles[index],
                    eventType=pynvml.nvmlEventTypeXidCriticalError,
                    eventData=xid,
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
            )
            self._event_ready.notify_all()

    # --- helpers ---------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: _Handle, metric: str, name: str) -> dict[str, Any]:
        self._count(f"{name}:{handle.index}")
        gpu = self.gpus[handle.index]
        lost = self.doc.get("lost_gpu")
        if lost and lost["index"] == handle.index and self.cycle >= lost["from_cycle"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if metric in gpu.get("not_supported", []):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _now(self, gpu: dict[str, Any]) -> dict[str, Any]:
        cycles = gpu["cycles"]
        return cycles[min(self.cycle, len(cycles) - 1)]

    def _series(self, gpu: dict[str, Any], key: str) -> Any:
        values = gpu[key]
        return values[min(self.cycle, len(values) - 1)]

    # --- the pynvml API used by the collector ----------------------------------------------

    def nvmlInit(self) -> None:
        self.initialised = True
        self._handles = {i: _Handle(i) for i in self.gpus}

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        return self._handles[index]

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return str(self._gpu(handle, "uuid", "nvmlDeviceGetUUID")["uuid"])

    def nvmlDeviceGetTemperatureV(self, handle: _Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._now(self._gpu(handle, "temp", "nvmlDeviceGetTemperatureV"))["temp_c"])

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        """The pre-``V`` call, still in every driver."""
        return int(self._now(self._gpu(handle, "temp", "nvmlDeviceGetTemperature"))["temp_c"])

    def nvmlDeviceGetTemperatureThreshold(self, handle: _Handle, threshold: int) -> int:
        """The slowdown threshold when the fixture recorded one, else NOT_SUPPORTED."""
        assert threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        gpu = self._gpu(handle, "temp_slowdown", "nvmlDeviceGetTemperatureThreshold")
        if "temp_slowdown_c" not in gpu:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu["temp_slowdown_c"])

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(self._now(self._gpu(handle, "power", "nvmlDeviceGetPowerUsage"))["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return int(
            self._gpu(handle, "power_limit", "nvmlDeviceGetEnforcedPowerLimit")["power_limit_mw"]
        )

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock: int) -> int:
        now = self._now(self._gpu(handle, "clock", "nvmlDeviceGetClockInfo"))
        return int(now["sm_clock_mhz"] if clock == pynvml.NVML_CLOCK_SM else now["mem_clock_mhz"])

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, clock: int) -> int:
        return int(self._gpu(handle, "max_clock", "nvmlDeviceGetMaxClockInfo")["max_sm_clock_mhz"])

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        now = self._now(self._gpu(handle, "util", "nvmlDeviceGetUtilizationRates"))
        return SimpleNamespace(gpu=now["util_gpu"], memory=now["util_memory"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        gpu = self._gpu(handle, "reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        return int(self._now(gpu)["clock_event_reasons"])

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter: int) -> int:
        gpu = self._gpu(handle, "ecc", "nvmlDeviceGetTotalEccErrors")
        assert counter == pynvml.NVML_AGGREGATE_ECC
        key = (
            "ecc_sbe_total"
            if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
            else "ecc_dbe_total"
        )
        return int(self._series(gpu, key))

    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        return int(
            self._series(
                self._gpu(handle, "pcie_replay", "nvmlDeviceGetPcieReplayCounter"), "pcie_replay"
            )
        )

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        rows = self._gpu(handle, "remapped_rows", "nvmlDeviceGetRemappedRows")["remapped_rows"]
        return tuple(rows)  # type: ignore[return-value]

    # --- events ----------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: _Handle, types: int, event_set: object) -> None:
        self._count("nvmlDeviceRegisterEvents")

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        with self._event_ready:
            if not self._events:
                self._event_ready.wait(timeout_ms / 1000)
            if not self._events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            return self._events.popleft()

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass

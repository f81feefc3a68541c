"""GPU collector over NVML (nvidia-ml-py): one :class:`GpuSample` per GPU per cycle.

Every ``gpu`` field of the wire contract is read with the NVML call that owns it
(temperature via ``nvmlDeviceGetTemperatureV``, power and enforced limit, SM / memory clocks
and the max SM clock, ``nvmlDeviceGetCurrentClocksEventReasons``, utilisation, aggregate ECC
totals, PCIe replay counter; remapped rows are read where present and logged when a row
remap is pending or failed, since the contract has no field for them). Xid errors arrive
through an NVML event set on a background thread (:class:`XidWatcher`) and are reported in
the next sample as ``xid`` (the last one in the interval).

What goes wrong on real fleets, and what the collector does:

- ``NVMLError_NotSupported`` for one metric of one GPU: cached per (GPU, metric), logged
  once, never asked again; the field stays null.
- Any other NVML error for one metric (timeout, unknown): the field is null this cycle and
  the error is logged once per (GPU, metric, error).
- A lost GPU (``GPU_IS_LOST``, "fallen off the bus"): every later sample of that GPU carries
  ``xid=79`` (the Xid the driver logs for it) and no metrics, which the detectors treat as a
  ``gpu_error``; the collector never raises for it.

``nvml`` is the pynvml module by default; tests pass a stand-in with the same functions and
real pynvml error classes (the hardware boundary).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

from guard.schemas import GpuSample
from guard.schemas.nvml_codes import XID_GPU_LOST

__all__ = ["NvmlCollector", "XidWatcher"]

log = logging.getLogger(__name__)


def _address(handle: Any) -> int:
    """What identifies a device handle: the address an NVML handle points to (the event's
    ``device`` is a new ctypes object for the same device), else the object itself."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0) or id(handle)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class NvmlCollector:
    """Samples every GPU of this node through NVML.

    >>> collector = NvmlCollector("node-7")          # doctest: +SKIP
    >>> [s.temp_c for s in collector.sample(ts=time.time(), job=None)]   # doctest: +SKIP
    [41.0, 40.0, ...]
    """

    def __init__(self, node: str, nvml: Any = None, watch_xids: bool = True) -> None:
        self.node = node
        self.nvml = nvml if nvml is not None else _load_pynvml()
        nv = self.nvml
        nv.nvmlInit()
        self._handles: list[Any] = []
        self._uuids: list[str | None] = []
        self._lost: set[int] = set()
        self._unsupported: set[tuple[int, str]] = set()
        self._logged: set[tuple[int, str, str]] = set()
        self._static: dict[tuple[int, str], float] = {}
        self._remap_logged: set[int] = set()
        self.errors = 0
        self._legacy_temp = False
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
            except nv.NVMLError as exc:
                self._mark_lost_or_log(index, "handle", exc)
                handle = None
            self._handles.append(handle)
            self._uuids.append(
                self._call(index, "uuid", nv.nvmlDeviceGetUUID, handle) if handle else None
            )
        self.xids = XidWatcher(nv, self._handles) if watch_xids else None
        if self.xids is not None:
            self.xids.start()

    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    def close(self) -> None:
        if self.xids is not None:
            self.xids.stop()
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:  # shutting down anyway
            log.debug("nvmlShutdown: %s", exc)

    def sample(self, ts: float, job: str | None) -> list[GpuSample]:
        """One sample per GPU; never raises for NVML errors."""
        nv = self.nvml
        xids = self.xids.take() if self.xids is not None else {}
        out = []
        for index, handle in enumerate(self._handles):
            if index in self._lost or handle is None:
                out.append(GpuSample(ts=ts, node=self.node, job=job, gpu=index, xid=XID_GPU_LOST))
                continue
            values: dict[str, Any] = {}
            call = self._call
            temperature = (
                nv.nvmlDeviceGetTemperature if self._legacy_temp else nv.nvmlDeviceGetTemperatureV
            )
            temp = call(index, "temp_c", temperature, handle, nv.NVML_TEMPERATURE_GPU)
            power = call(index, "power_w", nv.nvmlDeviceGetPowerUsage, handle)
            limit = call(index, "power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, handle)
            values["temp_c"] = temp
            values["temp_slowdown_c"] = self._static_value(
                index,
                "temp_slowdown_c",
                nv.nvmlDeviceGetTemperatureThreshold,
                handle,
                nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
            )
            values["power_w"] = None if power is None else power / 1000.0
            values["power_limit_w"] = None if limit is None else limit / 1000.0
            values["sm_clock_mhz"] = call(
                index, "sm_clock_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM
            )
            values["sm_clock_max_mhz"] = self._static_value(
                index, "sm_clock_max_mhz", nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM
            )
            values["mem_clock_mhz"] = call(
                index, "mem_clock_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM
            )
            util = call(index, "util_pct", nv.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                values["util_pct"] = util.gpu
                values["mem_util_pct"] = util.memory
            values["clock_event_reasons"] = call(
                index, "clock_event_reasons", nv.nvmlDeviceGetCurrentClocksEventReasons, handle
            )
            values["ecc_sbe_total"] = call(
                index,
                "ecc_sbe_total",
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nv.NVML_AGGREGATE_ECC,
            )
            values["ecc_dbe_total"] = call(
                index,
                "ecc_dbe_total",
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_AGGREGATE_ECC,
            )
            values["pcie_replay_total"] = call(
                index, "pcie_replay_total", nv.nvmlDeviceGetPcieReplayCounter, handle
            )
            self._check_remapped_rows(index, handle)
            if index in self._lost:  # lost during this cycle
                out.append(GpuSample(ts=ts, node=self.node, job=job, gpu=index, xid=XID_GPU_LOST))
                continue
            out.append(
                GpuSample(
                    ts=ts,
                    node=self.node,
                    job=job,
                    gpu=index,
                    uuid=self._uuids[index],
                    xid=xids.get(index),
                    **values,
                )
            )
        return out

    # --- helpers ---------------------------------------------------------------------------

    def _call(self, index: int, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        if (index, metric) in self._unsupported or index in self._lost:
            return None
        try:
            value = fn(*args)
        except self.nvml.NVMLError as exc:
            self._mark_lost_or_log(index, metric, exc)
            return None
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        return value

    def _static_value(self, index: int, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        key = (index, metric)
        if key not in self._static:
            value = self._call(index, metric, fn, *args)
            if value is None:
                return None
            self._static[key] = value
        return self._static[key]

    def _mark_lost_or_log(self, index: int, metric: str, exc: Exception) -> None:
        nv = self.nvml
        code = getattr(exc, "value", None)
        if code == nv.NVML_ERROR_NOT_SUPPORTED:
            self._unsupported.add((index, metric))
            log.info(
                "GPU %d: %s is not supported by this GPU or driver; not asking again", index, metric
            )
            return
        if (
            code == nv.NVML_ERROR_FUNCTION_NOT_FOUND
            and metric == "temp_c"
            and not self._legacy_temp
        ):
            self._legacy_temp = True  # a driver older than nvmlDeviceGetTemperatureV
            log.info(
                "nvmlDeviceGetTemperatureV is not in this driver; using nvmlDeviceGetTemperature"
            )
            return
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            if index not in self._lost:
                log.error(
                    "GPU %d is lost (fell off the bus); reporting xid=%d until the agent restarts",
                    index,
                    XID_GPU_LOST,
                )
            self._lost.add(index)
            return
        self.errors += 1
        key = (index, metric, str(exc))
        if key not in self._logged:
            self._logged.add(key)
            log.warning("GPU %d: reading %s failed: %s (logged once)", index, metric, exc)

    def _check_remapped_rows(self, index: int, handle: Any) -> None:
        nv = self.nvml
        rows = self._call(index, "remapped_rows", nv.nvmlDeviceGetRemappedRows, handle)
        if rows is None or index in self._remap_logged:
            return
        _corrected, _uncorrected, pending, failure = rows
        if pending or failure:
            self._remap_logged.add(index)
            log.warning(
                "GPU %d: row remapping %s; the GPU needs a reset%s",
                index,
                "failed" if failure else "pending",
                " and an RMA" if failure else "",
            )


class XidWatcher:
    """Waits on an NVML event set for Xid (and double-bit ECC) events in a daemon thread."""

    def __init__(self, nvml: Any, handles: list[Any], wait_ms: int = 500) -> None:
        self.nvml = nvml
        self.wait_ms = wait_ms
        self._index_of = {_address(h): i for i, h in enumerate(handles) if h is not None}
        self._handles = handles
        self._last: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None

    def start(self) -> None:
        nv = self.nvml
        try:
            self._set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("Xid events unavailable (nvmlEventSetCreate: %s)", exc)
            return
        wanted = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError
        registered = 0
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(handle, wanted, self._set)
                registered += 1
            except nv.NVMLError as exc:
                log.info("GPU %d: Xid events not available: %s", index, exc)
        if not registered:
            return
        self._thread = threading.Thread(target=self._run, name="guard-xid", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 * 4)
        if self._set is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlEventSetFree(self._set)
            self._set = None

    def take(self) -> dict[int, int]:
        """Last Xid per GPU index since the previous call."""
        with self._lock:
            last, self._last = self._last, {}
        return last

    def _index(self, device: Any) -> int | None:
        return self._index_of.get(_address(device))

    def _run(self) -> None:
        nv = self.nvml
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._set, self.wait_ms)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    log.warning("waiting for Xid events failed: %s", exc)
                    self._stop.wait(1.0)
                continue
            index = self._index(data.device)
            if index is None:
                continue
            xid = int(data.eventData)
            if data.eventType & nv.nvmlEventTypeDoubleBitEccError and not xid:
                xid = 48  # the Xid the driver logs for a double-bit ECC error
            with self._lock:
                self._last[index] = xid

"""NVML health: GPU count and bus ids, power limits, uncorrectable ECC, row remapping, retired
pages, Xids.

:class:`GpuHealthCheck` reads counters once; :class:`XidCheck` registers for Xid events when
the sweep starts (``start``) and reports what arrived while the sweep ran (``run``, last).
The ``gpu_count`` result carries the node's SKU (``sku=H100 SXM; ...``) that the baselines
compare within.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from guard.schemas.nvml_codes import APPLICATION_XIDS

from .base import CheckContext, CheckError, CheckResult

__all__ = ["GpuHealthCheck", "XidCheck", "sku_from_gpu_name"]

# Marketing names NVML reports (nvmlDeviceGetName) → the SKUs of the floor table.
# Most specific first: "NVIDIA GH200 480GB" and "NVIDIA H200 NVL" contain "H200".
_SKU_NAMES = (
    ("GH200", "GH200"),
    ("H200 NVL", "H200 NVL"),
    ("H200", "H200"),
    ("H100 NVL", "H100 NVL"),
    ("H100 80GB HBM3", "H100 SXM"),
    ("H100-SXM", "H100 SXM"),
    ("A100-SXM4-80GB", "A100 80GB"),
    ("A100 80GB", "A100 80GB"),
)


def sku_from_gpu_name(name: str) -> str:
    """``'NVIDIA H100 80GB HBM3'`` → ``'H100 SXM'``; an unknown part keeps its own name.

    >>> sku_from_gpu_name("NVIDIA H100 80GB HBM3"), sku_from_gpu_name("NVIDIA L4")
    ('H100 SXM', 'NVIDIA L4')
    >>> [sku_from_gpu_name(n) for n in ("NVIDIA GH200 480GB", "NVIDIA H200 NVL", "NVIDIA H200")]
    ['GH200', 'H200 NVL', 'H200']
    """
    for needle, sku in _SKU_NAMES:
        if needle in name:
            return sku
    return name


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml(ctx: CheckContext) -> Any:
    if ctx.nvml is None:
        raise CheckError("NVML is not available (no NVIDIA driver here)")
    return ctx.nvml


def _optional(nvml: Any, call: Any, *args: Any) -> Any:
    """A reading some parts do not support (retired pages on row-remapping GPUs): None."""
    try:
        return call(*args)
    except nvml.NVMLError as exc:
        if "Not Supported" in str(exc) or getattr(exc, "value", None) == getattr(
            nvml, "NVML_ERROR_NOT_SUPPORTED", 3
        ):
            return None
        raise


class GpuHealthCheck:
    """Count and bus ids against what the node should have; each GPU's enforced power limit
    against its default; ECC, remapped rows, retired pages."""

    name = "gpu_health"

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        nvml = _nvml(ctx)
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = {_text(nvml.nvmlDeviceGetName(h)) for h in handles}
        sku = sku_from_gpu_name(sorted(names)[0]) if names else "no GPU"
        bus = [_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
        out = [self._count(ctx, count, sku, names, bus)]
        ecc, remap, pages = [], [], []
        for i, h in enumerate(handles):
            dbe = nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
            if dbe:
                ecc.append(f"gpu{i}: {dbe}")
            rows = _optional(nvml, nvml.nvmlDeviceGetRemappedRows, h)
            if rows is not None and (rows[2] or rows[3]):
                remap.append(f"gpu{i}: " + ("pending" if rows[2] else "remapping failed"))
            pending = _optional(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            if pending:
                pages.append(f"gpu{i}: retirement pending")
        out.append(self._processes(nvml, handles))
        out += [self._power_limit(nvml, i, h) for i, h in enumerate(handles)]
        for name, bad, what in (
            ("ecc_uncorrectable", ecc, "uncorrectable ECC errors since boot"),
            ("remapped_rows_pending_or_failed", remap, "rows pending remap or failed"),
            ("retired_pages_pending", pages, "page retirements pending"),
        ):
            out.append(
                CheckResult(
                    name,
                    float(len(bad)),
                    "gpus",
                    passed=not bad,
                    baseline=0.0,
                    detail=(f"{what}: " + ", ".join(bad)) if bad else f"no {what}",
                )
            )
        return out

    @staticmethod
    def _processes(nvml: Any, handles: list[Any]) -> CheckResult:
        """``gpu_processes``: compute processes on the GPUs when the sweep starts, the sweep's
        own aside. A busy GPU (the suspect's job not gone, a peer someone uses) cannot be
        judged: the sweep would measure the sharing, so it is untested."""
        busy = []
        for i, h in enumerate(handles):
            procs = _optional(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            pids = sorted({int(p.pid) for p in procs} - {os.getpid()})
            if pids:
                busy.append(f"gpu{i}: pid {', '.join(map(str, pids))}")
        return CheckResult(
            "gpu_processes",
            float(len(busy)),
            "gpus",
            passed=not busy,
            baseline=0.0,
            detail=("untested: GPUs busy with other processes: " + "; ".join(busy))
            if busy
            else "no other compute process on the GPUs",
        )

    @staticmethod
    def _power_limit(nvml: Any, gpu: int, handle: Any) -> CheckResult:
        """``power_limit_w:gpu<i>``: the limit the GPU enforces against its default.

        A cap below the default (``nvidia-smi -pl``, a BMC's or the rack's node-wide power
        cap) slows every GPU alike, so the soak's sibling comparison cannot see it.
        """
        name = f"power_limit_w:gpu{gpu}"
        enforced = _optional(nvml, nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        default = _optional(nvml, nvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        if enforced is None or default is None:
            return CheckResult(
                name,
                None if enforced is None else enforced / 1000,
                "W",
                passed=False,
                detail="untested: NVML does not report this GPU's enforced or default power limit",
            )
        capped = enforced < default
        return CheckResult(
            name,
            enforced / 1000,
            "W",
            passed=not capped,
            baseline=default / 1000,
            detail=f"enforced {enforced / 1000:g} W, default {default / 1000:g} W"
            + (": capped below its default (a power cap slows it)" if capped else ""),
        )

    @staticmethod
    def _count(
        ctx: CheckContext, count: int, sku: str, names: set[str], bus: list[str]
    ) -> CheckResult:
        problems = []
        if ctx.expected_gpus is not None and count != ctx.expected_gpus:
            problems.append(f"expected {ctx.expected_gpus}")
        want = {b.lower() for b in ctx.expected_bus_ids}
        if want and set(bus) != want:
            missing, extra = sorted(want - set(bus)), sorted(set(bus) - want)
            problems.append(f"bus ids missing {missing}, unexpected {extra}")
        if len(names) > 1:
            problems.append(f"mixed parts {sorted(names)}")
        expected = "" if ctx.expected_gpus or want else "; no expected count or bus ids set"
        return CheckResult(
            "gpu_count",
            float(count),
            "count",
            passed=not problems,
            baseline=None if ctx.expected_gpus is None else float(ctx.expected_gpus),
            detail=f"sku={sku}; {count} GPUs at {', '.join(bus)}"
            + ("; " + "; ".join(problems) if problems else expected),
        )


class XidCheck:
    """Xid events during the sweep: any Xid but the application ones fails the node."""

    name = "xid_events"

    def __init__(self) -> None:
        self._events: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, ctx: CheckContext) -> None:
        nvml = _nvml(ctx)
        event_set = nvml.nvmlEventSetCreate()
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
        self._thread = threading.Thread(target=self._listen, args=(nvml, event_set), daemon=True)
        self._thread.start()

    def _listen(self, nvml: Any, event_set: Any) -> None:
        try:
            while not self._stop.is_set():
                try:
                    event = nvml.nvmlEventSetWait(event_set, 200)
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                        continue
                    raise
                gpu = nvml.nvmlDeviceGetIndex(event.device)  # the event's handle is a new object
                self._events.append((int(gpu), int(event.eventData)))
        except Exception as exc:  # reported by run(), which fails the check
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            nvml.nvmlEventSetFree(event_set)

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        if self._thread is None:
            self.start(ctx)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        fatal = [(g, x) for g, x in self._events if x not in APPLICATION_XIDS]
        seen = ", ".join(f"gpu{g} xid {x}" for g, x in self._events) or "none"
        if self._error:
            failed = f"listening for Xid events failed: {self._error}"
            return [CheckResult(self.name, None, passed=False, detail=failed)]
        return [
            CheckResult(
                self.name,
                float(len(fatal)),
                "count",
                passed=not fatal,
                baseline=0.0,
                detail=f"Xids during the sweep: {seen} (application Xids "
                f"{', '.join(map(str, APPLICATION_XIDS))} do not fail the node)",
            )
        ]

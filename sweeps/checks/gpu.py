"""Single-node GPU checks: GEMM, HBM copy, host↔device copy + PCIe link, thermal/power soak.

Throughputs come from the backend's timings (:mod:`.gpu_backend`); NVML readings (PCIe link,
temperatures, clocks, power, clock-event reasons) from ``ctx.nvml`` — ``pynvml``, or in
tests a stand-in replaying recorded values. Every per-GPU result is named
``<family>:gpu<index>``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from guard.schemas.nvml_codes import (
    HW_POWER_BRAKE,
    HW_SLOWDOWN,
    HW_THERMAL,
    SW_THERMAL,
    TROUBLE_REASONS,
)

from .base import CheckContext, CheckError, CheckResult, median

__all__ = ["GemmCheck", "GpuSoakCheck", "HbmCopyCheck", "HostDeviceCheck", "reason_names"]

_REASON_NAMES = {
    HW_SLOWDOWN: "HW slowdown",
    SW_THERMAL: "SW thermal",
    HW_THERMAL: "HW thermal",
    HW_POWER_BRAKE: "HW power brake",
}


def reason_names(bits: int) -> str:
    """``0x48`` → ``'HW slowdown, HW thermal'`` (only the reasons that mean trouble)."""
    return ", ".join(name for bit, name in _REASON_NAMES.items() if bits & bit)


def _gpus(ctx: CheckContext) -> list[int]:
    if ctx.gpu is None:
        raise CheckError("no GPU backend: install the [sweeps] extra (torch) on a GPU host")
    count = int(ctx.gpu.device_count())
    if count == 0:
        raise CheckError("the GPU backend sees no device")
    return list(range(count))


def _samples(times_ms: list[float], warmup: int) -> list[float]:
    kept = times_ms[warmup:]
    if not kept or min(kept) <= 0:
        raise CheckError(f"no usable timings ({times_ms!r})")
    return kept


class GemmCheck:
    """``n`` x ``n`` matmul throughput per GPU in ``dtype``: ``warmup`` samples dropped, median."""

    def __init__(self, dtype: str, n: int = 8192, samples: int = 12, warmup: int = 2) -> None:
        self.dtype, self.n, self.samples, self.warmup = dtype, n, samples, warmup
        self.name = f"gemm_{dtype}_tflops"

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        out = []
        for gpu in _gpus(ctx):
            ctx.progress(f"{self.name} gpu{gpu}")
            started = time.perf_counter()
            kept = _samples(ctx.gpu.gemm_ms(gpu, self.dtype, self.n, self.samples), self.warmup)
            tflops = [2 * self.n**3 / (ms / 1e3) / 1e12 for ms in kept]
            out.append(
                CheckResult(
                    f"{self.name}:gpu{gpu}",
                    median(tflops),
                    "TFLOPS",
                    detail=f"{self.dtype} {self.n}^3, median of {len(kept)} after "
                    f"{self.warmup} warm-up (min {min(tflops):.1f})",
                    duration_s=time.perf_counter() - started,
                    judged=True,
                )
            )
        return out


def _copy_results(
    ctx: CheckContext, name: str, kind: str, nbytes: int, samples: int, factor: int
) -> list[CheckResult]:
    out = []
    for gpu in _gpus(ctx):
        ctx.progress(f"{name} gpu{gpu}")
        started = time.perf_counter()
        kept = _samples(ctx.gpu.copy_ms(gpu, kind, nbytes, samples), 1)
        rates = [factor * nbytes / (ms / 1e3) / 1e9 for ms in kept]
        counted = "read + write" if factor == 2 else "bytes once"
        out.append(
            CheckResult(
                f"{name}:gpu{gpu}",
                median(rates),
                "GB/s",
                detail=f"{kind} copy of {nbytes >> 20} MiB ({counted}), median of {len(kept)}",
                duration_s=time.perf_counter() - started,
                judged=True,
            )
        )
    return out


class HbmCopyCheck:
    """Device-to-device copy per GPU (bytes read + written, as CUDA's bandwidthTest counts)."""

    name = "hbm_copy_gbps"

    def __init__(self, nbytes: int = 1 << 30, samples: int = 8) -> None:
        self.nbytes, self.samples = nbytes, samples

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        return _copy_results(ctx, self.name, "d2d", self.nbytes, self.samples, 2)


class HostDeviceCheck:
    """Pinned host↔device copies per GPU, and the PCIe link (generation, width) vs its max.

    The link is read right after the copies: an idle GPU trains its link down to save power.
    """

    name = "host_device"

    def __init__(self, nbytes: int = 256 << 20, samples: int = 8) -> None:
        self.nbytes, self.samples = nbytes, samples

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        out = _copy_results(ctx, "h2d_gbps", "h2d", self.nbytes, self.samples, 1)
        out += _copy_results(ctx, "d2h_gbps", "d2h", self.nbytes, self.samples, 1)
        if ctx.nvml is None:
            raise CheckError("NVML is not available: the PCIe link cannot be read")
        nvml = ctx.nvml
        for gpu in range(len(out) // 2):
            h = nvml.nvmlDeviceGetHandleByIndex(gpu)
            gen, max_gen = (
                nvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                nvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
            )
            width, max_width = (
                nvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                nvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            )
            ok = gen >= max_gen and width >= max_width
            out.append(
                CheckResult(
                    f"pcie_link_gen:gpu{gpu}",
                    float(gen),
                    "gen",
                    passed=ok,
                    baseline=float(max_gen),
                    detail=f"gen{gen} x{width} under load, max gen{max_gen} x{max_width}"
                    + ("" if ok else ": the link trained below its maximum"),
                )
            )
        return out


@dataclass
class _GpuTrace:
    temps: list[int] = field(default_factory=list)
    clocks: list[int] = field(default_factory=list)
    powers: list[float] = field(default_factory=list)
    reasons: int = 0
    trouble_samples: int = 0


class GpuSoakCheck:
    """GEMM on every GPU at once for ``ctx.soak_s`` s, sampling NVML every ``interval_s``.

    Per GPU: ``soak_sm_clock_mhz`` (median SM clock under load) fails on a trouble reason
    (HW slowdown, SW/HW thermal, HW power brake; idle and SW power cap are normal) or a
    clock more than ``clock_deficit`` below the median of its siblings; ``soak_temp_max_c``
    fails when the GPU reached its slowdown temperature.
    """

    name = "soak"

    def __init__(self, interval_s: float = 1.0, clock_deficit: float = 0.05) -> None:
        self.interval_s, self.clock_deficit = interval_s, clock_deficit

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        gpus = _gpus(ctx)
        if ctx.nvml is None:
            raise CheckError("NVML is not available: the soak cannot be watched")
        duration = ctx.seconds(ctx.soak_s)
        ctx.progress(f"soak: GEMM on {len(gpus)} GPUs for {duration:.0f} s")
        stop = threading.Event()
        load = threading.Thread(target=ctx.gpu.burn, args=(gpus, stop), daemon=True)
        load.start()
        try:
            traces = self._watch(ctx.nvml, gpus, duration, ctx.scale)
        finally:
            stop.set()
            load.join(30)
        return self._verdicts(ctx.nvml, gpus, traces, duration)

    def _watch(self, nvml: Any, gpus: list[int], duration: float, scale: float) -> list[_GpuTrace]:
        handles = [nvml.nvmlDeviceGetHandleByIndex(g) for g in gpus]
        traces = [_GpuTrace() for _ in gpus]
        end = time.monotonic() + duration
        while True:
            for h, trace in zip(handles, traces, strict=True):
                trace.temps.append(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
                trace.clocks.append(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
                trace.powers.append(nvml.nvmlDeviceGetPowerUsage(h) / 1000)
                bits = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
                trace.reasons |= bits
                trace.trouble_samples += bool(bits & TROUBLE_REASONS)
            if time.monotonic() >= end:
                return traces
            time.sleep(min(self.interval_s * scale, max(0.0, end - time.monotonic())))

    def _verdicts(
        self, nvml: Any, gpus: list[int], traces: list[_GpuTrace], duration: float
    ) -> list[CheckResult]:
        clocks = [median(t.clocks) for t in traces]
        out = []
        for gpu, trace, clock in zip(gpus, traces, clocks, strict=True):
            siblings = [c for i, c in enumerate(clocks) if i != gpu] or [clock]
            peer = median(siblings)
            problems = []
            if trace.trouble_samples:
                problems.append(
                    f"{reason_names(trace.reasons)} in {trace.trouble_samples} of "
                    f"{len(trace.clocks)} samples"
                )
            if clock < (1 - self.clock_deficit) * peer:
                problems.append(
                    f"clock {1 - clock / peer:.1%} below its siblings' median "
                    f"(> {self.clock_deficit:.0%} fails)"
                )
            out.append(
                CheckResult(
                    f"soak_sm_clock_mhz:gpu{gpu}",
                    clock,
                    "MHz",
                    passed=not problems,
                    baseline=peer,
                    detail=f"{len(trace.clocks)} samples over {duration:.0f} s, power median "
                    f"{median(trace.powers):.0f} W; " + ("; ".join(problems) or "no trouble"),
                )
            )
            h = nvml.nvmlDeviceGetHandleByIndex(gpu)
            slowdown = nvml.nvmlDeviceGetTemperatureThreshold(
                h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            )
            hottest = max(trace.temps)
            out.append(
                CheckResult(
                    f"soak_temp_max_c:gpu{gpu}",
                    float(hottest),
                    "C",
                    passed=hottest < slowdown,
                    baseline=float(slowdown),
                    detail=f"hottest {hottest} C, median {median(trace.temps):.0f} C; "
                    f"slowdown temperature {slowdown} C"
                    + (" reached" if hottest >= slowdown else ""),
                )
            )
        return out

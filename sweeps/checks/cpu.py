"""CPU checks (numpy): what a host without GPUs runs, and what CI runs.

- :class:`CpuMatmulCheck` — float32 matrix multiply throughput, GFLOPS (warm-up, median).
- :class:`CpuMemoryBandwidthCheck` — a large array copy, GB/s (bytes read + written).
- :class:`CpuSoakCheck` — sustained matmul for ``ctx.cpu_soak_s`` seconds; fails when the last
  third runs clearly slower than the first (a host that throttles under load).
- :class:`CpuCountCheck` — CPUs this process can use against what the node should have.

Example
-------
>>> from guard.sweeps.checks.base import CheckContext
>>> [r] = CpuMatmulCheck(size=256, runs=2).run(CheckContext(node="n1"))
>>> r.name, r.unit, r.value > 0
('cpu_matmul_gflops', 'GFLOPS', True)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .base import CheckContext, CheckResult, median

__all__ = [
    "CpuCountCheck",
    "CpuMatmulCheck",
    "CpuMemoryBandwidthCheck",
    "CpuSoakCheck",
    "cpu_model",
]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``), the SKU a CPU host is compared within."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _matmul_seconds(a: np.ndarray, b: np.ndarray) -> float:
    started = time.perf_counter()
    a @ b
    return time.perf_counter() - started


class CpuMatmulCheck:
    """float32 ``size`` x ``size`` matmul: one warm-up, then the median of ``runs``."""

    name = "cpu_matmul_gflops"

    def __init__(self, size: int = 2048, runs: int = 5) -> None:
        self.size, self.runs = size, runs

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        rng = np.random.default_rng(0)
        a = rng.random((self.size, self.size), dtype=np.float32)
        b = rng.random((self.size, self.size), dtype=np.float32)
        _matmul_seconds(a, b)  # warm-up: BLAS threads, page faults
        times = [_matmul_seconds(a, b) for _ in range(self.runs)]
        gflops = [2 * self.size**3 / t / 1e9 for t in times]
        value = median(gflops)
        return [
            CheckResult(
                self.name,
                value,
                "GFLOPS",
                detail=f"float32 {self.size}x{self.size}, median of {self.runs} after a "
                f"warm-up (min {min(gflops):.1f}, max {max(gflops):.1f})",
                judged=True,
            )
        ]


class CpuMemoryBandwidthCheck:
    """Copy of a ``mib`` MiB array: bandwidth counts the bytes read and written, as STREAM."""

    name = "cpu_memory_bandwidth_gbps"

    def __init__(self, mib: int = 256, runs: int = 5) -> None:
        self.mib, self.runs = mib, runs

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        src = np.ones(self.mib * (1 << 20) // 8, dtype=np.float64)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # warm-up: fault the pages in
        rates = []
        for _ in range(self.runs):
            started = time.perf_counter()
            np.copyto(dst, src)
            rates.append(2 * src.nbytes / (time.perf_counter() - started) / 1e9)
        return [
            CheckResult(
                self.name,
                median(rates),
                "GB/s",
                detail=f"{self.mib} MiB copy, read + write, median of {self.runs} "
                f"(min {min(rates):.2f}, max {max(rates):.2f})",
                judged=True,
            )
        ]


class CpuSoakCheck:
    """Sustained matmul for ``ctx.cpu_soak_s`` x ``ctx.scale`` s in windows of ``window_s``.

    The value is the median window's GFLOPS (judged against the fleet); the check fails by
    itself when the last third's median is below ``ctx.cpu_soak_min_ratio`` of the first's.
    """

    name = "cpu_soak_gflops"

    def __init__(self, size: int = 1024, window_s: float = 1.0) -> None:
        self.size, self.window_s = size, window_s

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        duration = ctx.seconds(ctx.cpu_soak_s)
        window = min(self.window_s, duration / 6)
        rng = np.random.default_rng(1)
        a = rng.random((self.size, self.size), dtype=np.float32)
        flop = 2 * self.size**3
        windows: list[float] = []
        end = time.perf_counter() + duration
        while time.perf_counter() < end or len(windows) < 3:
            started, count = time.perf_counter(), 0
            while time.perf_counter() - started < window:
                a @ a
                count += 1
            windows.append(count * flop / (time.perf_counter() - started) / 1e9)
        third = max(1, len(windows) // 3)
        first, last = median(windows[:third]), median(windows[-third:])
        ratio, least = last / first, ctx.cpu_soak_min_ratio
        return [
            CheckResult(
                self.name,
                median(windows),
                "GFLOPS",
                passed=ratio >= least,
                detail=f"{len(windows)} windows of {window:.2f} s over {duration:.1f} s: last "
                f"third {ratio:.0%} of the first (>= {least:.0%} passes); min "
                f"{min(windows):.1f}, max {max(windows):.1f}",
                judged=True,
            )
        ]


class CpuCountCheck:
    """CPUs usable here (affinity) against ``ctx.expected_cpus``; carries the host's SKU."""

    name = "cpu_count"

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        count = count or 0
        want = ctx.expected_cpus
        verdict = (
            "no expected count configured (sweep.expected_cpus)"
            if want is None
            else f"expected {want}"
        )
        return [
            CheckResult(
                self.name,
                float(count),
                "count",
                passed=want is None or count == want,
                baseline=None if want is None else float(want),
                detail=f"sku=cpu:{cpu_model()}; {count} usable CPUs, {verdict}",
            )
        ]

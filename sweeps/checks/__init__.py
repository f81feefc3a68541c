"""Sweep checks that run on the node itself (``guard sweep run``).

One interface (:mod:`.base`: ``name``, ``run(ctx) -> list[CheckResult]``, optionally
``start(ctx)`` when the sweep starts), a GPU implementation on torch + NVML (:mod:`.gpu`,
:mod:`.nvml_health`, :mod:`.network`) and a CPU one on numpy (:mod:`.cpu`) that a host
without GPUs runs — and says so in every check's detail.

:func:`select_checks` picks the checks by name (``--checks``); :func:`run_sweep` runs them,
applies the baselines (:mod:`guard.sweeps.baselines`) and returns the ``sweep`` message.

Example
-------
>>> from guard.sweeps.baselines import FleetBaseline
>>> ctx = CheckContext(node="n1")
>>> checks = select_checks(["cpu_count"], gpu=False, sweep="single")
>>> result = run_sweep(ctx, checks, FleetBaseline({}), sweep="single")
>>> result.kind, [c.name for c in result.checks], result.checks[0].detail.startswith("CPU path")
('sweep', ['cpu_count'], True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from guard.schemas import SweepResult, stable_id

from .base import Check, CheckContext, CheckError, CheckResult, run_timed
from .cpu import CpuCountCheck, CpuMatmulCheck, CpuMemoryBandwidthCheck, CpuSoakCheck, cpu_model
from .gpu import GemmCheck, GpuSoakCheck, HbmCopyCheck, HostDeviceCheck
from .network import IbWriteBwCheck, NcclAllReduceCheck, NicCheck
from .nvml_health import GpuHealthCheck, XidCheck, sku_from_gpu_name

if TYPE_CHECKING:
    from ..baselines import FleetBaseline

__all__ = [
    "CPU_CHECKS",
    "CPU_NOTE",
    "GPU_CHECKS",
    "MULTI_CHECKS",
    "Check",
    "CheckContext",
    "CheckError",
    "CheckResult",
    "detect_sku",
    "run_sweep",
    "select_checks",
]

CPU_NOTE = "CPU path (no GPU on this host)"

#: Check names for ``--checks``, each with what builds it, in the order they run.
GPU_CHECKS: dict[str, Callable[[], Check]] = {
    "gpu_health": GpuHealthCheck,
    "xid": XidCheck,  # listens from the start of the sweep, reports at the end
    "gemm_bf16": lambda: GemmCheck("bf16"),
    "gemm_fp16": lambda: GemmCheck("fp16"),
    "gemm_tf32": lambda: GemmCheck("tf32"),
    "hbm": HbmCopyCheck,
    "host_device": HostDeviceCheck,
    "nccl": lambda: NcclAllReduceCheck(multi=False),
    "soak": GpuSoakCheck,
    "nic": NicCheck,
}
CPU_CHECKS: dict[str, Callable[[], Check]] = {
    "cpu_count": CpuCountCheck,
    "cpu_matmul": CpuMatmulCheck,
    "cpu_memory": CpuMemoryBandwidthCheck,
    "cpu_soak": CpuSoakCheck,
    "nic": NicCheck,
}
MULTI_CHECKS: dict[str, Callable[[], Check]] = {
    "gpu_health": GpuHealthCheck,  # also carries the SKU the fleet baseline is kept by
    "nccl_multinode": lambda: NcclAllReduceCheck(multi=True),
    "ib_write_bw": IbWriteBwCheck,
    "nic": NicCheck,
}
#: Checks that must report last (they cover the whole sweep).
_LAST = ("xid", "nic")


def select_checks(
    names: Sequence[str] | None, gpu: bool, sweep: str, leave_out: Sequence[str] = ()
) -> list[Check]:
    """The checks to run: ``names`` (all of the host's kind when None), in catalogue order.

    ``leave_out`` drops checks from the default set (``nic`` when no NIC is found and none
    is expected, ``ib_write_bw`` when perftest is not installed). Raises
    :class:`ValueError` naming the unknown checks and the known ones.
    """
    catalogue = MULTI_CHECKS if sweep == "multi" else GPU_CHECKS if gpu else CPU_CHECKS
    if names is None:
        chosen = [n for n in catalogue if n not in leave_out]
    else:
        unknown = sorted(set(names) - set(catalogue))
        if unknown:
            kind = "multi-node" if sweep == "multi" else "GPU" if gpu else "CPU"
            raise ValueError(
                f"unknown {kind} check(s) {', '.join(unknown)}; this host runs: "
                f"{', '.join(catalogue)}"
            )
        chosen = [n for n in catalogue if n in names]
    chosen.sort(key=lambda n: n in _LAST)
    return [catalogue[n]() for n in chosen]


def detect_sku(ctx: CheckContext) -> str:
    """``H100 SXM`` (from NVML's name of GPU 0) on a GPU host, ``cpu:<model>`` without one."""
    if ctx.nvml is not None and ctx.gpu is not None and ctx.nvml.nvmlDeviceGetCount() > 0:
        name = ctx.nvml.nvmlDeviceGetName(ctx.nvml.nvmlDeviceGetHandleByIndex(0))
        return sku_from_gpu_name(name.decode() if isinstance(name, bytes) else str(name))
    return f"cpu:{cpu_model()}"


def run_sweep(
    ctx: CheckContext,
    checks: Sequence[Check],
    fleet: FleetBaseline,
    sweep: str = "single",
    tolerance: float = 0.05,
    on_result: Callable[[CheckResult], None] = lambda r: None,
    min_sweeps: int = 3,
) -> SweepResult:
    """Run ``checks`` on this host, judge them against the baselines; the ``sweep`` message."""
    from ..baselines import judge  # baselines reads the checks' base: import it late

    sku = detect_sku(ctx)
    started = time.time()
    failed_start: dict[int, CheckResult] = {}
    for i, check in enumerate(checks):
        start = getattr(check, "start", None)
        if start is not None:
            try:
                start(ctx)
            except Exception as exc:  # the check fails; the others still run
                failed_start[i] = CheckResult(check.name, None, passed=False, detail=str(exc))
    results: list[CheckResult] = []
    for i, check in enumerate(checks):
        got = [failed_start[i]] if i in failed_start else run_timed(check, ctx)
        judge(got, sku, fleet, tolerance, min_sweeps)
        if sku.startswith("cpu:"):
            for r in got:
                r.detail = f"{CPU_NOTE}; {r.detail}" if r.detail else CPU_NOTE
        for r in got:
            on_result(r)
        results += got
    return SweepResult(
        id=stable_id("sweep", ctx.node, sweep, started),
        ts=time.time(),
        node=ctx.node,
        sweep="multi" if sweep == "multi" else "single",
        peers=list(ctx.peers),
        checks=[r.to_check() for r in results],
        passed=bool(results) and all(r.passed for r in results),
    )

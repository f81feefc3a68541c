"""Sweep checks that run on the node itself (``guard sweep run``).

One interface (:mod:`.base`: ``name``, ``run(ctx) -> list[CheckResult]``, optionally
``start(ctx)`` when the sweep starts), a GPU implementation on torch + NVML (:mod:`.gpu`,
:mod:`.nvml_health`, :mod:`.network`) and a CPU one on numpy (:mod:`.cpu`) that a host
without GPUs runs — and says so in every check's detail.

:func:`select_checks` picks the checks by name (``--checks``); :func:`run_sweep` runs them,
applies the baselines (:mod:`guard.sweeps.baselines`) and returns the ``sweep`` message.

The sweep fails closed. What the node should have (``ctx.expected_gpus``) comes from the
scheduler's inventory or from config, never from what the sweep sees; every sweep ends with a
``sweep_coverage`` check (value: GPUs seen, baseline: GPUs expected) that says what kind of
node was judged and what was measured against which baseline, and fails — ``untested`` — when
no GPU count was declared, when fewer (or more) GPUs answer than declared, when NVML did not
start on a GPU node, when a GPU node ran only CPU checks, or when nothing was measured. The CPU
path is for nodes declared GPU-less (``expected_gpus = 0``) only.

Example
-------
>>> from guard.sweeps.baselines import FleetBaseline
>>> ctx = CheckContext(node="n1", expected_gpus=0)
>>> checks = select_checks(["cpu_count"], gpu=False, sweep="single")
>>> result = run_sweep(ctx, checks, FleetBaseline({}), sweep="single")
>>> result.kind, [c.name for c in result.checks], result.checks[0].detail.startswith("CPU path")
('sweep', ['cpu_count', 'sweep_coverage'], True)
>>> result.passed, result.checks[-1].detail.split("; ")[:2]
(True, ['kind=cpu (declared GPU-less)', '0 GPUs seen of 0 expected'])
>>> eight = run_sweep(CheckContext(node="n1", expected_gpus=8), checks, FleetBaseline({}))
>>> eight.passed, eight.checks[-1].detail.split("; ")[2]
(False, 'failed: 8 GPUs expected, 0 seen (NVML not started)')
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from guard.schemas import SweepResult, stable_id

from .base import (
    COVERAGE_CHECK,
    Check,
    CheckContext,
    CheckError,
    CheckResult,
    family,
    run_timed,
)
from .cpu import CpuCountCheck, CpuMatmulCheck, CpuMemoryBandwidthCheck, CpuSoakCheck, cpu_model
from .dcgm import DcgmDiagCheck
from .gpu import GemmCheck, GpuSoakCheck, HbmCopyCheck, HostDeviceCheck
from .network import IbWriteBwCheck, NcclAllReduceCheck, NicCheck
from .nvml_health import GpuHealthCheck, XidCheck, sku_from_gpu_name

if TYPE_CHECKING:
    from ..baselines import FleetBaseline

__all__ = [
    "COVERAGE_CHECK",
    "CPU_CHECKS",
    "CPU_NOTE",
    "GPU_CHECKS",
    "MULTI_CHECKS",
    "Check",
    "CheckContext",
    "CheckError",
    "CheckResult",
    "coverage",
    "detect_sku",
    "run_sweep",
    "select_checks",
]

CPU_NOTE = "CPU path (no GPU on this host)"

#: Check names for ``--checks``, each with what builds it, in the order they run.
GPU_CHECKS: dict[str, Callable[[], Check]] = {
    "gpu_health": GpuHealthCheck,
    "xid": XidCheck,  # listens from the start of the sweep, reports at the end
    "dcgm": DcgmDiagCheck,  # only when dcgmi is installed, unless asked for by name
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
    is expected, ``ib_write_bw`` when perftest is not installed, ``dcgm`` without ``dcgmi``). Raises
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


def gpus_seen(ctx: CheckContext) -> int:
    """GPUs NVML answers for (0 when NVML did not start)."""
    if ctx.nvml is None:
        return 0
    try:
        return int(ctx.nvml.nvmlDeviceGetCount())
    except Exception:  # a driver that fails after init counts as no GPU
        return 0


def coverage(ctx: CheckContext, results: Sequence[CheckResult], gpu_path: bool) -> CheckResult:
    """What the sweep covered, and whether that is enough to judge the node (see the module)."""
    want, seen = ctx.expected_gpus, gpus_seen(ctx)
    problems: list[str] = []
    if want is None:
        problems.append(
            "untested: no GPU count declared for this node (sweep.expected_gpus, 0 for a node "
            "without GPUs; the Slurm and Kubernetes executors pass the scheduler's count)"
        )
    elif want > 0:
        if ctx.nvml is None:
            why = f": {ctx.nvml_error}" if ctx.nvml_error else ""
            problems.append(f"failed: {want} GPUs expected, 0 seen (NVML not started{why})")
        elif seen != want:
            problems.append(f"failed: {want} GPUs expected, {seen} seen")
        if not gpu_path:
            problems.append("failed: a GPU node is not judged on CPU checks")
    elif seen > 0:
        problems.append(f"failed: declared GPU-less (expected 0) but {seen} GPUs seen")
    measured = [r for r in results if r.value is not None]
    if not measured:
        problems.append("untested: no check measured anything")
    judged = [r for r in results if r.judged and r.value is not None]
    against = sorted({f"{family(r.name)} vs {r.against}" for r in judged if r.against})
    unjudged = sorted({family(r.name) for r in judged if not r.against})
    if unjudged:
        problems.append(f"untested: neither a floor nor a fleet baseline for {', '.join(unjudged)}")
    if want is None:
        kind = "gpu" if gpu_path else "cpu"
    else:
        kind = "gpu" if want else "cpu (declared GPU-less)"
    parts = [
        f"kind={kind}",
        f"{seen} GPUs seen of {'an undeclared count' if want is None else want} expected",
        *problems,
        f"{len(measured)} of {len(results)} results measured a value",
        f"judged: {', '.join(against)}" if against else "no throughput judged",
    ]
    return CheckResult(
        COVERAGE_CHECK,
        float(seen),
        "gpus",
        passed=not problems,
        baseline=None if want is None else float(want),
        detail="; ".join(parts),
    )


def run_sweep(
    ctx: CheckContext,
    checks: Sequence[Check],
    fleet: FleetBaseline,
    sweep: str = "single",
    tolerance: float = 0.05,
    on_result: Callable[[CheckResult], None] = lambda r: None,
    min_sweeps: int = 3,
    floors: Mapping[str, float] | None = None,
) -> SweepResult:
    """Run ``checks`` on this host, judge them against the baselines (the shipped floors,
    the site's ``floors`` by family, the fleet), add what the sweep covered; the ``sweep``
    message."""
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
        judge(got, sku, fleet, tolerance, min_sweeps, floors or {})
        if sku.startswith("cpu:"):
            for r in got:
                r.detail = f"{CPU_NOTE}; {r.detail}" if r.detail else CPU_NOTE
        for r in got:
            on_result(r)
        results += got
    covered = coverage(ctx, results, gpu_path=not sku.startswith("cpu:"))
    on_result(covered)
    results.append(covered)
    return SweepResult(
        id=stable_id("sweep", ctx.node, sweep, started),
        ts=time.time(),
        node=ctx.node,
        sweep="multi" if sweep == "multi" else "single",
        peers=list(ctx.peers),
        checks=[r.to_check() for r in results],
        passed=all(r.passed for r in results),
    )

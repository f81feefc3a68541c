"""The one check interface: ``name``, ``run(ctx) -> list[CheckResult]``, a duration.

A check measures one thing on this host (GEMM throughput, a copy's bandwidth, link state)
and returns one result per unit it measured (``gemm_bf16_tflops_gpu3``) with the raw verdict
it can give alone (errors seen, a link down, a clock deficit against sibling GPUs). The
verdicts against the per-SKU floor and the fleet median are applied afterwards by
:mod:`guard.sweeps.baselines`, the same way for every check.

Example
-------
>>> class Answer:
...     name = "answer"
...     def run(self, ctx):
...         return [CheckResult("answer", 42.0, "count", passed=True, detail="as expected")]
>>> [r] = run_timed(Answer(), CheckContext(node="n1"))
>>> r.name, r.value, r.passed, r.duration_s >= 0
('answer', 42.0, True, True)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from guard.schemas import SweepCheck

__all__ = [
    "COVERAGE_CHECK",
    "Check",
    "CheckContext",
    "CheckError",
    "CheckResult",
    "family",
    "median",
    "run_timed",
]


#: The check every sweep ends with: what it covered (value: GPUs seen, baseline: expected).
COVERAGE_CHECK = "sweep_coverage"


class CheckError(RuntimeError):
    """A check could not measure (no device, a library missing): the check fails with it."""


@dataclass(slots=True)
class CheckResult:
    """One measured value with its own verdict (before the baselines)."""

    name: str
    value: float | None
    unit: str = ""
    passed: bool = True
    detail: str = ""
    baseline: float | None = None
    duration_s: float = 0.0
    #: Whether the per-SKU floor and the fleet median judge this value (throughputs).
    judged: bool = False
    #: The baseline that judged it ("H100 SXM floor", "fleet median"); empty: none could.
    against: str = ""
    #: A floor the check knows itself (value, source) where the SKU has none (ib_write_bw
    #: from host memory: by the port's rate).
    floor: tuple[float, str] | None = None

    def to_check(self) -> SweepCheck:
        return SweepCheck(
            name=self.name,
            value=None if self.value is None else round(self.value, 3),
            unit=self.unit,
            baseline=None if self.baseline is None else round(self.baseline, 3),
            passed=self.passed,
            detail=self.detail[:4000],
        )


@dataclass(slots=True)
class CheckContext:
    """What a check may use: the node, what it should have, and the libraries to measure with.

    ``gpu`` is a :class:`~guard.sweeps.checks.gpu_backend.GpuBackend` (torch) and ``nvml``
    the ``pynvml`` module (or a stand-in replaying recorded values); ``nic`` anything with
    ``sample(ts, job) -> list[NicSample]`` (the agent's sysfs reader, passed in by the
    command). ``scale`` shortens every timed phase (tests and quick runs use < 1).
    """

    node: str
    gpu: Any = None
    nvml: Any = None
    #: Why NVML did not start (``nvmlInit``'s error), when ``nvml`` is None.
    nvml_error: str = ""
    nic: Any = None
    expected_gpus: int | None = None
    expected_bus_ids: Sequence[str] = ()
    expected_cpus: int | None = None
    expected_nic_gbps: float | None = None
    soak_s: float = 120.0
    cpu_soak_s: float = 30.0
    cpu_soak_min_ratio: float = 0.75
    scale: float = 1.0
    peers: Sequence[str] = ()
    rendezvous: str | None = None
    node_rank: int = 0
    ib_write_bw: str = "ib_write_bw"
    rdma_devices: Sequence[str] = ()
    dcgmi: str = "dcgmi"
    dcgm_level: int = 1
    dcgm_skip_ok: Sequence[str] = ()
    progress: Callable[[str], None] = field(default=lambda text: None)
    started: float = field(default_factory=time.time)

    def seconds(self, nominal: float) -> float:
        return max(0.05, nominal * self.scale)


class Check(Protocol):
    name: str

    def run(self, ctx: CheckContext) -> list[CheckResult]: ...


def run_timed(check: Check, ctx: CheckContext) -> list[CheckResult]:
    """Run ``check``; a :class:`CheckError` (or any other error) becomes a failed result."""
    started = time.perf_counter()
    try:
        results = check.run(ctx)
    except Exception as exc:  # a check that cannot measure fails; the others still run
        what = "" if isinstance(exc, CheckError) else f"{type(exc).__name__}: "
        results = [CheckResult(check.name, None, passed=False, detail=f"{what}{exc}")]
    took = time.perf_counter() - started
    for result in results:
        result.duration_s = result.duration_s or took / len(results)
    return results


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def family(name: str) -> str:
    """The check family a result belongs to: its name without the unit it measured.

    Per-unit results are named ``<family>:<unit>`` (``gemm_bf16_tflops:gpu3``,
    ``ib_write_bw_gbps:mlx5_0/1``); the floors and the fleet median are kept per family.

    >>> family("gemm_bf16_tflops:gpu7"), family("cpu_count")
    ('gemm_bf16_tflops', 'cpu_count')
    """
    return name.split(":", 1)[0]

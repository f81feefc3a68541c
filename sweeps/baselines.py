"""Verdicts against two baselines: the shipped per-SKU floor and the fleet median.

A throughput result (``judged``) fails when it is under its SKU's floor, or more than
``fleet_tolerance`` (5 %) below the median of the same check in the last passing sweeps of
released nodes of the same SKU: a sweep counts only when the node's next state after it (a
multi-node sweep in between aside) is ``healthy``, i.e. it went back to the pool. A suspect's
single-node pass before a multi-node sweep it then fails is no baseline, and neither is a sweep
whose node is still being swept (:func:`released_sweeps`). The detail says which baseline
judged it and gives the numbers. A CPU host has no floor (its SKU is ``cpu:<model name>``):
it is judged against the fleet only.

The floors carry their public source. ``threshold`` entries are pass marks as their source
uses them (Azure's node health checks); ``typical`` entries are healthy results (SuperBench
baselines, commonly reported figures) and the floor is ``TYPICAL_FLOOR`` (90 %) of them.
``verified`` says whether the number was read in its source by whoever wrote it here.

Example
-------
>>> from guard.sweeps.checks.base import CheckResult
>>> r = CheckResult("ib_write_bw_gdr_gbps:mlx5_0", 340.0, "Gb/s", judged=True)
>>> judge([r], "H200", FleetBaseline({}))[0].passed
False
>>> for part in r.detail.split("; "):
...     print(part)
under the H200 floor of 360 Gb/s (azurehpc-health-checks@0e0a1ac \
conf/nd96isr_h200_v5.conf: check_ib_bw_gdr 360)
no fleet baseline yet
"""

from __future__ import annotations

import bisect
import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from guard.schemas import NodeState, SweepCheck, SweepResult

from .checks.base import CheckResult, family
from .states import is_operator

__all__ = [
    "FLOORS",
    "TYPICAL_FLOOR",
    "FleetBaseline",
    "Floor",
    "judge",
    "node_states_from_clickhouse",
    "released_sweeps",
    "sku_of",
    "sweeps_from_clickhouse",
]

log = logging.getLogger(__name__)

TYPICAL_FLOOR = 0.9
_SKU = re.compile(r"(?:^|; )sku=([^;]+)")

#: Azure's node health checks, read at commit 0e0a1ac (2025-08) of Azure/azurehpc-health-checks.
_AZNHC = "azurehpc-health-checks@0e0a1ac conf/"
_SUPERBENCH = (
    "superbench-results@5e77aa7 v0.4.0/Azure-NDmv4-A100/baseline.json, the mean of 729 "
    "healthy NDmv4 nodes"
)


@dataclass(frozen=True, slots=True)
class Floor:
    value: float
    unit: str
    source: str
    kind: str = "threshold"  # or "typical": the floor is TYPICAL_FLOOR of it
    verified: bool = True

    @property
    def floor(self) -> float:
        return self.value if self.kind == "threshold" else TYPICAL_FLOOR * self.value

    def describe(self) -> str:
        typical = (
            f"{TYPICAL_FLOOR:.0%} of a typical {self.value:g}, " if self.kind == "typical" else ""
        )
        return f"{typical}{self.source}" + ("" if self.verified else ", unverified")


def _aznhc(conf: str, line: str, value: float, unit: str) -> Floor:
    return Floor(value, unit, f"{_AZNHC}{conf}: {line}")


def _nvbandwidth(conf: str, h2d: float, p2p: float) -> Floor:
    """``check_gpu_bw H2D P2P``: nvbandwidth's host<->device copy-engine floor (the first)."""
    return Floor(h2d, "GB/s", f"{_AZNHC}{conf}: check_gpu_bw {h2d:g} {p2p:g} (h2d/d2h)")


_DATASHEET = "NVIDIA datasheet"
# Healthy large GEMMs and copies run well below the datasheets' dense peaks; these typical
# figures scale the commonly reported H100 SXM ones (BF16 ~650 TFLOPS of 989, a copy ~87 % of
# HBM bandwidth) by each part's peak: unverified until a recording replaces them.
_TYPICAL = "scaled from commonly reported healthy H100 SXM figures"


def _typical(value: float, unit: str, peak: str) -> Floor:
    return Floor(value, unit, f"{_TYPICAL}; {_DATASHEET}: {peak}", "typical", verified=False)


_H100 = "nd96isr_h100_v5.conf"
_H200 = "nd96isr_h200_v5.conf"
_A100 = "nd96amsr_a100_v4.conf"

#: Per-SKU floors by check family. The single-node all-reduce floors are Azure's 8-GPU
#: numbers at 16 GB messages; Guard's largest is 8 GB. ``verified``: read in the source at
#: the commit named (Azure's thresholds, SuperBench's A100 means); the GEMM and HBM floors of
#: the Hopper parts are scaled from datasheet peaks (unverified: no published measurement of
#: Guard's own GEMM/copy on them was found; replace them with a recording).
FLOORS: dict[str, dict[str, Floor]] = {
    "H100 SXM": {
        "gemm_bf16_tflops": Floor(
            650, "TFLOPS", "healthy BF16 GEMM as commonly reported (peak 989)", "typical", False
        ),
        "gemm_fp16_tflops": _typical(650, "TFLOPS", "FP16 dense peak 989 TFLOPS"),
        "gemm_tf32_tflops": _typical(325, "TFLOPS", "TF32 dense peak 495 TFLOPS"),
        "hbm_copy_gbps": _typical(2900, "GB/s", "HBM3 3.35 TB/s"),
        "nccl_allreduce_busbw_gbps": _aznhc(_H100, "check_nccl_allreduce 460.0 1 16G", 460, "GB/s"),
        "h2d_gbps": _nvbandwidth(_H100, 48, 335),
        "d2h_gbps": _nvbandwidth(_H100, 48, 335),
        "ib_write_bw_gdr_gbps": _aznhc(_H100, "check_ib_bw_gdr 380", 380, "Gb/s"),
    },
    "H200": {  # H200 SXM (141 GB); the NVL part and GH200 have their own rows
        "gemm_bf16_tflops": _typical(650, "TFLOPS", "BF16 dense peak 989 TFLOPS, as H100 SXM"),
        "gemm_fp16_tflops": _typical(650, "TFLOPS", "FP16 dense peak 989 TFLOPS"),
        "gemm_tf32_tflops": _typical(325, "TFLOPS", "TF32 dense peak 495 TFLOPS"),
        "hbm_copy_gbps": _typical(4150, "GB/s", "HBM3e 4.8 TB/s"),
        "nccl_allreduce_busbw_gbps": _aznhc(_H200, "check_nccl_allreduce 431.0 1 16G", 431, "GB/s"),
        "h2d_gbps": _nvbandwidth(_H200, 48, 335),
        "d2h_gbps": _nvbandwidth(_H200, 48, 335),
        "ib_write_bw_gdr_gbps": _aznhc(_H200, "check_ib_bw_gdr 360", 360, "Gb/s"),
    },
    # PCIe cards (600 W / 400 W, NVLink bridges of 2 or 4): no 8-GPU all-reduce floor applies
    "H200 NVL": {
        "gemm_bf16_tflops": _typical(550, "TFLOPS", "BF16 dense peak 835 TFLOPS (1,671 sparse)"),
        "gemm_fp16_tflops": _typical(550, "TFLOPS", "FP16 dense peak 835 TFLOPS"),
        "hbm_copy_gbps": _typical(4150, "GB/s", "HBM3e 4.8 TB/s"),
    },
    "H100 NVL": {  # Azure's NC80adis H100 v5 (2 x H100 NVL) for the host<->device floor
        "gemm_bf16_tflops": _typical(550, "TFLOPS", "BF16 dense peak 835 TFLOPS (1,671 sparse)"),
        "gemm_fp16_tflops": _typical(550, "TFLOPS", "FP16 dense peak 835 TFLOPS"),
        "hbm_copy_gbps": _typical(3400, "GB/s", "HBM3 3.9 TB/s"),
        "h2d_gbps": _nvbandwidth("nc80adis_h100_v5.conf", 48, 335),
        "d2h_gbps": _nvbandwidth("nc80adis_h100_v5.conf", 48, 335),
    },
    # one GPU per Grace Hopper superchip: no 8-GPU all-reduce floor; HBM3 96 GB at 4 TB/s
    # (the 144 GB HBM3e part is faster, so this floor is the lower of the two)
    "GH200": {
        "gemm_bf16_tflops": _typical(650, "TFLOPS", "BF16 dense peak 989 TFLOPS"),
        "gemm_fp16_tflops": _typical(650, "TFLOPS", "FP16 dense peak 989 TFLOPS"),
        "hbm_copy_gbps": _typical(3450, "GB/s", "HBM3 4 TB/s (96 GB part)"),
    },
    "A100 80GB": {  # SuperBench's gemm-flops *_tc_flops and mem-bw d2d_bw, means of 729 nodes
        "gemm_fp16_tflops": Floor(275.4, "TFLOPS", f"{_SUPERBENCH}: fp16_tc_flops", "typical"),
        "gemm_bf16_tflops": Floor(261.2, "TFLOPS", f"{_SUPERBENCH}: bf16_tc_flops", "typical"),
        "gemm_tf32_tflops": Floor(127.4, "TFLOPS", f"{_SUPERBENCH}: tf32_tc_flops", "typical"),
        "hbm_copy_gbps": Floor(1371.0, "GB/s", f"{_SUPERBENCH}: mem-bw d2d_bw", "typical"),
        "nccl_allreduce_busbw_gbps": _aznhc(_A100, "check_nccl_allreduce 228.0 1 16G", 228, "GB/s"),
        "h2d_gbps": _nvbandwidth(_A100, 21, 238),
        "d2h_gbps": _nvbandwidth(_A100, 21, 238),
        "ib_write_bw_gdr_gbps": _aznhc(_A100, "check_ib_bw_gdr 180.0", 180, "Gb/s"),
    },
}


def sku_of(result: SweepResult) -> str | None:
    """The SKU a sweep ran on: the ``sku=...`` part of its ``gpu_count``/``cpu_count`` detail."""
    for check in result.checks:
        if check.name in ("gpu_count", "cpu_count"):
            found = _SKU.search(check.detail)
            if found:
                return found.group(1).strip()
    return None


def released_sweeps(
    sweeps: Iterable[SweepResult], states: Iterable[NodeState]
) -> list[SweepResult]:
    """The passing sweeps whose node was released after them: its first state after the sweep
    (``sweeping`` records, the multi-node sweep that follows a single-node pass, skipped) is
    ``healthy``. Operators' requests are not states. Order kept.

    >>> from guard.schemas import NodeState, SweepResult
    >>> def at(ts, state):
    ...     return NodeState(ts=ts, node="n1", state=state, actor="orchestrator")
    >>> single, multi = (SweepResult(id=k, ts=t, node="n1", sweep=k, passed=True)
    ...                  for k, t in (("single", 10.0), ("multi", 20.0)))
    >>> [s.sweep for s in released_sweeps([single, multi], [at(11, "sweeping"), at(21, "healthy")])]
    ['single', 'multi']
    >>> released_sweeps([single, multi], [at(11, "sweeping"), at(21, "failed")])
    []
    >>> released_sweeps([single], [at(5, "sweeping")])  # still being swept: no baseline
    []
    """
    by_node: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for state in states:
        if not is_operator(state.actor) and state.state != "sweeping":
            by_node[state.node].append((state.ts, state.state))
    for history in by_node.values():
        history.sort()
    out = []
    for sweep in sweeps:
        history = by_node.get(sweep.node, [])
        i = bisect.bisect_left(history, (sweep.ts, ""))
        if sweep.passed and i < len(history) and history[i][1] == "healthy":
            out.append(sweep)
    return out


class FleetBaseline:
    """Median per check family over the last ``window`` passing sweeps of released nodes."""

    def __init__(self, medians: dict[str, dict[str, tuple[float, int]]], note: str = "") -> None:
        self.medians = medians  # sku -> family -> (median, sweeps)
        self.note = note

    @classmethod
    def from_sweeps(
        cls,
        sweeps: Iterable[SweepResult],
        states: Iterable[NodeState],
        window: int = 20,
        exclude_node: str | None = None,
    ) -> FleetBaseline:
        """From past sweeps, oldest first, of nodes the ``states`` show released after them
        (:func:`released_sweeps`); the node being swept can be left out."""
        by_sku: dict[str, list[SweepResult]] = defaultdict(list)
        for sweep in released_sweeps(sweeps, states):
            sku = sku_of(sweep)
            if sweep.passed and sku and sweep.node != exclude_node:
                by_sku[sku].append(sweep)
        medians: dict[str, dict[str, tuple[float, int]]] = {}
        for sku, passing in by_sku.items():
            values: dict[str, list[float]] = defaultdict(list)
            for sweep in passing[-window:]:
                per_sweep: dict[str, list[float]] = defaultdict(list)
                for check in sweep.checks:
                    if check.value is not None:
                        per_sweep[family(check.name)].append(check.value)
                for fam, vals in per_sweep.items():
                    values[fam].append(statistics.median(vals))
            medians[sku] = {f: (statistics.median(v), len(v)) for f, v in values.items()}
        return cls(medians)

    def get(self, sku: str, fam: str) -> tuple[float, int] | None:
        return self.medians.get(sku, {}).get(fam)


def judge(
    results: list[CheckResult],
    sku: str,
    fleet: FleetBaseline,
    tolerance: float = 0.05,
    min_sweeps: int = 3,
    site_floors: Mapping[str, float] | None = None,
) -> list[CheckResult]:
    """Apply the floor and the fleet median to every judged result (in place; returned).

    The floor is the shipped one for ``sku``, else the site's (``sweep.floors``, by family).
    A judged result with neither a floor nor a fleet baseline is untested: it fails, and
    says which baseline it lacks (a sweep never passes on a number nothing was compared to).
    """
    floors = FLOORS.get(sku, {})
    for r in results:
        if not r.judged or r.value is None:
            continue
        fam = family(r.name)
        notes = []
        floor, whose = floors.get(fam), f"{sku} floor"
        if floor is None and r.floor is not None:
            floor, whose = Floor(r.floor[0], r.unit, r.floor[1]), "host-memory floor"
        if floor is None and site_floors and fam in site_floors:
            floor, whose = Floor(site_floors[fam], r.unit, f"sweep.floors.{fam}"), "site floor"
        judged_by = []
        if floor is not None and floor.unit == r.unit:
            r.baseline = floor.floor
            judged_by.append(f"{whose} {floor.floor:g}")
            if r.value < floor.floor:
                r.passed = False
                where = f"{floor.floor:g} {r.unit} ({floor.describe()})"
                notes.append(f"under the {whose} of {where}")
            else:
                notes.append(f"above the {whose} of {floor.floor:g} {r.unit}")
        elif sku.startswith("cpu:"):
            notes.append("CPU host: no floor, fleet baseline only")
        else:
            notes.append(f"no {sku} floor for {fam}")
        fleet_note, median_of = _fleet_note(r, sku, fam, fleet, tolerance, min_sweeps)
        notes.append(fleet_note)
        if median_of is not None:
            judged_by.append(f"fleet median {median_of:g}")
        r.against = " and ".join(judged_by)
        if not judged_by:
            r.passed = False
            notes.append(
                f"untested: neither a floor nor a fleet baseline to judge it by (set "
                f"sweep.floors.{fam}, or let {min_sweeps} released {sku} nodes pass first)"
            )
        r.detail = "; ".join(n for n in [r.detail, *notes] if n)
    return results


def _fleet_note(
    r: CheckResult, sku: str, fam: str, fleet: FleetBaseline, tolerance: float, min_sweeps: int
) -> tuple[str, float | None]:
    """What the fleet median says of ``r``, and the median when there was one to judge by."""
    got = fleet.get(sku, fam)
    if got is None or got[1] < min_sweeps:
        have = 0 if got is None else got[1]
        why = f" ({fleet.note})" if fleet.note else ""
        if not have:
            return f"no fleet baseline yet{why}", None
        return f"fleet baseline from {have} sweeps only (needs {min_sweeps})", None
    med, count = got
    assert r.value is not None
    r.baseline = med
    below = 1 - r.value / med
    text = f"fleet median {med:g} {r.unit} of {count} passing {sku} sweeps"
    if below > tolerance:
        r.passed = False
        return f"{below:.1%} below the {text} (> {tolerance:.0%} fails)", med
    if below > 0:
        return f"{below:.1%} below the {text}", med
    return f"at or above the {text}", med


_FIELDS = ("name", "value", "unit", "baseline", "passed", "detail")


def node_states_from_clickhouse(client: Any, database: str, since: float) -> list[NodeState]:
    """The node states ClickHouse holds from ``since`` on (what :func:`released_sweeps` reads)."""
    rows = client.query(
        f"SELECT toFloat64(ts), node, state, actor FROM {database}.node_states FINAL "
        f"WHERE ts >= toDateTime64({float(since)!r}, 3) ORDER BY node, ts"
    ).result_rows
    return [
        NodeState(ts=ts, node=node, state=state, actor=actor) for ts, node, state, actor in rows
    ]


def sweeps_from_clickhouse(client: Any, database: str, limit: int = 2000) -> list[SweepResult]:
    """The latest ``limit`` passing sweeps in ClickHouse's sweeps table, oldest first."""
    rows = client.query(
        f"SELECT toFloat64(ts), node, id, sweep, peers, checks FROM {database}.sweeps FINAL "
        f"WHERE passed ORDER BY ts DESC LIMIT {int(limit)}"
    ).result_rows
    out = []
    for ts, node, sweep_id, sweep, peers, checks in reversed(rows):
        out.append(
            SweepResult(
                ts=ts,
                node=node,
                id=sweep_id,
                sweep=sweep,
                peers=list(peers),
                passed=True,
                # named tuples come back as dicts (or tuples, by client settings)
                checks=[
                    SweepCheck.model_validate(
                        c if isinstance(c, dict) else dict(zip(_FIELDS, c, strict=True))
                    )
                    for c in checks
                ],
            )
        )
    return out

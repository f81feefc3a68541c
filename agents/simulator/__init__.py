"""A fault-injecting cluster simulator: causal GPU, NIC, step and collective telemetry.

N nodes x 8 GPUs x one NIC per GPU (rail-optimised: GPU *g* talks to GPU *g* of the next
node through NIC ``mlx5_g``) run synchronous training jobs; some nodes stay idle. Every
second each node's agent samples its GPUs and NICs; each step every rank reports its step
timing and its view of the step's gradient all-reduce.

The model, in one paragraph: a rank's compute time is the stage's nominal compute times a
per-GPU speed factor (about 1 % heterogeneity), times ``1 + slowdown`` of any fault on its
GPU, times small noise. Ranks enter the all-reduce when their compute ends; the all-reduce
starts when the last one arrives and lasts as long as its slowest connection (a degraded or
slowed NIC slows its two ring connections, so the whole job). Everyone leaves together, so
``step_s`` is the same for all ranks and a straggler shows only in ``compute_s`` and arrival
order. Telemetry follows the same physics: a throttled GPU is hot, its SM clock is down by
exactly the factor that slows its compute, and its clock-event reason bits say why.

Faults (``truth["faults"]``; kinds and categories as in ``docs/simulator-truth.md``):
``thermal_throttle`` (steady or intermittent), ``power_cap``, ``power_brake``, ``slow_gpu``
(silent: no telemetry signature; steady or ``degrading`` over tens of minutes),
``degraded_nic`` (symbol / receive errors, retransmits, slower connections),
``nic_reduced_speed`` (400 → 200 Gb/s), ``link_flap`` (``link_downed`` increments, the link
is down for a sample or two and the whole job hangs a few seconds), ``xid`` and ``ecc_dbe``.
The mix is calibrated from the InfiniteHBD production fault trace (see
:mod:`guard.agents.calibration`); the rate is accelerated (``faults_per_node_hour``).

Confounders (``truth["confounders"]``), none of which is a node fault: checkpoint steps and
data stalls that slow the whole job, one-step hiccups on random ranks, pipeline-stage
imbalance (the last stage does more work, persistently), a hot rack that stays below the
throttling temperature, fabric-wide congestion (ECN / CNP / ``port_xmit_wait`` up
everywhere, connections slower, no errors), an agent restart (a gap, then NIC counters and
the PCIe replay counter start again from zero), a telemetry gap (no GPU / NIC samples for a
minute or two), small clock skew between hosts, and slightly out-of-order arrival of one
node's messages. Baseline noise also has healthy GPUs touch their power limit now and then
(``0x4`` for a sample) and a rare single symbol error on healthy links.

Library use (what ``guard demo`` and the detection-quality benchmark do)::

    from guard.agents.simulator import ClusterSimulator, SimConfig, FaultSpec

    sim = ClusterSimulator(SimConfig(nodes=32, duration_s=600, seed=7))
    for message in sim.messages():      # GuardMessage models, in event-time order
        ...                             # (except the skew / out-of-order confounders)
        if want_to_remediate:
            sim.remediate("node-012")   # thread-safe; applied at the job's next step
    truth = sim.truth()                 # the dict of docs/simulator-truth.md
    sim.step_times("job-a")             # [(ts, step_s), ...] to compare runs

``sim.batches()`` yields the same messages one sampling tick at a time (a list per
simulated second), which is cheaper to pace for live replay (``guard agent --simulate``).
``write_jsonl(config, path, workers=None)`` writes a run to JSONL and returns ``(truth,
counts)``; with several workers it forks, so call it from a single-threaded process (or
pass ``workers=1``). Messages are built without validation (valid by construction; the
tests validate the output through ``guard.schemas``); treat them as read-only.

The truth dict follows ``docs/simulator-truth.md`` and adds three fields: ``idle_nodes``
(nodes without a job at the start), ``excluded_nodes`` (``SimConfig.excluded``) and
``remediations`` (``[{node, job, ts, replaced_by, restart_s}]``).

``remediate(node)`` models what Guard's orchestrator does: the node is cordoned, the job
restarts from its last checkpoint (``SimConfig.restart_s`` without steps) with a spare idle
node taking over the same ranks; the cordoned node keeps reporting telemetry as an idle
node. Without a spare the job continues without the node's ranks. ``SimConfig.excluded``
lists nodes that are cordoned from the start (never placed in a job). Noise is drawn from
streams that do not depend on placement, so a run with remediation and one without, from
the same seed, differ only by the remediation; ``truth["remediations"]`` lists what was
done. Explicit faults instead of (or besides) sampled ones: ``SimConfig(faults=[FaultSpec(
"thermal_throttle", node="node-003", gpu=2, onset_s=120, slowdown=0.15)], random_faults=0)``.
"""

from __future__ import annotations

import bisect
import gc
import math
import multiprocessing
import operator
import os
import shutil
import threading
import uuid as uuid_module
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from guard.agents.calibration import FAULT_MIX
from guard.schemas import (
    CollectiveTiming,
    ConnectionStat,
    GpuSample,
    NicSample,
    StepTiming,
    encode,
)

__all__ = [
    "CATEGORY_BY_KIND",
    "CONFOUNDER_KINDS",
    "NIC_COUNTERS",
    "ClusterSimulator",
    "FaultSpec",
    "JobSpec",
    "SimConfig",
    "write_jsonl",
]

CATEGORY_BY_KIND = {
    "thermal_throttle": "thermal",
    "power_cap": "power",
    "power_brake": "power",
    "slow_gpu": "straggler",
    "degraded_nic": "nic",
    "nic_reduced_speed": "nic",
    "link_flap": "link",
    "xid": "gpu_error",
    "ecc_dbe": "gpu_error",
}
CONFOUNDER_KINDS = (
    "checkpoint",
    "data_stall",
    "hiccup",
    "stage_imbalance",
    "hot_rack",
    "fabric_congestion",
    "agent_restart",
    "telemetry_gap",
    "clock_skew",
    "out_of_order",
)
NIC_COUNTERS = (
    "port_xmit_data",
    "port_rcv_data",
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_xmit_discards",
    "port_xmit_wait",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
)
_C = {name: i for i, name in enumerate(NIC_COUNTERS)}

# H100 SXM-class nominal values.
POWER_LIMIT_W = 700.0
SM_CLOCK_MAX_MHZ = 1980.0
SM_CLOCK_IDLE_MHZ = 345.0
MEM_CLOCK_MHZ = 2619.0
THROTTLE_TEMP_C = 87.0
LINK_GBPS = 400.0
# Share of a step's compute that scales with the SM clock (the rest is memory-bound).
CLOCK_BOUND = 0.9

REASON_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80

_NONFATAL_XIDS = (13, 31, 43, 45, 63, 74, 94)
_DEVICES = [f"mlx5_{j}" for j in range(256)]
_GRADIENT_BYTES = 2 * 1024**3
_NETDEVS = [f"ib{j}" for j in range(256)]


@dataclass
class FaultSpec:
    """One fault to inject. ``onset_s`` / ``end_s`` are seconds from the start of the run."""

    kind: str
    node: str | None = None  # None: a random busy node
    gpu: int | None = None  # None: a random GPU (or NIC) of the node
    onset_s: float | None = None  # None: random in SimConfig.onset_window
    end_s: float | None = None  # None: lasts to the end
    slowdown: float | None = None  # None: drawn from the kind's range x severity
    pattern: str | None = None  # steady | intermittent | degrading (kind-dependent)


@dataclass
class JobSpec:
    name: str
    nodes: int
    pp_stages: int = 1
    step_s_nominal: float = 2.0


@dataclass
class SimConfig:
    """Everything that shapes a simulated run; the same config and seed give the same bytes."""

    nodes: int = 16
    duration_s: float = 600.0
    seed: int = 0
    start_ts: float = 1767225600.0  # 2026-01-01T00:00:00Z
    gpus_per_node: int = 8
    sample_interval_s: float = 1.0
    step_s_nominal: float = 2.0
    idle_fraction: float = 0.08
    jobs: list[JobSpec] | None = None  # None: one DP job, plus a 2-stage PP job from 16 nodes
    faults: list[FaultSpec] = field(default_factory=list)
    random_faults: int | None = None  # None: round(faults_per_node_hour x node-hours), >= 1
    faults_per_node_hour: float = 0.125  # ~700x the InfiniteHBD rate, to see faults in an hour
    fault_mix: dict[str, float] | None = None  # None: calibration.FAULT_MIX
    severity: float = 1.0  # multiplies every drawn slowdown
    onset_window: tuple[float, float] = (0.1, 0.6)  # fraction of the run where faults start
    confounders: bool = True
    clock_skew_max_s: float = 0.015
    checkpoint_every_s: float = 900.0
    restart_s: float = 60.0
    excluded: frozenset[str] = frozenset()
    gpu_speed_sigma: float = 0.01
    rack_size: int = 8

    def node_names(self) -> list[str]:
        return [f"node-{i:03d}" for i in range(self.nodes)]


# --- internal state ------------------------------------------------------------------------


@dataclass
class _Fault:
    id: str
    kind: str
    node: int
    gpu: int
    onset: float
    end: float | None
    slowdown: float
    pattern: str
    detail: dict[str, Any]
    events: list[float] = field(default_factory=list)  # flaps, Xids, DBEs (absolute ts)

    def active(self, t: float) -> bool:
        return t >= self.onset and (self.end is None or t < self.end)


@dataclass
class _Job:
    name: str
    nodes: list[int]
    pp_stages: int
    step_s_nominal: float
    stage_factor: list[float]
    rank_node: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_gpu: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_stage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_dp: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    active: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    step: int = 0
    next_start: float = 0.0
    seq: int = 0
    step_log: list[tuple[float, float]] = field(default_factory=list)
    checkpoints: list[tuple[float, float]] = field(default_factory=list)
    flap_cursor: float = 0.0
    layout_version: int = 0


_new_object = object.__new__
_set_slot = object.__setattr__


def _fast_builder(cls: type) -> Callable[[dict[str, Any]], Any]:
    """A constructor without validation, for values we generate ourselves (valid by
    construction; tests validate the output through the schemas). ``model_construct`` costs
    ~18 us a message, this ~1 us, which is what lets an hour of 64 nodes fit in a minute.
    Callers pass every field of the model.

    Every message shares one fields-set holding every field name: pydantic only ever adds
    a known field's name to it (assigning an unknown attribute raises), so it never
    changes, and sharing it saves a set per message."""
    fields = set(cls.model_fields)  # type: ignore[attr-defined]

    def build(data: dict[str, Any]) -> Any:
        obj: Any = _new_object(cls)
        _set_slot(obj, "__dict__", data)
        _set_slot(obj, "__pydantic_fields_set__", fields)
        _set_slot(obj, "__pydantic_extra__", None)
        _set_slot(obj, "__pydantic_private__", None)
        return obj

    return build


_gpu_model = _fast_builder(GpuSample)
_nic_model = _fast_builder(NicSample)
_step_model = _fast_builder(StepTiming)
_coll_model = _fast_builder(CollectiveTiming)
_conn_model = _fast_builder(ConnectionStat)


class ClusterSimulator:
    """Simulated cluster; see the module docstring for the model and the API."""

    def __init__(self, config: SimConfig) -> None:
        if config.nodes < 1 or config.gpus_per_node < 1:
            raise ValueError("a simulated cluster needs at least one node and one GPU per node")
        if config.duration_s <= 0 or config.sample_interval_s <= 0:
            raise ValueError("duration_s and sample_interval_s must be positive")
        self.config = config
        self.node_names = config.node_names()
        self.start_ts = float(config.start_ts)
        self.end_ts = self.start_ts + float(config.duration_s)
        self._lock = threading.Lock()
        self._busy: np.ndarray | None = None
        self._job_of: dict[int, str] = {}
        self._pending_remediation: list[str] = []
        self._remediations: list[dict[str, Any]] = []
        self._confounders: list[dict[str, Any]] = []
        self._hiccup_ids = 0
        plan = np.random.default_rng([config.seed, 1])
        self._noise = np.random.default_rng([config.seed, 2])
        self._step_noise = np.random.default_rng([config.seed, 3])
        n, g = config.nodes, config.gpus_per_node
        self._gpu_speed = 1.0 + config.gpu_speed_sigma * plan.standard_normal((n, g))
        self._temp_offset = 2.0 * plan.standard_normal((n, g))
        self._power_offset = 1.0 + 0.03 * plan.standard_normal((n, g))
        self._phase = plan.uniform(0.05, 0.9, n)
        self._uuids = [
            [str(uuid_module.UUID(bytes=plan.bytes(16), version=4)) for _ in range(g)]
            for _ in range(n)
        ]
        self._skew = plan.uniform(-0.001, 0.001, n)
        self._jobs = self._place_jobs(plan)
        self._faults = self._plan_faults(plan)
        self._plan_confounders(plan)
        self._counters = np.zeros((n, g, len(NIC_COUNTERS)), dtype=np.int64)
        self._counters[:, :, _C["port_xmit_data"]] = plan.integers(10**9, 10**12, (n, g))
        self._counters[:, :, _C["port_rcv_data"]] = self._counters[:, :, _C["port_xmit_data"]]
        self._ecc_sbe = plan.poisson(0.3, (n, g)).astype(np.int64)
        self._ecc_dbe = np.zeros((n, g), dtype=np.int64)
        self._pcie = plan.poisson(0.5, (n, g)).astype(np.int64)
        self._temp = np.where(self._busy_mask(), 60.0, 32.0) + self._temp_offset
        self._phase_l = self._phase.tolist()
        self._skew_l = self._skew.tolist()
        self._build_steps = True
        self._templates: dict[
            int, tuple[str | None, list[dict[str, Any]], list[dict[str, Any]]]
        ] = {}
        self._rank_cache: dict[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]] = {}
        self._objects: dict[int, tuple[Any, list[Any], list[Any]]] = {}
        self._reuse_samples = False  # set by the JSONL writer only (see _sample_objects)
        self._done = False

    # --- public API ------------------------------------------------------------------------

    def remediate(self, node: str) -> None:
        """Cordon ``node``: at its job's next step a spare takes over its ranks (thread-safe)."""
        if node not in self.node_names:
            raise ValueError(f"unknown node {node!r}")
        with self._lock:
            self._pending_remediation.append(node)

    def step_times(self, job: str) -> list[tuple[float, float]]:
        """``(end_ts, step_s)`` of every step of ``job`` simulated so far."""
        for j in self._jobs:
            if j.name == job:
                return list(j.step_log)
        raise ValueError(f"unknown job {job!r}")

    def truth(self) -> dict[str, Any]:
        """Ground truth in the format of ``docs/simulator-truth.md`` (plus ``remediations``)."""
        cfg = self.config
        faults = [
            {
                "id": f.id,
                "node": self.node_names[f.node],
                "gpu": f.gpu
                if f.kind not in ("degraded_nic", "nic_reduced_speed", "link_flap")
                else None,
                "device": f"mlx5_{f.gpu}"
                if f.kind in ("degraded_nic", "nic_reduced_speed", "link_flap")
                else None,
                "kind": f.kind,
                "category": CATEGORY_BY_KIND[f.kind],
                "onset": round(f.onset, 3),
                "end": None if f.end is None else round(f.end, 3),
                "slowdown": round(f.slowdown, 4),
                "pattern": f.pattern,
                "detail": f.detail,
            }
            for f in sorted(self._faults, key=lambda f: f.id)
        ]
        return {
            "version": 1,
            "seed": cfg.seed,
            "start_ts": self.start_ts,
            "end_ts": self.end_ts,
            "nodes": list(self.node_names),
            "gpus_per_node": cfg.gpus_per_node,
            "jobs": [
                {
                    "job": j.name,
                    "nodes": [self.node_names[i] for i in j.nodes],
                    "ranks": len(j.nodes) * cfg.gpus_per_node,
                    "pp_stages": j.pp_stages,
                    "step_s_nominal": j.step_s_nominal,
                }
                for j in self._jobs
            ],
            "idle_nodes": [self.node_names[i] for i in self._initial_idle],
            "excluded_nodes": sorted(cfg.excluded),
            "faults": faults,
            "confounders": sorted(self._confounders, key=lambda c: (c["start"], c["id"])),
            "remediations": list(self._remediations),
        }

    def messages(self) -> Iterator[Any]:
        """Every message of the run in event-time order (GuardMessage models).

        Single use: a simulator object runs once (make a new one for a second run).
        """
        for batch in self.batches():
            yield from batch

    def batches(
        self, emit_from: float | None = None, emit_until: float | None = None
    ) -> Iterator[list[Any]]:
        """The messages of each sampling tick as one list, in event-time order.

        Simulates the whole run but builds messages only for ticks in ``[emit_from,
        emit_until)`` (default: all), which is what lets :func:`write_jsonl` split a run
        across processes by time and still write exactly the single-process bytes.
        """
        if self._done:
            raise RuntimeError("this simulator has already run; build a new ClusterSimulator")
        self._done = True
        emit_from = self.start_ts if emit_from is None else emit_from
        emit_until = self.end_ts + 1.0 if emit_until is None else emit_until
        dt = float(self.config.sample_interval_s)
        carry: list[tuple[float, Any]] = []
        t = self.start_ts
        for job in self._jobs:
            job.next_start = self.start_ts + float(self._step_noise.uniform(0, job.step_s_nominal))
        # Step messages are built a few steps ahead of the tick that yields them.
        margin = 4 * max(job.step_s_nominal for job in self._jobs) + 60 if self._jobs else 0
        while t < self.end_ts - 1e-9:
            if t >= emit_until:
                return
            tick_end = min(t + dt, self.end_ts)
            out: list[tuple[float, Any]] = []
            state = self._gpu_state(t, dt)
            self._build_steps = emit_from - margin <= t
            for job in self._jobs:
                self._run_steps(job, tick_end, state, out)
            emit = t >= emit_from
            # Out-of-order messages of the ticks just before the window arrive inside it.
            self._samples(t, dt, state, out if t >= emit_from - 10.0 else None)
            if carry:
                out.extend(carry)
                carry = []
            out.sort(key=_first)
            cut = bisect.bisect_left(out, tick_end, key=_first)
            if cut < len(out):
                carry = out[cut:]
                del out[cut:]
            if emit and out:
                yield [message for _, message in out]
            t = tick_end
        # What was still in flight at the end: only what happened before the end.
        late = [message for _, message in carry if message.ts < self.end_ts]
        if late:
            yield late

    # --- planning --------------------------------------------------------------------------

    def _busy_mask(self) -> np.ndarray:
        if self._busy is None:
            busy = np.zeros((self.config.nodes, self.config.gpus_per_node), dtype=bool)
            for job in self._jobs:
                busy[job.rank_node[job.active], :] = True
            self._busy = busy
            self._job_of = {
                int(node): job.name
                for job in self._jobs
                for node in np.unique(job.rank_node[job.active]).tolist()
            }
        return self._busy

    def _place_jobs(self, plan: np.random.Generator) -> list[_Job]:
        cfg = self.config
        available = [i for i, name in enumerate(self.node_names) if name not in cfg.excluded]
        if cfg.jobs is not None:
            specs = cfg.jobs
        else:
            idle = round(len(available) * cfg.idle_fraction) if len(available) >= 4 else 0
            idle = max(idle, 1) if len(available) >= 4 else idle
            busy = len(available) - idle
            if busy >= 16:
                second = max(2, busy // 4)
                specs = [
                    JobSpec("job-a", busy - second, 1, cfg.step_s_nominal),
                    JobSpec("job-b", second - second % 2, 2, cfg.step_s_nominal * 1.5),
                ]
            else:
                specs = [JobSpec("job-a", busy, 1, cfg.step_s_nominal)]
        if sum(s.nodes for s in specs) > len(available):
            raise ValueError(
                f"jobs need {sum(s.nodes for s in specs)} nodes but only {len(available)} are "
                "available (nodes minus excluded)"
            )
        jobs = []
        cursor = 0
        for spec in specs:
            if spec.nodes < 1:
                continue
            if spec.pp_stages < 1 or spec.nodes % spec.pp_stages:
                raise ValueError(f"job {spec.name}: nodes must be a multiple of pp_stages")
            nodes = available[cursor : cursor + spec.nodes]
            cursor += spec.nodes
            # The last pipeline stage also runs the loss and the output embedding.
            stage_factor = [1.0] * spec.pp_stages
            if spec.pp_stages > 1:
                stage_factor[-1] = 1.0 + float(plan.uniform(0.06, 0.12))
            job = _Job(spec.name, nodes, spec.pp_stages, spec.step_s_nominal, stage_factor)
            self._assign_ranks(job)
            jobs.append(job)
        self._initial_idle = available[cursor:]
        self._spares = list(self._initial_idle)
        return jobs

    def _assign_ranks(self, job: _Job) -> None:
        g = self.config.gpus_per_node
        per_stage = len(job.nodes) // job.pp_stages
        ranks = len(job.nodes) * g
        job.rank_node = np.repeat(np.array(job.nodes, dtype=np.int64), g)
        job.rank_gpu = np.tile(np.arange(g, dtype=np.int64), len(job.nodes))
        node_pos = np.repeat(np.arange(len(job.nodes)), g)
        job.rank_stage = node_pos // per_stage
        job.rank_dp = (node_pos % per_stage) * g + job.rank_gpu
        job.active = np.ones(ranks, dtype=bool)

    def _plan_faults(self, plan: np.random.Generator) -> list[_Fault]:
        cfg = self.config
        busy_nodes = [n for job in self._jobs for n in job.nodes]
        specs = list(cfg.faults)
        count = cfg.random_faults
        if count is None:
            count = round(cfg.faults_per_node_hour * cfg.nodes * cfg.duration_s / 3600)
            count = max(1, count) if busy_nodes else 0
        mix = cfg.fault_mix or FAULT_MIX
        kinds = [k for k in mix if mix[k] > 0]
        unknown = [k for k in kinds if k not in CATEGORY_BY_KIND]
        if unknown:
            raise ValueError(f"unknown fault kinds in fault_mix: {unknown}")
        weights = np.array([mix[k] for k in kinds], dtype=float)
        used = {s.node for s in specs if s.node is not None}
        free = [n for n in busy_nodes if self.node_names[n] not in used]
        count = min(count, len(free))
        for _ in range(count):
            kind = str(plan.choice(kinds, p=weights / weights.sum()))
            specs.append(FaultSpec(kind))
        faults: list[_Fault] = []
        for number, spec in enumerate(specs, 1):
            faults.append(self._make_fault(plan, number, spec, free))
        return faults

    def _make_fault(
        self, plan: np.random.Generator, number: int, spec: FaultSpec, free: list[int]
    ) -> _Fault:
        cfg = self.config
        if spec.kind not in CATEGORY_BY_KIND:
            raise ValueError(f"unknown fault kind {spec.kind!r}; known: {sorted(CATEGORY_BY_KIND)}")
        if spec.node is not None:
            if spec.node not in self.node_names:
                raise ValueError(f"fault {spec.kind}: unknown node {spec.node!r}")
            node = self.node_names.index(spec.node)
        else:
            if not free:
                raise ValueError("no busy node left for a random fault")
            node = free.pop(int(plan.integers(len(free))))
        gpu = int(plan.integers(cfg.gpus_per_node)) if spec.gpu is None else int(spec.gpu)
        if not 0 <= gpu < cfg.gpus_per_node:
            raise ValueError(
                f"fault {spec.kind}: gpu {gpu} is not on a {cfg.gpus_per_node}-GPU node"
            )
        lo, hi = cfg.onset_window
        onset_s = (
            spec.onset_s
            if spec.onset_s is not None
            else float(plan.uniform(lo, hi)) * cfg.duration_s
        )
        onset = self.start_ts + onset_s
        end = None if spec.end_s is None else self.start_ts + spec.end_s
        sev = cfg.severity
        kind = spec.kind
        detail: dict[str, Any] = {}
        pattern = spec.pattern or "steady"
        events: list[float] = []

        def draw(a: float, b: float) -> float:
            value = spec.slowdown if spec.slowdown is not None else float(plan.uniform(a, b)) * sev
            return max(0.0, value)

        if kind == "thermal_throttle":
            slowdown = draw(0.08, 0.25)
            if spec.pattern is None:
                pattern = "intermittent" if plan.random() < 0.4 else "steady"
            detail = {"temp_c": round(float(plan.uniform(88, 93)), 1)}
            if pattern == "intermittent":
                detail.update(
                    on_s=round(float(plan.uniform(20, 90))),
                    off_s=round(float(plan.uniform(30, 120))),
                )
        elif kind == "power_cap":
            slowdown = draw(0.05, 0.15)
            detail = {"power_limit_w": round(POWER_LIMIT_W * float(plan.uniform(0.6, 0.75)))}
        elif kind == "power_brake":
            slowdown = draw(0.2, 0.5)
        elif kind == "slow_gpu":
            slowdown = draw(0.05, 0.25)
            if spec.pattern is None:
                pattern = "degrading" if plan.random() < 0.5 else "steady"
            if pattern == "degrading":
                detail = {"ramp_s": round(float(plan.uniform(1200, 2400)))}
        elif kind == "degraded_nic":
            slowdown = draw(0.2, 0.6)
            detail = {"symbol_errors_per_s": round(float(plan.uniform(2, 20)), 1)}
        elif kind == "nic_reduced_speed":
            slowdown = spec.slowdown if spec.slowdown is not None else 1.0
            detail = {"speed_gbps": LINK_GBPS / (1.0 + slowdown)}
        elif kind == "link_flap":
            slowdown = 0.0
            t = onset
            limit = self.end_ts if end is None else end
            while t < limit:
                events.append(t)
                t += float(plan.uniform(180, 900))
            detail = {"flaps": len(events), "hang_s": round(float(plan.uniform(5, 15)), 1)}
            pattern = "intermittent"
        elif kind in ("xid", "ecc_dbe"):
            slowdown = 0.0
            t = onset
            limit = self.end_ts if end is None else end
            while t < limit:
                events.append(t)
                t += float(plan.uniform(60, 600))
            detail = {"xid": int(plan.choice(_NONFATAL_XIDS))} if kind == "xid" else {"xid": 48}
            pattern = "intermittent"
        else:  # pragma: no cover - guarded above
            raise ValueError(kind)
        return _Fault(
            f"f-{number:04d}", kind, node, gpu, onset, end, slowdown, pattern, detail, events
        )

    def _add_confounder(
        self,
        kind: str,
        start: float,
        end: float,
        node: int | None = None,
        job: str | None = None,
        **detail: Any,
    ) -> None:
        self._confounders.append(
            {
                "id": f"c-{len(self._confounders) + 1:04d}",
                "kind": kind,
                "node": None if node is None else self.node_names[node],
                "job": job,
                "start": round(start, 3),
                "end": round(end, 3),
                "detail": detail,
            }
        )

    def _plan_confounders(self, plan: np.random.Generator) -> None:
        cfg = self.config
        n = cfg.nodes
        dur = cfg.duration_s
        self._stalls: list[tuple[float, float, float]] = []  # (start, end, extra fraction)
        self._congestion: list[tuple[float, float, float]] = []  # (start, end, comm factor)
        self._hot_nodes = np.zeros(n, dtype=bool)
        self._hot_extra = 0.0
        self._gaps: list[tuple[int, float, float, bool]] = []  # node, start, end, drop steps too
        self._restarts: list[tuple[int, float]] = []  # node, ts of counter reset
        self._ooo: list[tuple[int, float, float, float]] = []  # node, start, end, max delay
        for job in self._jobs:
            if job.pp_stages > 1:
                self._add_confounder(
                    "stage_imbalance",
                    self.start_ts,
                    self.end_ts,
                    job=job.name,
                    stage=job.pp_stages - 1,
                    extra=round(job.stage_factor[-1] - 1, 4),
                )
        if not cfg.confounders:
            return
        busy = [node for job in self._jobs for node in job.nodes]
        # Data stalls: shared storage slow for everyone, a few per hour.
        for _ in range(max(1, round(plan.poisson(3 * dur / 3600)))):
            start = self.start_ts + float(plan.uniform(0.05, 0.95)) * dur
            length = float(plan.uniform(10, 60))
            extra = float(plan.uniform(0.3, 1.0))
            self._stalls.append((start, start + length, extra))
            for job in self._jobs:
                self._add_confounder(
                    "data_stall", start, start + length, job=job.name, extra=round(extra, 3)
                )
        # Fabric-wide congestion: one or two episodes per hour.
        for _ in range(max(1, round(plan.poisson(1.5 * dur / 3600)))):
            start = self.start_ts + float(plan.uniform(0.05, 0.9)) * dur
            length = float(plan.uniform(60, 300))
            factor = 1.0 + float(plan.uniform(0.1, 0.3))
            self._congestion.append((start, start + length, factor))
            self._add_confounder(
                "fabric_congestion", start, start + length, comm_factor=round(factor, 3)
            )
        # A hot rack: hotter by 8-12 deg C but below the throttling temperature.
        racks = max(1, n // cfg.rack_size)
        if n >= 2:
            rack = int(plan.integers(racks))
            nodes = range(rack * cfg.rack_size, min(n, (rack + 1) * cfg.rack_size))
            self._hot_extra = float(plan.uniform(8, 12))
            for node in nodes:
                self._hot_nodes[node] = True
                self._add_confounder(
                    "hot_rack",
                    self.start_ts,
                    self.end_ts,
                    node=node,
                    rack=f"rack-{rack}",
                    extra_c=round(self._hot_extra, 1),
                )
        else:
            self._hot_extra = 0.0
        if not busy:
            return
        # Confounders go to nodes without an injected fault where there are enough of them,
        # so that evaluation can tell a false flag from a late true one.
        faulty = {f.node for f in self._faults}
        healthy = [node for node in busy if node not in faulty]
        picks = plan.permutation(healthy if len(healthy) >= 5 else busy).tolist()

        def pick() -> int:
            return int(picks.pop()) if picks else int(plan.choice(busy))

        # Agent restart: down 5-20 s (nothing sent), then counters start from zero.
        node = pick()
        start = self.start_ts + float(plan.uniform(0.2, 0.8)) * dur
        length = float(plan.uniform(5, 20))
        self._gaps.append((node, start, start + length, True))
        self._restarts.append((node, start + length))
        self._add_confounder("agent_restart", start, start + length, node=node)
        # Telemetry gap: no GPU / NIC samples for one to two minutes (collector stall).
        node = pick()
        start = self.start_ts + float(plan.uniform(0.2, 0.8)) * dur
        length = float(plan.uniform(60, 120))
        self._gaps.append((node, start, start + length, False))
        self._add_confounder("telemetry_gap", start, start + length, node=node)
        # Clock skew: one or two hosts off by 5-15 ms for the whole run.
        for _ in range(1 if n < 16 else 2):
            node = pick()
            skew = float(plan.uniform(0.005, cfg.clock_skew_max_s)) * float(plan.choice([-1, 1]))
            self._skew[node] = skew
            self._add_confounder(
                "clock_skew", self.start_ts, self.end_ts, node=node, skew_s=round(skew, 4)
            )
        # Out-of-order: one node's messages reach us up to 2 s late for a few minutes.
        node = pick()
        start = self.start_ts + float(plan.uniform(0.1, 0.8)) * dur
        length = float(plan.uniform(60, 240))
        self._ooo.append((node, start, start + length, 2.0))
        self._add_confounder("out_of_order", start, start + length, node=node, max_delay_s=2.0)
        # Checkpoints: every checkpoint_every_s, 20-40 s for the whole job.
        for job in self._jobs:
            job_ckpts = []
            t = self.start_ts + cfg.checkpoint_every_s
            while t < self.end_ts:
                job_ckpts.append((t, float(plan.uniform(20, 40))))
                t += cfg.checkpoint_every_s
            job.checkpoints = job_ckpts

    # --- per tick --------------------------------------------------------------------------

    def _gpu_state(self, t: float, dt: float) -> dict[str, np.ndarray]:
        """Physical state of every GPU during [t, t + dt): slowdown, clocks, temperatures."""
        cfg = self.config
        n, g = cfg.nodes, cfg.gpus_per_node
        busy = self._busy_mask()
        slow = np.zeros((n, g))
        clock_ratio = np.ones((n, g))
        reasons = np.where(busy, 0, REASON_IDLE).astype(np.int64)
        power_limit = np.full((n, g), POWER_LIMIT_W)
        power_factor = np.ones((n, g))
        temp_target = np.where(busy, 60.0, 32.0) + self._temp_offset
        temp_target[self._hot_nodes, :] += self._hot_extra
        link_slow = np.zeros((n, g))
        speed = np.full((n, g), LINK_GBPS)
        link_down = np.zeros((n, g), dtype=bool)
        xid = np.zeros((n, g), dtype=np.int64)
        err_rate = np.zeros((n, g))
        flapped = np.zeros((n, g), dtype=np.int64)
        dbe = np.zeros((n, g), dtype=np.int64)
        mid = t + dt / 2
        for f in self._faults:
            k, i, j = f.kind, f.node, f.gpu
            for ev in f.events:
                if t <= ev < t + dt:
                    if k == "link_flap":
                        flapped[i, j] += 1
                    else:
                        xid[i, j] = f.detail["xid"]
                        if k == "ecc_dbe":
                            dbe[i, j] += 1
                if k == "link_flap" and ev <= mid < ev + 2.5:
                    link_down[i, j] = True
            if not f.active(mid):
                continue
            on_busy = busy[i, j]
            if k == "thermal_throttle":
                on = True
                if f.pattern == "intermittent":
                    period = f.detail["on_s"] + f.detail["off_s"]
                    on = (mid - f.onset) % period < f.detail["on_s"]
                # Heats up over ~2 minutes; throttles once past the slowdown temperature.
                warm = min(1.0, (mid - f.onset) / 120.0)
                if on and on_busy:
                    temp_target[i, j] = max(
                        temp_target[i, j], f.detail["temp_c"] * (0.9 + 0.1 * warm)
                    )
                    if warm >= 1.0 or temp_target[i, j] >= THROTTLE_TEMP_C:
                        slow[i, j] = max(slow[i, j], f.slowdown)
                        reasons[i, j] |= REASON_SW_THERMAL | (
                            REASON_HW_THERMAL if f.slowdown > 0.15 else 0
                        )
                elif on_busy:
                    temp_target[i, j] = max(temp_target[i, j], THROTTLE_TEMP_C - 6)
            elif k == "power_cap":
                power_limit[i, j] = f.detail["power_limit_w"]
                if on_busy:
                    slow[i, j] = max(slow[i, j], f.slowdown)
                    reasons[i, j] |= REASON_SW_POWER_CAP
            elif k == "power_brake":
                if on_busy:
                    slow[i, j] = max(slow[i, j], f.slowdown)
                    reasons[i, j] |= REASON_HW_POWER_BRAKE | REASON_HW_SLOWDOWN
                    power_factor[i, j] = 0.55
            elif k == "slow_gpu":
                ramp = f.detail.get("ramp_s")
                level = f.slowdown if not ramp else f.slowdown * min(1.0, (mid - f.onset) / ramp)
                slow[i, j] = max(slow[i, j], level)  # silent: nothing else changes
            elif k == "degraded_nic":
                link_slow[i, j] = max(link_slow[i, j], f.slowdown)
                err_rate[i, j] = f.detail["symbol_errors_per_s"]
            elif k == "nic_reduced_speed":
                speed[i, j] = f.detail["speed_gbps"]
                link_slow[i, j] = max(link_slow[i, j], f.slowdown)
        # Clock faults slow compute through the clock; a silent slow GPU keeps its clock.
        clocked = (reasons & ~REASON_IDLE) != 0
        clock_ratio = np.where(clocked, 1.0 / (1.0 + slow / CLOCK_BOUND), 1.0)
        # Healthy busy GPUs touch their power limit now and then: 0x4 for a sample, -2..4 %.
        touch = busy & ~clocked & (self._noise.random((n, g)) < 0.03)
        clock_ratio = np.where(touch, 1.0 - self._noise.uniform(0.02, 0.04, (n, g)), clock_ratio)
        reasons = np.where(touch, reasons | REASON_SW_POWER_CAP, reasons)
        # Temperatures follow their targets with a ~30 s time constant.
        alpha = min(1.0, dt / 30.0)
        self._temp += alpha * (temp_target - self._temp)
        return {
            "busy": busy,
            "slow": slow,
            "clock_ratio": clock_ratio,
            "reasons": reasons,
            "power_limit": power_limit,
            "power_factor": power_factor,
            "link_slow": link_slow,
            "speed": speed,
            "link_down": link_down,
            "xid": xid,
            "err_rate": err_rate,
            "flapped": flapped,
            "dbe": dbe,
        }

    def _comm_factor(self, t: float) -> float:
        factor = 1.0
        for start, end, f in self._congestion:
            if start <= t < end:
                factor = max(factor, f)
        return factor

    def _samples(
        self, t: float, dt: float, s: dict[str, np.ndarray], out: list[tuple[float, Any]] | None
    ) -> None:
        cfg = self.config
        n, g = cfg.nodes, cfg.gpus_per_node
        noise = self._noise
        busy = s["busy"]
        clock_ratio = s["clock_ratio"]
        # --- GPU ---
        temp = self._temp + 0.4 * noise.standard_normal((n, g))
        sm = np.where(busy, SM_CLOCK_MAX_MHZ * clock_ratio, SM_CLOCK_IDLE_MHZ)
        sm = np.round(sm / 15.0) * 15.0  # NVML reports clocks in 15 MHz steps on H100
        base_power = np.where(
            busy, 0.86 * POWER_LIMIT_W * self._power_offset, 72.0 + 4 * self._power_offset
        )
        power = base_power * (clock_ratio**1.5) * s["power_factor"] + 6.0 * noise.standard_normal(
            (n, g)
        )
        power = np.minimum(power, s["power_limit"] - 1.0 * noise.random((n, g)))
        power = np.maximum(power, 50.0)
        util = np.where(busy, np.minimum(100.0, 97.0 + 3.0 * noise.random((n, g))), 0.0)
        mem_util = np.where(busy, 38.0 + 6.0 * noise.random((n, g)), 0.0)
        self._ecc_sbe += (noise.random((n, g)) < 0.0002) + s["dbe"] * 3
        self._ecc_dbe += s["dbe"]
        self._pcie += noise.random((n, g)) < 0.0005
        # --- NIC ---
        comm = self._comm_factor(t)
        c = self._counters
        traffic = np.where(busy, 2.5e9, 2.0e6) * dt / (1.0 + s["link_slow"])  # 4-byte words
        traffic = traffic * (0.9 + 0.2 * noise.random((n, g))) / comm
        words = traffic.astype(np.int64)
        c[:, :, _C["port_xmit_data"]] += words
        c[:, :, _C["port_rcv_data"]] += words
        congested = comm > 1.0
        wait_rate = np.where(busy, 2e3, 5.0) * (40.0 if congested else 1.0)
        ecn_rate = np.where(busy, 3.0, 0.0) * (200.0 if congested else 1.0)
        c[:, :, _C["port_xmit_wait"]] += noise.poisson(wait_rate * dt)
        c[:, :, _C["np_ecn_marked_roce_packets"]] += noise.poisson(ecn_rate * dt)
        c[:, :, _C["rp_cnp_handled"]] += noise.poisson(ecn_rate * dt * 0.8)
        err = s["err_rate"]
        if err.any():
            c[:, :, _C["symbol_error"]] += noise.poisson(err * dt)
            c[:, :, _C["port_rcv_errors"]] += noise.poisson(err * dt * 0.2)
            c[:, :, _C["out_of_sequence"]] += noise.poisson(err * dt * 0.5)
            c[:, :, _C["packet_seq_err"]] += noise.poisson(err * dt * 0.2)
            c[:, :, _C["local_ack_timeout_err"]] += noise.poisson(err * dt * 0.05)
            c[:, :, _C["link_error_recovery"]] += noise.poisson(err * dt * 0.002)
        c[:, :, _C["symbol_error"]] += noise.random((n, g)) < 1e-5  # healthy links: rare BER hits
        flapped = s["flapped"]
        if flapped.any():
            c[:, :, _C["link_downed"]] += flapped
            c[:, :, _C["link_error_recovery"]] += flapped
        for node, reset_ts in self._restarts:
            if t <= reset_ts < t + dt:
                c[node, :, :] = 0
                self._pcie[node, :] = 0
        if out is None:
            return
        # --- messages ---
        rows = zip(
            np.round(temp, 0).tolist(),
            np.round(power, 1).tolist(),
            s["power_limit"].tolist(),
            sm.tolist(),
            np.round(util, 0).tolist(),
            np.round(mem_util, 0).tolist(),
            s["reasons"].tolist(),
            self._ecc_sbe.tolist(),
            self._ecc_dbe.tolist(),
            self._pcie.tolist(),
            s["xid"].tolist(),
            s["speed"].tolist(),
            (~s["link_down"]).tolist(),
            c.tolist(),
            strict=True,
        )
        job_of = self._job_of_node()
        gaps = {node for node, start, end, _ in self._gaps if start <= t + dt and end > t}
        ooo = {node for node, start, end, _ in self._ooo if start <= t + dt and end > t}
        gpus = range(g)
        for i, row in enumerate(rows):
            temp_r, power_r, limit_r, sm_r, util_r, mem_r, reasons_r = row[:7]
            sbe_r, dbe_r, pcie_r, xid_r, speed_r, up_r, counters_r = row[7:]
            ts_node = t + self._phase_l[i] * dt
            if i in gaps and self._suppressed(i, ts_node, samples=True):
                continue
            ts = ts_node + self._skew_l[i]
            key = ts + self._delay(i, ts_node) if i in ooo else ts
            gpu_templates, nic_templates = self._sample_templates(i, job_of.get(i))
            reuse = self._reuse_samples and i not in ooo  # late ones must not be overwritten
            if reuse:
                gpu_objects, nic_objects = self._sample_objects(i, gpu_templates, nic_templates)
            for j in gpus:
                if reuse:
                    message = gpu_objects[j]
                    d = message.__dict__
                    d["xid"] = None
                else:
                    d = gpu_templates[j].copy()
                    message = _gpu_model(d)
                d["ts"] = ts
                d["temp_c"] = temp_r[j]
                d["power_w"] = power_r[j]
                d["power_limit_w"] = limit_r[j]
                d["sm_clock_mhz"] = sm_r[j]
                d["util_pct"] = util_r[j]
                d["mem_util_pct"] = mem_r[j]
                d["clock_event_reasons"] = reasons_r[j]
                d["ecc_sbe_total"] = sbe_r[j]
                d["ecc_dbe_total"] = dbe_r[j]
                d["pcie_replay_total"] = pcie_r[j]
                if xid_r[j]:
                    d["xid"] = xid_r[j]
                out.append((key, message))
            for j in gpus:
                if reuse:
                    message = nic_objects[j]
                    d = message.__dict__
                    d["counters"].update(zip(NIC_COUNTERS, counters_r[j], strict=True))
                else:
                    d = nic_templates[j].copy()
                    message = _nic_model(d)
                    d["counters"] = dict(zip(NIC_COUNTERS, counters_r[j], strict=True))
                d["ts"] = ts
                d["link_up"] = up_r[j]
                d["speed_gbps"] = speed_r[j]
                out.append((key, message))

    def _sample_objects(
        self, node: int, gpu_templates: list[dict[str, Any]], nic_templates: list[dict[str, Any]]
    ) -> tuple[list[Any], list[Any]]:
        """Writer mode: one GPU and one NIC message object per device, refilled every tick
        (the writer encodes a tick before the next is built, so nothing sees the change)."""
        cached = self._objects.get(node)
        if cached is not None and cached[0] is gpu_templates:
            return cached[1], cached[2]
        gpu = [_gpu_model(t.copy()) for t in gpu_templates]
        nic = [_nic_model({**t, "counters": {}}) for t in nic_templates]
        self._objects[node] = (gpu_templates, gpu, nic)
        return gpu, nic

    def _sample_templates(
        self, node: int, job: str | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The fields of a node's GPU and NIC samples that do not change every second."""
        cached = self._templates.get(node)
        if cached is not None and cached[0] == job:
            return cached[1], cached[2]
        name = self.node_names[node]
        gpu = [
            {
                "kind": "gpu",
                "v": 1,
                "ts": 0.0,
                "node": name,
                "job": job,
                "gpu": j,
                "uuid": self._uuids[node][j],
                "temp_c": None,
                "power_w": None,
                "power_limit_w": None,
                "sm_clock_mhz": None,
                "sm_clock_max_mhz": SM_CLOCK_MAX_MHZ,
                "mem_clock_mhz": MEM_CLOCK_MHZ,
                "util_pct": None,
                "mem_util_pct": None,
                "clock_event_reasons": None,
                "ecc_sbe_total": None,
                "ecc_dbe_total": None,
                "xid": None,
                "pcie_replay_total": None,
            }
            for j in range(self.config.gpus_per_node)
        ]
        nic = [
            {
                "kind": "nic",
                "v": 1,
                "ts": 0.0,
                "node": name,
                "job": job,
                "device": _DEVICES[j],
                "port": 1,
                "netdev": _NETDEVS[j],
                "link_up": None,
                "speed_gbps": None,
                "counters": None,
            }
            for j in range(self.config.gpus_per_node)
        ]
        self._templates[node] = (job, gpu, nic)
        return gpu, nic

    def _job_of_node(self) -> dict[int, str]:
        self._busy_mask()
        return self._job_of

    def _suppressed(self, node: int, ts: float, samples: bool) -> bool:
        for gap_node, start, end, everything in self._gaps:
            if gap_node == node and start <= ts < end and (samples or everything):
                return True
        return False

    def _delay(self, node: int, ts: float) -> float:
        for ooo_node, start, end, max_delay in self._ooo:
            if ooo_node == node and start <= ts < end:
                # Deterministic in (node, ts): does not consume the shared noise stream.
                return max_delay * ((ts * 7919.0) % 1.0)
        return 0.0

    # --- steps -----------------------------------------------------------------------------

    def _apply_remediation(self, job: _Job) -> bool:
        with self._lock:
            pending = [p for p in self._pending_remediation]
        changed = False
        for name in pending:
            node = self.node_names.index(name)
            ranks = (job.rank_node == node) & job.active
            if not ranks.any():
                continue
            with self._lock:
                self._pending_remediation.remove(name)
            busy = {int(x) for j in self._jobs for x in j.rank_node[j.active]}
            spare = next((s for s in self._spares if s not in busy and s != node), None)
            if spare is not None:
                self._spares.remove(spare)
                job.rank_node[ranks] = spare
            else:
                job.active[ranks] = False
            self._remediations.append(
                {
                    "node": name,
                    "job": job.name,
                    "ts": round(job.next_start, 3),
                    "replaced_by": None if spare is None else self.node_names[spare],
                    "restart_s": self.config.restart_s,
                }
            )
            changed = True
            job.layout_version += 1
            self._busy = None
        return changed

    def _run_steps(
        self, job: _Job, tick_end: float, s: dict[str, np.ndarray], out: list[tuple[float, Any]]
    ) -> None:
        while job.next_start < tick_end and job.next_start < self.end_ts:
            if self._pending_remediation and self._apply_remediation(job):
                job.next_start += self.config.restart_s  # restart from the last checkpoint
                job.seq = 0  # new communicators count from zero
                continue
            end = self._one_step(job, s, out)
            job.next_start = end + 0.002

    def _one_step(self, job: _Job, s: dict[str, np.ndarray], out: list[tuple[float, Any]]) -> float:
        cfg = self.config
        rng = self._step_noise
        start = job.next_start
        ranks = len(job.rank_node)
        nodes, gpus, stages = job.rank_node, job.rank_gpu, job.rank_stage
        compute_nominal = 0.72 * job.step_s_nominal
        conn_nominal = 0.25 * job.step_s_nominal
        stage_factor = np.array(job.stage_factor)[stages]
        compute = (
            compute_nominal
            * stage_factor
            * self._gpu_speed[nodes, gpus]
            * (1.0 + s["slow"][nodes, gpus])
            * np.exp(0.004 * rng.standard_normal(ranks))
        )
        # One-step hiccups on random ranks (GC pause, page fault storm, host jitter).
        hiccup = rng.random(ranks) < 0.0003
        extras = rng.uniform(0.15, 0.6, ranks)
        if hiccup.any():
            for r in np.flatnonzero(hiccup & job.active).tolist():
                compute[r] *= 1.0 + extras[r]
                self._add_confounder(
                    "hiccup",
                    start,
                    start + float(compute[r]),
                    node=int(nodes[r]),
                    job=job.name,
                    rank=int(r),
                    step=job.step,
                    extra=round(float(extras[r]), 3),
                )
        stall_noise = np.exp(0.1 * rng.standard_normal(ranks))
        for st, en, extra in self._stalls:
            if st <= start < en:
                compute += compute_nominal * extra * stall_noise
        arrive = start + compute
        comm = self._comm_factor(start)
        hang = 0.0
        flapped_nodes: set[tuple[int, int]] = set()
        # A flap while this step runs hangs its all-reduce (each flap hits exactly one step).
        window = (max(start, job.flap_cursor), float(arrive.max()) + 2 * conn_nominal)
        job.flap_cursor = window[1]
        for f in self._faults:
            if f.kind == "link_flap":
                for ev in f.events:
                    if window[0] <= ev < window[1] and (
                        (job.rank_node[job.active] == f.node).any()
                    ):
                        hang = max(hang, f.detail["hang_s"])
                        flapped_nodes.add((f.node, f.gpu))
        link_slow = s["link_slow"]
        conn_noise = np.exp(0.01 * rng.standard_normal(ranks))
        # Per-stage rail rings: rank r's next peer is the same GPU on the next node.
        stage_end = np.zeros(job.pp_stages)
        next_peer = np.full(ranks, -1, dtype=np.int64)
        prev_peer = np.full(ranks, -1, dtype=np.int64)
        conn = np.zeros(ranks)  # duration of the connection r -> next_peer[r]
        for st in range(job.pp_stages):
            members = np.flatnonzero((stages == st) & job.active)
            if members.size == 0:
                continue
            last = float(arrive[members].max())
            g = cfg.gpus_per_node
            for rail in range(g):
                ring = members[gpus[members] == rail]
                if ring.size > 1:
                    nxt = np.roll(ring, -1)
                    next_peer[ring] = nxt
                    prev_peer[nxt] = ring
                    slow_link = np.maximum(
                        link_slow[nodes[ring], rail], link_slow[nodes[nxt], rail]
                    )
                    conn[ring] = conn_nominal * (1.0 + slow_link) * comm * conn_noise[ring]
                    for node, flap_gpu in flapped_nodes:
                        if flap_gpu == rail:
                            hit = (nodes[ring] == node) | (nodes[nxt] == node)
                            conn[ring[hit]] += hang
            duration = (
                float(conn[members].max())
                if (next_peer[members] >= 0).any()
                else conn_nominal * 0.3
            )
            stage_end[st] = last + duration
        end = float(stage_end.max())
        step_s = end - start
        # Checkpoint after this step: everyone waits for the save.
        if job.checkpoints and job.checkpoints[0][0] <= end:
            ck_s = job.checkpoints.pop(0)[1]
            self._add_confounder("checkpoint", end, end + ck_s, job=job.name, step=job.step)
            end += ck_s
            step_s += ck_s
        job.step_log.append((end, step_s))
        if self._build_steps:
            self._step_messages(
                job, step_s, end, arrive, compute, conn, stage_end, next_peer, prev_peer, out
            )
        job.step += 1
        job.seq += 1
        return end

    def _step_messages(
        self,
        job: _Job,
        step_s: float,
        end: float,
        arrive: np.ndarray,
        compute: np.ndarray,
        conn: np.ndarray,
        stage_end: np.ndarray,
        next_peer: np.ndarray,
        prev_peer: np.ndarray,
        out: list[tuple[float, Any]],
    ) -> None:
        peer_bytes = _GRADIENT_BYTES // max(1, self.config.gpus_per_node)
        conn_l = conn.tolist()
        stage_end_l = stage_end.tolist()
        gaps = {
            node
            for node, start, stop, everything in self._gaps
            if everything and start <= end < stop
        }
        ooo = {
            node: self._delay(node, end)
            for node, start, stop, _ in self._ooo
            if start <= end < stop
        }
        skews = self._skew_l
        step, seq = job.step, job.seq
        step_templates, coll_templates = self._rank_templates(job)
        rows = zip(
            job.rank_node.tolist(),
            job.rank_stage.tolist(),
            job.active.tolist(),
            arrive.tolist(),
            compute.tolist(),
            next_peer.tolist(),
            prev_peer.tolist(),
            strict=True,
        )
        for r, (node, stage, active, arrive_r, compute_r, nxt, prv) in enumerate(rows):
            if not active or node in gaps:
                continue
            skew = skews[node]
            delay = ooo.get(node, 0.0)
            rank_end = end + skew + 0.0005 * (r % 7)
            coll_end = stage_end_l[stage] + skew
            c = coll_templates[r].copy()
            c["ts"] = coll_end
            c["seq"] = seq
            c["arrive_ts"] = arrive_r + skew
            c["end_ts"] = coll_end
            c["peers"] = (
                [
                    _conn_model({"rank": nxt, "bytes": peer_bytes, "duration_s": conn_l[r]}),
                    _conn_model({"rank": prv, "bytes": peer_bytes, "duration_s": conn_l[prv]}),
                ]
                if nxt >= 0
                else []
            )
            out.append((coll_end + delay, _coll_model(c)))
            d = step_templates[r].copy()
            d["ts"] = rank_end
            d["step"] = step
            d["step_s"] = step_s
            d["compute_s"] = compute_r
            out.append((rank_end + delay, _step_model(d)))

    def _rank_templates(self, job: _Job) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The fields of each rank's step and collective messages that stay the same."""
        cached = self._rank_cache.get(job.name)
        if cached is not None and cached[0] == job.layout_version:
            return cached[1], cached[2]
        pipelined = job.pp_stages > 1
        steps, colls = [], []
        rows = zip(
            job.rank_node.tolist(),
            job.rank_gpu.tolist(),
            job.rank_stage.tolist(),
            job.rank_dp.tolist(),
            strict=True,
        )
        for r, (node, gpu, stage, dp) in enumerate(rows):
            name = self.node_names[node]
            steps.append(
                {
                    "kind": "step",
                    "v": 1,
                    "ts": 0.0,
                    "node": name,
                    "job": job.name,
                    "rank": r,
                    "gpu": gpu,
                    "step": 0,
                    "step_s": 0.0,
                    "compute_s": None,
                    "pp_stage": stage if pipelined else None,
                    "dp_rank": dp,
                    "tokens": 8192,
                }
            )
            colls.append(
                {
                    "kind": "collective",
                    "v": 1,
                    "ts": 0.0,
                    "node": name,
                    "job": job.name,
                    "rank": r,
                    # A restart builds new communicators (NCCL ids are per launch).
                    "comm": (f"{job.name}/dp{stage}" if pipelined else f"{job.name}/dp")
                    + (f".g{job.layout_version}" if job.layout_version else ""),
                    "op": "allreduce",
                    "seq": 0,
                    "bytes": _GRADIENT_BYTES,
                    "arrive_ts": 0.0,
                    "end_ts": None,
                    "peers": None,
                }
            )
        self._rank_cache[job.name] = (job.layout_version, steps, colls)
        return steps, colls


_first = operator.itemgetter(0)


def _write_part(
    config: SimConfig, path: str, emit_from: float, emit_until: float
) -> tuple[dict[str, int], dict[str, Any]]:
    sim = ClusterSimulator(config)
    sim._reuse_samples = True
    counts: Counter[str] = Counter()
    # The messages hold no reference cycles; the cyclic collector would only rescan
    # millions of short-lived objects (it doubles the run time).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with open(path, "wb", buffering=1 << 20) as out:
            write = out.write
            for batch in sim.batches(emit_from, emit_until):
                write(_encode_lines(batch))
                write(b"\n")
                counts.update(map(_kind_of, batch))
    finally:
        if was_enabled:
            gc.enable()
    return dict(counts), sim.truth()


_kind_of = operator.attrgetter("kind")
_MESSAGE_LIST: TypeAdapter[list[Any]] = TypeAdapter(list[Any])


def _encode_lines(batch: list[Any]) -> bytes:
    """``b"\\n".join(encode(m) for m in batch)``, ~20 % faster: pydantic serialises the whole
    list (each model with its own serializer) and the array's ``},{"kind":"`` separators
    become newlines (the only place that sequence occurs: no generated string contains
    it). Checked by the line count, else done one by one."""
    lines = _MESSAGE_LIST.dump_json(batch, exclude_none=True)[1:-1].replace(
        b'},{"kind":"', b'}\n{"kind":"'
    )
    if lines.count(b"\n") != len(batch) - 1:
        lines = b"\n".join([encode(message) for message in batch])
    return lines


def _append_file(src: Any, out: Any) -> None:
    """Append ``src`` to ``out``, in the kernel where it can (no copy through Python)."""
    out.flush()
    size = os.fstat(src.fileno()).st_size
    done = 0
    try:
        while done < size:
            copied = os.copy_file_range(src.fileno(), out.fileno(), size - done, done)
            if copied == 0:
                break
            done += copied
    except (AttributeError, OSError):
        pass  # no copy_file_range here: copy the rest the portable way
    if done < size:
        src.seek(done)
        out.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, out, 1 << 22)


def write_jsonl(
    config: SimConfig, out_path: str | Path, workers: int | None = None
) -> tuple[dict[str, Any], dict[str, int]]:
    """Simulate ``config`` into a JSONL file; returns ``(truth, message counts by kind)``.

    With ``workers`` > 1 the run is split by time: every worker simulates the whole run
    (cheap: arrays), but builds and writes only the messages of its share of the ticks; the
    parts are concatenated in order, so the file is byte-for-byte the single-process one.
    """
    out_path = Path(out_path)
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    workers = max(1, min(workers, int(config.duration_s // max(config.sample_interval_s, 1)) or 1))
    sim = ClusterSimulator(config)  # validates the config before forking
    dt = float(config.sample_interval_s)
    ticks = math.ceil(config.duration_s / dt - 1e-9)
    bounds = [sim.start_ts + dt * round(ticks * k / workers) for k in range(workers + 1)]
    bounds[-1] = sim.end_ts + 1.0
    if workers == 1:
        only_counts, truth = _write_part(config, str(out_path), bounds[0], bounds[1])
        return truth, only_counts
    parts = [str(out_path)] + [f"{out_path}.part{k}" for k in range(1, workers)]
    context = multiprocessing.get_context("fork")
    with context.Pool(workers) as pool:
        results = pool.starmap(
            _write_part,
            [(config, parts[k], bounds[k], bounds[k + 1]) for k in range(workers)],
        )
    with open(out_path, "r+b") as out:  # not "ab": copy_file_range refuses O_APPEND
        out.seek(0, os.SEEK_END)
        for part in parts[1:]:
            with open(part, "rb") as src:
                _append_file(src, out)
            os.unlink(part)
    counts: dict[str, int] = {}
    for part_counts, _ in results:
        for kind, count in part_counts.items():
            counts[kind] = counts.get(kind, 0) + count
    return results[-1][1], counts

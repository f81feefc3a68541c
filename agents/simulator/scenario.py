"""Planning a run: job placement, rank assignment, faults and confounders; the run's truth.

Every draw comes from the planning stream (``plan``) in a fixed order, so the same config
and seed plan the same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.agents.calibration import FAULT_MIX
from guard.schemas.nvml_codes import NONFATAL_XIDS
from guard.schemas.truth import Truth

from .config import (
    CATEGORY_BY_KIND,
    HOT_IDLE_EXTRA_C,
    HOT_IDLE_EXTRA_W,
    LINK_GBPS,
    POWER_LIMIT_W,
    FaultSpec,
    JobSpec,
    SimConfig,
)
from .fabric import FabricModel

__all__ = ["InjectedFault", "RunningJob", "Scenario"]

NIC_FAULT_KINDS = ("degraded_nic", "nic_reduced_speed", "link_flap")
#: Faults of a whole node, not of one GPU or NIC (``gpu`` and ``device`` None in the truth).
NODE_FAULT_KINDS = ("host_slow",)
#: Share of random faults placed in a pipeline-parallel job's heaviest stage.
HEAVY_STAGE_SHARE = 0.35


@dataclass
class InjectedFault:
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
class RunningJob:
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
    # Job churn (SimConfig.job_lifetime_s): whether a job runs on the nodes now, when it ends,
    # every name the nodes' jobs have had, and the step a new job's warm-up began.
    running: bool = True
    ends_at: float = float("inf")
    names: list[str] = field(default_factory=list)
    warm_start: float | None = None


class Scenario:
    """The plan of a run: where the jobs run, the faults and the confounders, and their
    schedules (data stalls, congestion, a hot rack, gaps, restarts, late arrival, clock skew)
    that the hardware and training models read. Remediation changes the jobs' layout
    (:meth:`layout_changed`); hiccups and checkpoints add confounders as the run goes."""

    def __init__(
        self,
        config: SimConfig,
        plan: np.random.Generator,
        skew: np.ndarray,
        fabric_rng: np.random.Generator | None = None,
    ) -> None:
        self.config = config
        #: the fabric's own stream (placement, degraded uplinks), never the planning one
        self._fabric_rng = fabric_rng or np.random.default_rng([config.seed, 7])
        self.node_names = config.node_names()
        self.start_ts = float(config.start_ts)
        self.end_ts = self.start_ts + float(config.duration_s)
        self.confounders: list[dict[str, Any]] = []
        self.skew = skew  # per-node clock offset; the clock_skew confounder sets some
        #: hot idle nodes (plan_hot_idle): extra deg C and W of each node's GPUs while idle
        self.hot_idle_c = np.zeros(config.nodes)
        self.hot_idle_w = np.zeros(config.nodes)
        self._busy: np.ndarray | None = None
        self._job_of: dict[int, str] = {}
        self.jobs = self._place_jobs(plan)
        self.faults = self._plan_faults(plan)
        self._plan_confounders(plan)
        self.skew_list: list[float] = self.skew.tolist()
        #: per-host clock offset (SimConfig.clock_offset_s) on top of ``skew``: it shifts
        #: the timestamps a host writes but not when its messages arrive
        self.offset_list: list[float] = [0.0] * config.nodes
        self.fabric: FabricModel | None = None
        if config.fabric is not None:
            self.fabric = FabricModel(
                config.fabric,
                self.node_names,
                config.gpus_per_node,
                self._fabric_rng,
                self.start_ts,
            )
            for c in self.fabric.confounders(self.end_ts):
                self.add_confounder(**c)

    def plan_hot_idle(self, rng: np.random.Generator) -> None:
        """``SimConfig.hot_idle_nodes`` of the nodes idle at the start run hot while idle,
        drawn from ``rng`` (their own stream, so a run without them draws what it did)."""
        cfg = self.config
        want = cfg.hot_idle_nodes
        if want > len(self.initial_idle):
            raise ValueError(
                f"hot_idle_nodes={want} but only {len(self.initial_idle)} nodes are idle at "
                "the start; use more nodes, smaller jobs or fewer hot idle nodes"
            )
        picks = sorted(int(i) for i in rng.choice(self.initial_idle, size=want, replace=False))
        for node in picks:
            extra_c = float(rng.uniform(*HOT_IDLE_EXTRA_C))
            extra_w = float(rng.uniform(*HOT_IDLE_EXTRA_W))
            self.hot_idle_c[node] = extra_c
            self.hot_idle_w[node] = extra_w
            self.add_confounder(
                "hot_idle",
                self.start_ts,
                self.end_ts,
                node=node,
                extra_c=round(extra_c, 1),
                extra_w=round(extra_w, 1),
                while_idle=True,
            )

    def set_clock_offsets(self, offsets: np.ndarray) -> None:
        """Every host's clock offset, seconds (``SimConfig.clock_offset_s``)."""
        self.offset_list = [float(x) for x in offsets]

    def clock_offsets(self) -> dict[str, float]:
        """Each host's whole clock error as its timestamps carry it: the drawn offset plus
        the baseline skew (and a ``clock_skew`` confounder's, where one is)."""
        return {
            name: round(skew + offset, 6)
            for name, skew, offset in zip(
                self.node_names, self.skew_list, self.offset_list, strict=True
            )
        }

    def layout_changed(self) -> None:
        """A job's ranks moved: the busy mask is computed again when next asked for."""
        self._busy = None

    def busy_mask(self) -> np.ndarray:
        if self._busy is None:
            busy = np.zeros((self.config.nodes, self.config.gpus_per_node), dtype=bool)
            for job in self.jobs:
                if job.running:
                    busy[job.rank_node[job.active], :] = True
            self._busy = busy
            self._job_of = {
                int(node): job.name
                for job in self.jobs
                if job.running
                for node in np.unique(job.rank_node[job.active]).tolist()
            }
        return self._busy

    def _place_jobs(self, plan: np.random.Generator) -> list[RunningJob]:
        cfg = self.config
        available = [i for i, name in enumerate(self.node_names) if name not in cfg.excluded]
        if cfg.jobs is not None:
            specs = cfg.jobs
        else:
            idle = round(len(available) * cfg.idle_fraction) if len(available) >= 4 else 0
            idle = max(idle, 1) if len(available) >= 4 else idle
            busy = len(available) - idle
            if busy >= 8:
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
        shuffled = cfg.fabric is not None and cfg.fabric.placement == "random"
        if shuffled:  # the fabric's own stream: the planning stream draws what it always did
            available = [available[i] for i in self._fabric_rng.permutation(len(available))]
        for spec in specs:
            if spec.nodes < 1:
                continue
            if spec.pp_stages < 1 or spec.nodes % spec.pp_stages:
                raise ValueError(f"job {spec.name}: nodes must be a multiple of pp_stages")
            nodes = available[cursor : cursor + spec.nodes]
            if shuffled:
                nodes = sorted(nodes)  # the ring in node order, as NCCL's follows the racks
            cursor += spec.nodes
            # The last pipeline stage also runs the loss and the output embedding.
            stage_factor = [1.0] * spec.pp_stages
            if spec.pp_stages > 1:
                stage_factor[-1] = 1.0 + float(plan.uniform(0.06, 0.12))
            job = RunningJob(spec.name, nodes, spec.pp_stages, spec.step_s_nominal, stage_factor)
            self._assign_ranks(job)
            jobs.append(job)
        self.initial_idle = available[cursor:]
        self.spares = list(self.initial_idle)
        return jobs

    def _assign_ranks(self, job: RunningJob) -> None:
        g = self.config.gpus_per_node
        per_stage = len(job.nodes) // job.pp_stages
        ranks = len(job.nodes) * g
        job.rank_node = np.repeat(np.array(job.nodes, dtype=np.int64), g)
        job.rank_gpu = np.tile(np.arange(g, dtype=np.int64), len(job.nodes))
        node_pos = np.repeat(np.arange(len(job.nodes)), g)
        job.rank_stage = node_pos // per_stage
        job.rank_dp = (node_pos % per_stage) * g + job.rank_gpu
        job.active = np.ones(ranks, dtype=bool)

    def _plan_faults(self, plan: np.random.Generator) -> list[InjectedFault]:
        cfg = self.config
        busy_nodes = [n for job in self.jobs for n in job.nodes]
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
        heavy = set(self.heaviest_stage_nodes())
        faults: list[InjectedFault] = []
        for number, spec in enumerate(specs, 1):
            # A share of the faults lands in a pipeline's heaviest stage, where a straggler
            # hides behind the stage's own lateness at every cross-stage collective.
            pool = free
            if heavy and spec.node is None and plan.random() < HEAVY_STAGE_SHARE:
                pool = [n for n in free if n in heavy] or free
            faults.append(self._make_fault(plan, number, spec, pool))
            if pool is not free:
                free.remove(faults[-1].node)
        return faults

    def heaviest_stage_nodes(self) -> list[int]:
        """The nodes of each pipeline-parallel job's heaviest stage."""
        nodes: list[int] = []
        for job in self.jobs:
            if job.pp_stages > 1:
                stage = int(np.argmax(job.stage_factor))
                nodes += np.unique(job.rank_node[job.rank_stage == stage]).tolist()
        return nodes

    def _make_fault(
        self, plan: np.random.Generator, number: int, spec: FaultSpec, free: list[int]
    ) -> InjectedFault:
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
        slowdown, pattern, detail, events = self._fault_effect(plan, spec, onset, end)
        return InjectedFault(
            f"f-{number:04d}", spec.kind, node, gpu, onset, end, slowdown, pattern, detail, events
        )

    def _fault_effect(
        self, plan: np.random.Generator, spec: FaultSpec, onset: float, end: float | None
    ) -> tuple[float, str, dict[str, Any], list[float]]:
        """The kind's slowdown, pattern, detail and event times (flaps, Xids, DBEs)."""
        sev = self.config.severity
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
            slowdown, pattern = 0.0, "intermittent"
            events = self._event_times(plan, onset, end, 180, 900)
            detail = {"flaps": len(events), "hang_s": round(float(plan.uniform(5, 15)), 1)}
        elif kind == "host_slow":
            slowdown = draw(0.03, 0.08)
            detail = {"cause": str(plan.choice(["cpu_frequency", "pcie_root_complex", "memory"]))}
        elif kind in ("xid", "ecc_dbe"):
            slowdown, pattern = 0.0, "intermittent"
            events = self._event_times(plan, onset, end, 60, 600)
            detail = {"xid": int(plan.choice(NONFATAL_XIDS))} if kind == "xid" else {"xid": 48}
        else:  # pragma: no cover - guarded by _make_fault
            raise ValueError(kind)
        return slowdown, pattern, detail, events

    def _event_times(
        self, plan: np.random.Generator, onset: float, end: float | None, lo: float, hi: float
    ) -> list[float]:
        """Times of a recurring event from ``onset`` to the fault's (or the run's) end."""
        events = []
        t = onset
        limit = self.end_ts if end is None else end
        while t < limit:
            events.append(t)
            t += float(plan.uniform(lo, hi))
        return events

    def add_confounder(
        self,
        kind: str,
        start: float,
        end: float,
        node: int | None = None,
        job: str | None = None,
        **detail: Any,
    ) -> None:
        self.confounders.append(
            {
                "id": f"c-{len(self.confounders) + 1:04d}",
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
        self.stalls: list[tuple[float, float, float]] = []  # (start, end, extra fraction)
        self.congestion: list[tuple[float, float, float]] = []  # (start, end, comm factor)
        self.hot_nodes = np.zeros(n, dtype=bool)
        self.hot_extra = 0.0
        self.gaps: list[tuple[int, float, float, bool]] = []  # node, start, end, drop steps too
        self.restarts: list[tuple[int, float]] = []  # node, ts of counter reset
        self.ooo: list[tuple[int, float, float, float]] = []  # node, start, end, max delay
        for job in self.jobs:
            if job.pp_stages > 1:
                self.add_confounder(
                    "stage_imbalance",
                    self.start_ts,
                    self.end_ts,
                    job=job.name,
                    stage=job.pp_stages - 1,
                    extra=round(job.stage_factor[-1] - 1, 4),
                )
        if not cfg.confounders:
            return
        self._plan_shared_confounders(plan)
        busy = [node for job in self.jobs for node in job.nodes]
        if not busy:
            return
        self._plan_node_confounders(plan, busy)
        self._plan_checkpoints(plan)

    def _plan_shared_confounders(self, plan: np.random.Generator) -> None:
        """Data stalls, fabric congestion and a hot rack: confounders of many nodes at once."""
        cfg = self.config
        n = cfg.nodes
        dur = cfg.duration_s
        # Data stalls: shared storage slow for everyone, a few per hour.
        for _ in range(max(1, round(plan.poisson(3 * dur / 3600)))):
            start = self.start_ts + float(plan.uniform(0.05, 0.95)) * dur
            length = float(plan.uniform(10, 60))
            extra = float(plan.uniform(0.3, 1.0))
            self.stalls.append((start, start + length, extra))
            for job in self.jobs:
                self.add_confounder(
                    "data_stall", start, start + length, job=job.name, extra=round(extra, 3)
                )
        # Fabric-wide congestion: one or two episodes per hour.
        for _ in range(max(1, round(plan.poisson(1.5 * dur / 3600)))):
            start = self.start_ts + float(plan.uniform(0.05, 0.9)) * dur
            length = float(plan.uniform(60, 300))
            factor = 1.0 + float(plan.uniform(0.1, 0.3))
            self.congestion.append((start, start + length, factor))
            self.add_confounder(
                "fabric_congestion", start, start + length, comm_factor=round(factor, 3)
            )
        # A hot rack: hotter by 8-12 deg C but below the throttling temperature.
        racks = max(1, n // cfg.rack_size)
        if n >= 2:
            rack = int(plan.integers(racks))
            nodes = range(rack * cfg.rack_size, min(n, (rack + 1) * cfg.rack_size))
            self.hot_extra = float(plan.uniform(8, 12))
            for node in nodes:
                self.hot_nodes[node] = True
                self.add_confounder(
                    "hot_rack",
                    self.start_ts,
                    self.end_ts,
                    node=node,
                    rack=f"rack-{rack}",
                    extra_c=round(self.hot_extra, 1),
                )
        else:
            self.hot_extra = 0.0

    def _plan_node_confounders(self, plan: np.random.Generator, busy: list[int]) -> None:
        """An agent restart, a telemetry gap, clock skew and out-of-order arrival."""
        cfg = self.config
        n = cfg.nodes
        dur = cfg.duration_s
        # Confounders go to nodes without an injected fault where there are enough of them,
        # so that evaluation can tell a false flag from a late true one.
        faulty = {f.node for f in self.faults}
        healthy = [node for node in busy if node not in faulty]
        picks = plan.permutation(healthy if len(healthy) >= 5 else busy).tolist()

        def pick() -> int:
            return int(picks.pop()) if picks else int(plan.choice(busy))

        # Agent restart: down 5-20 s (nothing sent), then counters start from zero.
        node = pick()
        start = self.start_ts + float(plan.uniform(0.2, 0.8)) * dur
        length = float(plan.uniform(5, 20))
        self.gaps.append((node, start, start + length, True))
        self.restarts.append((node, start + length))
        self.add_confounder("agent_restart", start, start + length, node=node)
        # Telemetry gap: no GPU / NIC samples for one to two minutes (collector stall).
        node = pick()
        start = self.start_ts + float(plan.uniform(0.2, 0.8)) * dur
        length = float(plan.uniform(60, 120))
        self.gaps.append((node, start, start + length, False))
        self.add_confounder("telemetry_gap", start, start + length, node=node)
        # Clock skew: one or two hosts off by 5-15 ms for the whole run.
        for _ in range(1 if n < 16 else 2):
            node = pick()
            skew = float(plan.uniform(0.005, cfg.clock_skew_max_s)) * float(plan.choice([-1, 1]))
            self.skew[node] = skew
            self.add_confounder(
                "clock_skew", self.start_ts, self.end_ts, node=node, skew_s=round(skew, 4)
            )
        # Out-of-order: one node's messages reach us up to 2 s late for a few minutes.
        node = pick()
        start = self.start_ts + float(plan.uniform(0.1, 0.8)) * dur
        length = float(plan.uniform(60, 240))
        self.ooo.append((node, start, start + length, 2.0))
        self.add_confounder("out_of_order", start, start + length, node=node, max_delay_s=2.0)

    def _plan_checkpoints(self, plan: np.random.Generator) -> None:
        """Checkpoints: every checkpoint_every_s, 20-40 s for the whole job."""
        cfg = self.config
        for job in self.jobs:
            job_ckpts = []
            t = self.start_ts + cfg.checkpoint_every_s
            while t < self.end_ts:
                job_ckpts.append((t, float(plan.uniform(20, 40))))
                t += cfg.checkpoint_every_s
            job.checkpoints = job_ckpts

    def comm_factor(self, t: float) -> float:
        factor = 1.0
        for start, end, f in self.congestion:
            if start <= t < end:
                factor = max(factor, f)
        return factor

    def job_of_node(self) -> dict[int, str]:
        self.busy_mask()
        return self._job_of

    def suppressed(self, node: int, ts: float, samples: bool) -> bool:
        for gap_node, start, end, everything in self.gaps:
            if gap_node == node and start <= ts < end and (samples or everything):
                return True
        return False

    def delay(self, node: int, ts: float) -> float:
        for ooo_node, start, end, max_delay in self.ooo:
            if ooo_node == node and start <= ts < end:
                # Deterministic in (node, ts): does not consume the shared noise stream.
                return max_delay * ((ts * 7919.0) % 1.0)
        return 0.0

    def truth(self, remediations: list[dict[str, Any]]) -> Truth:
        """Ground truth in the format of ``docs/simulator-truth.md`` (plus ``remediations``)."""
        cfg = self.config
        faults = [
            {
                "id": f.id,
                "node": self.node_names[f.node],
                "gpu": None if f.kind in NIC_FAULT_KINDS or f.kind in NODE_FAULT_KINDS else f.gpu,
                "device": f"mlx5_{f.gpu}" if f.kind in NIC_FAULT_KINDS else None,
                "kind": f.kind,
                "category": CATEGORY_BY_KIND[f.kind],
                "onset": round(f.onset, 3),
                "end": None if f.end is None else round(f.end, 3),
                "slowdown": round(f.slowdown, 4),
                "pattern": f.pattern,
                "detail": f.detail,
            }
            for f in sorted(self.faults, key=lambda f: f.id)
        ]
        jobs = [
            {
                "job": name,
                "nodes": [self.node_names[i] for i in j.nodes],
                "ranks": len(j.nodes) * cfg.gpus_per_node,
                "pp_stages": j.pp_stages,
                "step_s_nominal": j.step_s_nominal,
            }
            for j in self.jobs
            for name in (j.names or [j.name])
        ]
        return Truth.model_validate(
            {
                "version": 1,
                "seed": cfg.seed,
                "start_ts": self.start_ts,
                "end_ts": self.end_ts,
                "nodes": list(self.node_names),
                "gpus_per_node": cfg.gpus_per_node,
                "jobs": jobs,
                "idle_nodes": [self.node_names[i] for i in self.initial_idle],
                "excluded_nodes": sorted(cfg.excluded),
                "faults": faults,
                "confounders": sorted(self.confounders, key=lambda c: (c["start"], c["id"])),
                "remediations": list(remediations),
                "clock_offsets": self.clock_offsets() if cfg.clock_offset_s > 0 else None,
            }
        )

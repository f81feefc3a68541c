"""What shapes a simulated run: the fault, job and run specs, and the physical constants."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .fabric import FabricSpec

__all__ = [
    "CATEGORY_BY_KIND",
    "CHURN_CONFOUNDER_KINDS",
    "CONFOUNDER_KINDS",
    "COUNTER_INDEX",
    "FLEET_CONFOUNDER_KINDS",
    "GPU_COMPUTE_KINDS",
    "NIC_COUNTERS",
    "FabricSpec",
    "FaultSpec",
    "JobSpec",
    "SimConfig",
    "chassis_temp_offsets",
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
    # A whole node slow on the host side (CPU frequency, PCIe root complex, memory): every
    # rank of the node computes slower, its GPUs' telemetry stays normal. Explicit only
    # (not in the calibrated mix), so random runs are what they were.
    "host_slow": "straggler",
}
#: Kinds that slow one GPU's compute by ``1 + slowdown`` on top of that GPU's own speed
#: (``SimConfig.gpu_speed_sigma``): through its clock, or silently (``slow_gpu``).
GPU_COMPUTE_KINDS = frozenset({"thermal_throttle", "power_cap", "power_brake", "slow_gpu"})
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
#: Confounders of job churn (``SimConfig.job_lifetime_s``): a job ended, a new one warms up.
CHURN_CONFOUNDER_KINDS = ("job_end", "warmup")
#: Confounders of a shared fleet that a default run has none of (``SimConfig.hot_idle_nodes``).
FLEET_CONFOUNDER_KINDS = ("hot_idle",)
#: A hot idle node (``hot_idle``): its idle GPUs this much hotter, deg C, and drawing this much
#: more power, W (blocked airflow or a neighbour's exhaust; a context left open keeps the
#: power up), still well below the 87 deg C slowdown threshold, and no reason bit but idle.
HOT_IDLE_EXTRA_C = (20.0, 35.0)
HOT_IDLE_EXTRA_W = (15.0, 45.0)
COUNTER_INDEX = {name: i for i, name in enumerate(NIC_COUNTERS)}

# H100 SXM-class nominal values.
POWER_LIMIT_W = 700.0
SM_CLOCK_MAX_MHZ = 1980.0
SM_CLOCK_IDLE_MHZ = 345.0
MEM_CLOCK_MHZ = 2619.0
THROTTLE_TEMP_C = 87.0  # what NVML reports as the slowdown threshold (temp_slowdown_c)
BUSY_TEMP_C = 58.0
IDLE_TEMP_C = 32.0
#: Hottest minus coolest GPU of one chassis, from its airflow positions (steady), deg C.
CHASSIS_SPREAD_C = (5.0, 15.0)
LINK_GBPS = 400.0
# Share of a step's compute that scales with the SM clock (the rest is memory-bound).
CLOCK_BOUND = 0.9


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
    # Host clock offsets: every host's clock is off by a constant drawn uniformly in
    # +-clock_offset_s (its own seeded stream), on every timestamp it writes; durations
    # measured on the host's own clock (compute_s, step_s) stay right. 0: off, as before.
    clock_offset_s: float = 0.0
    checkpoint_every_s: float = 900.0
    restart_s: float = 60.0
    # Fail-stop faults (training.py): whether an xid / ecc_dbe fault crashes its job (off: the
    # fault is seen in telemetry only); the NCCL watchdog (PyTorch's default process-group
    # timeout); a crash again this soon after a restart on the faulty node (assumed); when a
    # person drains a crash-looping node after its first crash (assumed).
    fail_stop: bool = False
    watchdog_s: float = 600.0
    recrash_s: float = 120.0
    human_drain_s: float = 7200.0
    excluded: frozenset[str] = frozenset()
    gpu_speed_sigma: float = 0.01
    rack_size: int = 8
    # Job churn (training.py): with job_lifetime_s > 0 each job ends after 0.5-1.5x that
    # (its GPUs cool to idle), its nodes sit idle job_gap_s, then a new job with a new name
    # starts on them from step 0, every rank slower by up to warmup_extra over its first
    # warmup_steps steps (compiling kernels, warming allocators). 0: jobs run the whole run.
    job_lifetime_s: float = 0.0
    job_gap_s: float = 120.0
    warmup_steps: int = 20
    warmup_extra: float = 0.5
    # Hot idle nodes: this many of the nodes idle at the start run hot while idle (their own
    # seeded stream; a ``hot_idle`` confounder each, not a fault). 0: none, as before.
    hot_idle_nodes: int = 0
    # A multi-path fabric (ECMP collisions, degraded uplinks; agents/simulator/fabric.py).
    # None: connections run at their NIC's speed, as before.
    fabric: FabricSpec | None = None

    def node_names(self) -> list[str]:
        return [f"node-{i:03d}" for i in range(self.nodes)]


def chassis_temp_offsets(plan: np.random.Generator, nodes: int, gpus: int) -> np.ndarray:
    """Each GPU's steady temperature offset: its airflow position in the chassis, plus a little.

    In an 8-GPU chassis the GPUs downstream in the airflow run hotter: the spread between the
    coolest and the hottest is 5-15 deg C, the same every hour. The profile is convex (the
    last positions heat up most), so the hottest GPU sits ~10 deg C above its siblings'
    median at full clocks without any fault. Which GPU index sits where varies by chassis.
    """
    position = np.linspace(0.0, 1.0, gpus) ** 2 if gpus > 1 else np.zeros(1)
    position = position - np.median(position)
    spread = plan.uniform(*CHASSIS_SPREAD_C, nodes)
    order = np.argsort(plan.random((nodes, gpus)), axis=1)
    return spread[:, None] * position[order] + 1.0 * plan.standard_normal((nodes, gpus))

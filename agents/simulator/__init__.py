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

Faults (``truth.faults``; kinds and categories as in ``docs/simulator-truth.md``):
``thermal_throttle`` (steady or intermittent), ``power_cap``, ``power_brake``, ``slow_gpu``
(silent: no telemetry signature; steady or ``degrading`` over tens of minutes),
``degraded_nic`` (symbol / receive errors, retransmits, slower connections),
``nic_reduced_speed`` (400 → 200 Gb/s), ``link_flap`` (``link_downed`` increments, the link
is down for a sample or two and the whole job hangs a few seconds), ``xid`` and ``ecc_dbe``; and,
explicit only, ``host_slow`` (a whole node's ranks slower, its GPUs' telemetry normal).
The mix is calibrated from the InfiniteHBD production fault trace (see
:mod:`guard.agents.calibration`); the rate is accelerated (``faults_per_node_hour``).

Confounders (``truth.confounders``), none of which is a node fault: checkpoint steps and
data stalls that slow the whole job, one-step hiccups on random ranks, pipeline-stage
imbalance (the last stage does more work, persistently), a hot rack that stays below the
throttling temperature, fabric-wide congestion (ECN / CNP / ``port_xmit_wait`` up
everywhere, connections slower, no errors), an agent restart (a gap, then NIC counters and
the PCIe replay counter start again from zero), a telemetry gap (no GPU / NIC samples for a
minute or two), small clock skew between hosts, and slightly out-of-order arrival of one
node's messages. Always there, as in real clusters: each chassis's GPUs spread by 5-15 deg C
with airflow position (steady, at full clocks), and a pipeline job's job-wide gradient-norm
all-reduce (``<job>/world``) where the heaviest stage arrives last every step; about a third
of the random faults land in that stage. Baseline noise also has healthy GPUs touch their
power limit now and then (``0x4`` for a sample) and a rare single symbol error on healthy
links.

Library use (what ``guard demo`` and the detection-quality benchmark do)::

    from guard.agents.simulator import ClusterSimulator, SimConfig, FaultSpec

    sim = ClusterSimulator(SimConfig(nodes=32, duration_s=600, seed=7))
    for message in sim.messages():      # GuardMessage models, in event-time order
        ...                             # (except the skew / out-of-order confounders)
        if want_to_remediate:
            sim.remediate("node-012")   # thread-safe; applied at the job's next step
    truth = sim.truth()                 # a Truth model (docs/simulator-truth.md)
    sim.step_times("job-a")             # [(ts, step_s), ...] to compare runs

``sim.batches()`` yields the same messages one sampling tick at a time (a list per
simulated second), which is cheaper to pace for live replay (``guard agent --simulate``).
``write_jsonl(config, path, workers=None)`` writes a run to JSONL and returns ``(truth,
counts)``; with several workers it forks, so call it from a single-threaded process (or
pass ``workers=1``). Messages are built without validation (valid by construction; the
tests validate the output through ``guard.schemas``); treat them as read-only.

The truth (:class:`guard.schemas.truth.Truth`) follows ``docs/simulator-truth.md`` and
adds three fields: ``idle_nodes`` (nodes without a job at the start), ``excluded_nodes``
(``SimConfig.excluded``) and ``remediations`` (``[{node, job, ts, replaced_by, restart_s}]``).

``remediate(node)`` models what Guard's orchestrator does: the node is cordoned, the job
restarts from its last checkpoint (``SimConfig.restart_s`` without steps) with a spare idle
node taking over the same ranks; the cordoned node keeps reporting telemetry as an idle
node. Without a spare the job continues without the node's ranks. ``SimConfig.excluded``
lists nodes that are cordoned from the start (never placed in a job). Noise is drawn from
streams that do not depend on placement, so a run with remediation and one without, from
the same seed, differ only by the remediation; ``truth.remediations`` lists what was
done. Explicit faults instead of (or besides) sampled ones: ``SimConfig(faults=[FaultSpec(
"thermal_throttle", node="node-003", gpu=2, onset_s=120, slowdown=0.15)], random_faults=0)``.

Host clock offsets (``SimConfig(clock_offset_s=0.5)``, off by default): each host's clock
off by a constant drawn in ±0.5 s, on every timestamp it writes (durations stay right);
``truth.clock_offsets`` has each host's.

Job churn (``SimConfig(job_lifetime_s=1800)``, off by default): each job ends after 0.5-1.5x
that, its GPUs cool to idle draw for ``job_gap_s``, then a new job (``job-a-2``...) starts on
the same nodes from step 0, every rank slower over its first ``warmup_steps`` steps
(``job_end`` and ``warmup`` confounders in the truth).

Hot idle nodes (``SimConfig(hot_idle_nodes=2)``, off by default): that many of the nodes
idle at the start run 20-35 deg C hotter and draw 15-45 W more while idle, below any
throttling and with no reason bit but idle (a ``hot_idle`` confounder each, not a fault).

A multi-path fabric (``SimConfig(fabric=FabricSpec(...))``, off by default): the jobs'
ring connections routed over a leaf-spine topology by ECMP or by the path planner, slowed
where flows collide or an uplink is degraded, with the sending NICs' congestion counters
rising; see :mod:`.fabric`.

The package, by what it models: :mod:`.config` (specs and physical constants),
:mod:`.scenario` (placement, faults, confounders, the truth), :mod:`.fabric` (paths,
collisions), :mod:`.hardware` (GPU / NIC physics and samples), :mod:`.training` (steps,
collectives, remediation), :mod:`.cluster` (:class:`ClusterSimulator`, which composes them)
and :mod:`.output` (JSONL writing).
"""

from .cluster import ClusterSimulator
from .config import (
    CATEGORY_BY_KIND,
    CHURN_CONFOUNDER_KINDS,
    CONFOUNDER_KINDS,
    FLEET_CONFOUNDER_KINDS,
    NIC_COUNTERS,
    THROTTLE_TEMP_C,
    FabricSpec,
    FaultSpec,
    JobSpec,
    SimConfig,
)
from .output import write_jsonl

__all__ = [
    "CATEGORY_BY_KIND",
    "CHURN_CONFOUNDER_KINDS",
    "CONFOUNDER_KINDS",
    "FLEET_CONFOUNDER_KINDS",
    "NIC_COUNTERS",
    "THROTTLE_TEMP_C",
    "ClusterSimulator",
    "FabricSpec",
    "FaultSpec",
    "JobSpec",
    "SimConfig",
    "write_jsonl",
]

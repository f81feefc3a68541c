"""Goodput: what Guard's detection and remediation are worth to a 1,024-GPU job over a day.

The headline is at **1x** the cited fault rate: Guard's goodput gain over each baseline with a
95 % interval of the paired per-seed difference (the same faults under every policy), with
Guard's false cordons per 1,000 node-hours as an axis (0, 0.5, 1, 5: each costs an on-demand
checkpoint, a restart on a spare and a sweep) and the false-cordon rate at which Guard stops
paying. Then a grid of the operator baseline (what it notices, how soon), and a sensitivity
grid (fault rate 1x/5x/20x x restart cost), also drawn as a plotly heat map
(``benchmarks/out/goodput-sensitivity.html``, plotly.js inlined).

Policies (the baselines a skeptic accepts):

* ``guard``: Guard's detectors and the real orchestrator cordon; a straggler Guard misses
  goes to the same operator as below;
* ``rules``: the alert rules a dcgm-exporter user writes (:class:`DcgmAlertRules`: trouble
  throttle reasons held, Xid, DBE, NIC error rate, link down, and a rank compute-time rule that
  can fire in a synchronous job), each alert cordoning at once (an Alertmanager runbook);
* ``operator``: those rules, plus a person who notices a straggler slowing the job by >= X
  and drains it by hand Y after its onset (default 5 % after 1 h; no public figure found, so
  X and Y are swept: 2-20 %, 1-12 h);
* ``none``: no one acts on grey faults (for reference).
Under every policy a person drains a crash-looping node ``HUMAN_TTR_S`` after its first crash.

What is simulated how (a hybrid, so that a run takes minutes on two shared cores):

1. **Detection, per fault, with the real code.** For each fault kind, ``--slices`` runs of the
   real simulator (``guard.agents.simulator``, one 16-node / 128-GPU data-parallel job, all
   confounders on) with that fault injected at t+120 s, 15 simulated minutes each. Every
   message goes through :func:`detect_flags` (Guard's detection core through its
   ``MessageFeed``, and the alert rules);
   Guard's flags go, in event time, through the real orchestrator core
   (:class:`~guard.sweeps.orchestrator.Orchestrator`: policy, state machine, cordon cap,
   simulated sweeps; dry-run scheduler; no Kafka). A slice gives each side's time to detect
   and to cordon, and the job's measured step-time slowdown (mean step time after onset /
   before, checkpoint and data-stall steps left out). A slow rank slows a synchronous job by
   the same factor whatever its size, so the 128-GPU slowdown is carried to the 1,024-GPU
   job. A fault not cordoned within the slice counts as never cordoned.
2. **False claims from healthy telemetry, with the real code.** The cordons of healthy nodes
   in all slices, per node-hour, with a 95 % Poisson upper bound (the node-hours are few, so
   Guard's rate is an axis, not a measured figure; the rules' measured rate is used for them).
3. **The day, as an event-time model of the big job** (128 nodes x 8 GPUs, 24 h): faults
   arrive as a Poisson process at the InfiniteHBD trace's rate of the fault kinds Guard can
   see (times the grid's multiple); each fault draws its detection outcome from the slices of
   its kind. Fail-stop faults (Xid, double-bit ECC) hang the job until the NCCL watchdog fires
   (or until the node is cordoned, which kills and restarts the job), then the job restarts
   from its last checkpoint (work since then is lost, plus the restart cost) and, while the
   node is still in the job, crashes again ``RECRASH_S`` after each restart. Grey faults slow
   the whole job by their measured slowdown **until the job relaunches without the node**: a
   node taken out while the job runs costs an on-demand checkpoint (recorded: no work lost)
   and a restart on a spare; a relaunch needs a free spare per node left out and waits for
   one (a falsely cordoned node returns to the spares after its sweep; a faulty one after
   its repair). Communication fail-slows end by themselves (exponential, mean
   24 min); compute, thermal and power ones persist.

Telemetry rate: GPU and NIC samples every 10 s, the coarsest at which every fault kind is
still found by its own detector in the slices; step and collective timings are per step (2 s
nominal).

Parameters and their sources (``assumed`` where no public figure was found):

* fault rate: 387 faults of the kinds mapped in ``guard.agents.calibration`` on 400 servers
  over 348 days (InfiniteHBD trace, ``tests/data/infinitehbd/fault_statistics.json``) =
  1.16e-4 per node-hour (0.36 a day on 128 nodes). Cross-check: Llama 3 405B saw 419
  unexpected interruptions on 2,048 8-GPU servers in 54 days = 1.58e-4 per node-hour;
* NCCL watchdog 600 s: PyTorch's default process-group timeout;
* restart cost 600 s (relaunch + checkpoint reload): assumed; swept 120-1,800 s;
* checkpoint every 1,800 s: assumed; work since the last checkpoint is lost at a crash;
* on-demand checkpoint before a planned restart 30 s: assumed (the simulator's saves: 20-40 s);
* re-crash 120 s after a restart on a still-faulty node: assumed;
* human time to drain a crash-looping node 2 h: assumed;
* communication fail-slows last 24 min on average (Falcon, ATC 2025, 10k-GPU study);
* spares: ``SPARES`` = 4 idle nodes held (3 % of the job's nodes, the same under every
  policy; goodput per provisioned GPU is printed as a factor); a faulty node is back among
  them ``REPAIR_S`` = 8 h after it left (repaired or swapped): both assumed;
* sweep ``SWEEP_S`` = 300 s: the real sweep's timed phases at their defaults (120-s GEMM
  soak, 30-s CPU soak) plus 150 s assumed for the rest;
* checkpoint save time otherwise: the same under every policy, not modelled.

Usage::

    nice -n 10 .venv/bin/python benchmarks/goodput.py           # full: ~10-15 min here
    nice -n 10 .venv/bin/python benchmarks/goodput.py --quick   # smoke test, ~2 min
    nice -n 10 .venv/bin/python benchmarks/goodput.py --seeds 20000   # tighter intervals
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "data" / "infinitehbd" / "fault_statistics.json"
OUT = ROOT / "benchmarks" / "out"

GPUS_PER_NODE = 8
NODES = 128  # 1,024 GPUs
HORIZON_S = 24 * 3600.0
STEP_S = 2.0  # the simulator's nominal step: grey slowdowns are measured on it
TICK_S = 10.0
WATCHDOG_S = 600.0
RESTART_S = 600.0
CHECKPOINT_S = 1800.0
RECRASH_S = 120.0
HUMAN_TTR_S = 7200.0
COMM_FAULT_MEAN_S = 24 * 60.0
TRACE_NODES, TRACE_DAYS = 400, 348
SAMPLE_INTERVAL_S = 10.0
SLICE_NODES, SLICE_ONSET_S, SLICE_S, HEALTHY_S = 16, 120.0, 900.0, 1800.0
FAIL_STOP = frozenset({"xid", "ecc_dbe"})
COMM = frozenset({"degraded_nic", "nic_reduced_speed", "link_flap"})
POLICIES = ("guard", "rules", "operator", "none")
SPARES = 4  # idle nodes held for the job (3 %): assumed
REPAIR_S = 8 * 3600.0  # a faulty node back among the spares (repaired or swapped): assumed
# The real sweep's timed phases at their defaults (sweeps/checks/base.py CheckContext: a
# 120-s GEMM soak, a 30-s CPU soak) plus 150 s for the untimed checks, the NCCL / ib_write_bw
# pair and the drain: assumed; the orchestrator gives up after sweep_timeout_s = 1,800 s.
SWEEP_S = 300.0
ONDEMAND_CKPT_S = 30.0  # one save, as the simulator's checkpoints (20-40 s): assumed


def trace_rate_and_mix() -> tuple[float, dict[str, float]]:
    """Faults per node-hour of the kinds Guard can see, and their relative counts."""
    from guard.agents.calibration import TRACE_TO_KIND

    counts: dict[str, int] = {}
    for level in json.loads(TRACE.read_text()).values():
        for class_name, descs in level.items():
            if isinstance(descs, dict):
                for desc, n in descs.items():
                    kind = TRACE_TO_KIND.get((class_name, desc))
                    if kind is not None:
                        counts[kind] = counts.get(kind, 0) + int(n)
    total = sum(counts.values())
    rate = total / (TRACE_NODES * TRACE_DAYS * 24)
    return rate, {k: v / total for k, v in sorted(counts.items())}


# --- 1. and 2.: the real detectors and orchestrator on slices -------------------------------


@dataclass(frozen=True, slots=True)
class Alert:
    """One firing of an alert rule (what the cordon runbook sees)."""

    ts: float
    node: str
    severity: str
    rule: str


TROUBLE_REASONS = 0x8 | 0x20 | 0x40 | 0x80  # hw slowdown, sw thermal, hw thermal, hw power brake


class DcgmAlertRules:
    """The alert rules a dcgm-exporter (+ node-exporter InfiniBand) user writes, as PromQL
    would evaluate them on the same samples, with their ``for:`` hold times:

    * ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` with a trouble bit (HW slowdown, SW/HW thermal,
      HW power brake; idle and SW power cap are normal) ``for: 1m``;
    * ``DCGM_FI_DEV_XID_ERRORS != 0`` (at once);
    * ``increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL) > 0`` (at once);
    * ``increase(symbol_error + port_rcv_errors [5m]) > 10`` (NIC error rate);
    * ``link_downed`` increased, or the port's link down ``for: 1m``;
    * a rank's compute time (``compute_s``, the time before the step's collective, which a
      synchronous job does not equalise) above 1.2x the job's median for that step, held
      ``for: 5m`` (the mean ratio over 5 min).

    Not evaluable here: row-remap failure (``DCGM_FI_DEV_ROW_REMAP_FAILURE``; the wire format
    carries no such field, so a row-remap fault shows to these rules only through its DBE/Xid).
    """

    def __init__(
        self,
        hold_s: float = 60.0,
        err_window_s: float = 300.0,
        err_count: int = 10,
        compute_ratio: float = 1.2,
        compute_hold_s: float = 300.0,
    ) -> None:
        self.hold_s, self.err_window_s, self.err_count = hold_s, err_window_s, err_count
        self.compute_ratio, self.compute_hold_s = compute_ratio, compute_hold_s
        self.throttled_since: dict[tuple[str, int], float] = {}
        self.down_since: dict[tuple[str, str, int], float] = {}
        self.dbe: dict[tuple[str, int], int] = {}
        self.counters: dict[tuple[str, str, int], tuple[int, int]] = {}
        self.errors: dict[tuple[str, str, int], list[tuple[float, int]]] = {}
        self.steps: dict[tuple[str, int], list[tuple[Any, float]]] = {}
        self.ratios: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def update(self, msg: Any) -> list[Alert]:
        kind = getattr(msg, "kind", "")
        if kind == "gpu":
            return self._gpu(msg)
        if kind == "nic":
            return self._nic(msg)
        if kind == "step" and msg.compute_s is not None:
            return self._step(msg)
        return []

    def flush(self) -> list[Alert]:
        out: list[Alert] = []
        for key in sorted(self.steps):
            out += self._judge(self.steps.pop(key))
        return out

    def _gpu(self, m: Any) -> list[Alert]:
        out: list[Alert] = []
        key = (m.node, m.gpu)
        if m.clock_event_reasons is not None and m.clock_event_reasons & TROUBLE_REASONS:
            since = self.throttled_since.setdefault(key, m.ts)
            if m.ts - since >= self.hold_s:
                out.append(Alert(m.ts, m.node, "warning", "throttle reason held 1m"))
        elif m.clock_event_reasons is not None:
            self.throttled_since.pop(key, None)
        if m.xid:
            out.append(Alert(m.ts, m.node, "critical", "xid != 0"))
        if m.ecc_dbe_total is not None:
            before = self.dbe.get(key)
            self.dbe[key] = m.ecc_dbe_total
            if before is not None and m.ecc_dbe_total > before:
                out.append(Alert(m.ts, m.node, "critical", "dbe increase"))
        return out

    def _nic(self, m: Any) -> list[Alert]:
        out: list[Alert] = []
        key = (m.node, m.device, m.port)
        errs = m.counters.get("symbol_error", 0) + m.counters.get("port_rcv_errors", 0)
        downed = m.counters.get("link_downed", 0)
        before = self.counters.get(key)
        self.counters[key] = (errs, downed)
        if before is not None:
            window = self.errors.setdefault(key, [])
            window.append((m.ts, max(0, errs - before[0])))  # a counter reset counts as 0
            while window and window[0][0] < m.ts - self.err_window_s:
                window.pop(0)
            if sum(n for _, n in window) > self.err_count:
                out.append(Alert(m.ts, m.node, "warning", "nic errors > 10 in 5m"))
            if downed > before[1]:
                out.append(Alert(m.ts, m.node, "warning", "link_downed increase"))
        if m.link_up is False:
            since = self.down_since.setdefault(key, m.ts)
            if m.ts - since >= self.hold_s:
                out.append(Alert(m.ts, m.node, "warning", "link down 1m"))
        else:
            self.down_since.pop(key, None)
        return out

    def _step(self, m: Any) -> list[Alert]:
        self.steps.setdefault((m.job, m.step), []).append((m, float(m.compute_s)))
        out: list[Alert] = []
        for key in [k for k in self.steps if k[0] == m.job and k[1] <= m.step - 2]:
            out += self._judge(self.steps.pop(key))
        return out

    def _judge(self, rows: list[tuple[Any, float]]) -> list[Alert]:
        center = statistics.median(v for _, v in rows)
        out: list[Alert] = []
        if center <= 0:
            return out
        for m, v in rows:
            window = self.ratios.setdefault((m.job, m.rank), [])
            window.append((m.ts, v / center))
            while window and window[0][0] < m.ts - self.compute_hold_s:
                window.pop(0)
            held = window[-1][0] - window[0][0] >= 0.9 * self.compute_hold_s
            if held and statistics.fmean(r for _, r in window) > self.compute_ratio:
                out.append(Alert(m.ts, m.node, "warning", "compute_s > 1.2x median for 5m"))
        return out


def detect_flags(messages: Any) -> dict[str, list[Any]]:
    """The one place this benchmark calls detectors: every message through Guard's detection
    core and through the DCGM alert rules; returns each one's flags (objects with ``ts``,
    ``node`` and ``severity``). Repoint Guard's side here when the engine changes."""
    from guard.detectors.core import MessageFeed

    dets: dict[str, Any] = {"guard": MessageFeed(), "rules": DcgmAlertRules()}
    flags: dict[str, list[Any]] = {name: [] for name in dets}
    for message in messages:
        for name, det in dets.items():
            found = det.update(message)
            if found:
                flags[name] += found
    for name, det in dets.items():
        flags[name] += det.flush()
    return flags


@dataclass
class SliceOutcome:
    """What one slice measured (times from the fault's onset, s; None: not within the slice)."""

    kind: str
    slowdown: float  # the job's measured step-time slowdown
    detect: dict[str, float | None] = field(default_factory=dict)
    cordon: dict[str, float | None] = field(default_factory=dict)
    false_cordons: dict[str, int] = field(default_factory=dict)


def _cordons(flags: list[Any], truth: Any, act_at_once: bool) -> dict[str, float]:
    """First cordon time per node: through the real orchestrator (Guard), or at the first
    alert (alert rules with a runbook that cordons)."""
    if act_at_once:
        first: dict[str, float] = {}
        for f in sorted(flags, key=lambda f: f.ts):
            if f.node and f.severity != "info":
                first.setdefault(f.node, f.ts)
        return first
    from guard.config import OrchestratorSettings
    from guard.sweeps import DryRunScheduler, SimulatedSweepExecutor
    from guard.sweeps.orchestrator import Orchestrator

    nodes = list(truth.nodes)
    now = [truth.start_ts]
    out: list[Any] = []
    orch = Orchestrator(
        OrchestratorSettings(nodes=nodes),
        scheduler=DryRunScheduler(nodes),
        executor=SimulatedSweepExecutor.from_truth(truth, duration_s=0.0),
        publish=out.append,
        clock=lambda: now[0],
        nodes=nodes,
        inline_sweeps=True,
    )
    for f in sorted(flags, key=lambda f: f.ts):
        now[0] = f.ts
        orch.handle_flag(f)
        orch.tick()
    return {
        m.node: m.ts
        for m in reversed(out)
        if getattr(m, "kind", "") == "node_state" and m.state == "cordoned"
    }


def _job_slowdown(sim: Any, truth: Any, onset: float) -> float:
    skip = [(c.start, c.end) for c in truth.confounders if c.kind in ("checkpoint", "data_stall")]
    before, after = [], []
    for end, step_s in sim.step_times("job-a"):
        if any(s - STEP_S <= end <= e + STEP_S for s, e in skip):
            continue
        (after if end - step_s >= onset else before).append(step_s)
    if not before or not after:
        return 0.0
    return max(0.0, statistics.fmean(after) / statistics.fmean(before) - 1.0)


def run_slice(spec: tuple[str | None, int]) -> SliceOutcome:
    """One simulated slice through Guard's detectors and the DCGM alert rules."""
    from guard.agents.simulator import ClusterSimulator, FaultSpec, JobSpec, SimConfig

    kind, seed = spec
    faults = [FaultSpec(kind, onset_s=SLICE_ONSET_S)] if kind else []
    sim = ClusterSimulator(
        SimConfig(
            nodes=SLICE_NODES,
            duration_s=SLICE_S if kind else HEALTHY_S,
            seed=seed,
            sample_interval_s=SAMPLE_INTERVAL_S,
            jobs=[JobSpec("job-a", SLICE_NODES, step_s_nominal=STEP_S)],
            idle_fraction=0.0,
            faults=faults,
            random_faults=0,
        )
    )
    flags = detect_flags(sim.messages())
    truth = sim.truth()
    fault = truth.faults[0] if truth.faults else None
    out = SliceOutcome(kind or "healthy", _job_slowdown(sim, truth, fault.onset) if fault else 0.0)
    for name, found in flags.items():
        cordons = _cordons(found, truth, act_at_once=name == "rules")
        claims = [f.ts for f in found if fault and f.node == fault.node and f.severity != "info"]
        out.detect[name] = round(min(claims) - fault.onset, 1) if claims and fault else None
        hit = cordons.pop(fault.node, None) if fault else None
        out.cordon[name] = None if hit is None or fault is None else round(hit - fault.onset, 1)
        out.false_cordons[name] = len(cordons)
    return out


# --- 3.: the big job's day ----------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    onset: float
    slowdown: float
    end: float  # when a grey fault ends by itself (inf: never)
    removed: float  # when the node is cordoned or drained (inf: never within the horizon)
    detect: float | None  # time to detect (s from onset), for the table
    gone: float = math.inf  # when the job relaunched without the node
    false: bool = False  # a false cordon: a healthy node, back to the spares after its sweep


@dataclass
class DayResult:
    useful_steps: float = 0.0
    steps_run: float = 0.0
    running_s: float = 0.0
    down_s: float = 0.0
    lost_steps: float = 0.0
    restarts: int = 0
    spare_wait_s: float = 0.0
    hourly: list[tuple[float, float]] = field(default_factory=list)  # (running s, steps) per h

    @property
    def goodput(self) -> float:
        return self.useful_steps / (HORIZON_S / 3600)

    @property
    def mean_step_s(self) -> float:
        return self.running_s / self.steps_run if self.steps_run else math.inf

    @property
    def hourly_cv(self) -> float:
        means = [s / n for s, n in self.hourly if n > 0]
        if len(means) < 2:
            return 0.0
        return statistics.pstdev(means) / statistics.fmean(means)


@dataclass(frozen=True)
class Operator:
    """A person who notices a straggler slowing the job by >= ``slowdown`` after ``after_s``
    and drains its node by hand (an on-demand checkpoint, then a restart on a spare)."""

    slowdown: float = 0.05
    after_s: float = 3600.0


def draw_faults(
    rng: random.Random,
    rate: float,
    mix: dict[str, float],
    pool: dict[str, list[SliceOutcome]],
    policy: str,
    operator: Operator,
) -> list[Fault]:
    """The day's faults (the same draws for every policy: the rng is re-seeded per policy).

    ``guard``: cordoned where its slice cordoned; ``rules``: at the rules' first alert;
    ``operator``: the rules, and a person drains a straggler the rules missed; ``none``: no
    one acts on a grey fault. Under ``guard`` the same person drains what Guard missed; under
    every policy a person drains a crash-looping node ``HUMAN_TTR_S`` after its first crash."""
    faults, t = [], 0.0
    per_s = rate * NODES / 3600
    kinds, weights = list(mix), list(mix.values())
    detector = "rules" if policy == "operator" else policy
    while True:
        t += rng.expovariate(per_s)
        if t >= HORIZON_S:
            return faults
        kind = rng.choices(kinds, weights)[0]
        outcome = rng.choice(pool[kind])
        natural = rng.expovariate(1 / COMM_FAULT_MEAN_S) if kind in COMM else math.inf
        # a fail-stop fault costs crashes, not slow steps (its slice's pre-crash steps are noise)
        slowdown = 0.0 if kind in FAIL_STOP else outcome.slowdown
        cordon = None if policy == "none" else outcome.cordon[detector]
        removed = math.inf if cordon is None else t + cordon
        if kind in FAIL_STOP:
            removed = min(removed, t + HUMAN_TTR_S)  # a person drains the crash-looping node
        elif (
            policy in ("guard", "operator")
            and slowdown >= operator.slowdown
            and operator.after_s < natural  # noticed before it ends by itself
        ):
            removed = min(removed, t + operator.after_s)
        detect = None if policy == "none" else outcome.detect[detector]
        faults.append(Fault(kind, t, slowdown, t + natural, removed, detect))


def simulate_day(
    faults: list[Fault],
    false_cordons: list[float],
    restart_s: float,
    spares: int = SPARES,
    sweep_s: float = SWEEP_S,
) -> DayResult:
    """The job through the day, segment by segment: running (at the slowest active grey
    fault's pace), hung, restarting; checkpoints, rollbacks, spares.

    A cordoned (or drained) node leaves the job only when the job relaunches without it: a
    node taken out while the job runs costs an on-demand checkpoint (``ONDEMAND_CKPT_S``, no
    work lost) and a restart; a relaunch takes a spare per node it leaves out, and waits for
    one when none is free. A falsely cordoned node is swept (``sweep_s``) and goes back to the
    spares; a faulty one after ``REPAIR_S``."""
    res = DayResult(hourly=[(0.0, 0.0) for _ in range(int(HORIZON_S // 3600))])
    faults = [Fault(**{**f.__dict__, "gone": math.inf}) for f in faults]
    outs = faults + [
        Fault("false_cordon", ts, 0.0, math.inf, ts, None, false=True) for ts in false_cordons
    ]
    outs.sort(key=lambda f: f.removed)
    free, returns = spares, []  # returns: when a swept node is back among the spares
    progress = saved = 0.0
    next_ckpt, busy_until = CHECKPOINT_S, 0.0
    crash_at = {id(f): f.onset for f in faults if f.kind in FAIL_STOP}

    def relaunch(r: float) -> float:
        """Leave out every node taken out by ``r`` (a spare each); when the job can start."""
        nonlocal free
        for f in outs:
            if f.removed > r:
                break
            if not math.isinf(f.gone):
                continue
            while True:
                back = [b for b in returns if b <= r]
                for b in back:
                    returns.remove(b)
                free += len(back)
                if free > 0 or not returns:
                    break
                res.spare_wait_s += min(returns) - r
                r = min(returns)  # wait for a swept node
            if free == 0 and f.false:  # wait for this node's own sweep; it rejoins
                back = f.removed + ONDEMAND_CKPT_S + sweep_s
                res.spare_wait_s += max(0.0, back - r)
                r = f.gone = max(r, back)
                continue
            if free == 0:
                return HORIZON_S  # no spare left and none coming back today
            free -= 1
            f.gone = r
            # back among the spares: a healthy node after its sweep, a faulty one repaired
            back = sweep_s if f.false else REPAIR_S
            returns.append(f.removed + ONDEMAND_CKPT_S + back)
        return r

    t = 0.0
    while t < HORIZON_S:
        if t < busy_until:
            res.down_s += min(busy_until, HORIZON_S) - t
            t = busy_until
            continue
        due = [
            f
            for f in faults
            if f.kind in FAIL_STOP and math.isinf(f.gone) and crash_at.get(id(f), math.inf) <= t
        ]
        if due:
            f = due[0]
            hang = max(0.0, min(WATCHDOG_S, f.removed - t))
            res.lost_steps += progress - saved
            progress = saved
            res.restarts += 1
            busy_until = relaunch(t + hang + restart_s)
            next_ckpt = busy_until + CHECKPOINT_S
            again = busy_until + RECRASH_S
            crash_at[id(f)] = again if math.isinf(f.gone) else math.inf
            continue
        if any(f.removed <= t and math.isinf(f.gone) for f in outs):
            saved = progress  # the on-demand checkpoint: nothing is lost
            res.restarts += 1
            busy_until = relaunch(t + ONDEMAND_CKPT_S + restart_s)
            next_ckpt = busy_until + CHECKPOINT_S
            continue
        active = [f for f in faults if f.onset <= t < min(f.end, f.gone)]
        slow = max((f.slowdown for f in active), default=0.0)
        # the next moment anything changes: an onset, an end, a crash, a removal, a
        # checkpoint, an hour boundary
        marks = [next_ckpt, (int(t // 3600) + 1) * 3600.0, HORIZON_S]
        marks += [x for f in faults for x in (f.onset, f.end, f.gone) if x > t]
        marks += [f.removed for f in outs if f.removed > t and math.isinf(f.gone)]
        marks += [c for c in crash_at.values() if c > t]
        nxt = min(marks)
        steps = (nxt - t) / (STEP_S * (1 + slow))
        progress += steps
        res.steps_run += steps
        res.running_s += nxt - t
        h = int(t // 3600)
        run_s, n = res.hourly[h]
        res.hourly[h] = (run_s + nxt - t, n + steps)
        t = nxt
        if t >= next_ckpt:
            saved, next_ckpt = progress, t + CHECKPOINT_S
    res.useful_steps = progress
    return res


def false_cordon_times(seed: int, policy: str, per_node_hour: float) -> list[float]:
    """False cordons in the big job's day: Poisson at ``per_node_hour`` over its nodes."""
    frng = random.Random(seed * 7919 + POLICIES.index(policy))
    per_s = per_node_hour * NODES / 3600
    out: list[float] = []
    t = frng.expovariate(per_s) if per_s > 0 else math.inf
    while t < HORIZON_S:
        out.append(t)
        t += frng.expovariate(per_s)
    return out


IDEAL_DAY = simulate_day([], [], RESTART_S)


# --- the report ----------------------------------------------------------------------------


def build_pool(
    slices: int, healthy: int, jobs: int
) -> tuple[dict[str, list[SliceOutcome]], dict[str, int], float]:
    from concurrent.futures import ProcessPoolExecutor

    from guard.agents.calibration import FAULT_KINDS

    specs: list[tuple[str | None, int]] = [
        (k, 100 + i) for k in FAULT_KINDS for i in range(slices)
    ] + [(None, 500 + i) for i in range(healthy)]
    outcomes = []
    with ProcessPoolExecutor(max_workers=jobs) as pool_exec:
        for i, o in enumerate(pool_exec.map(run_slice, specs), start=1):
            outcomes.append(o)
            print(f"  slice {i}/{len(specs)} ({o.kind})", file=sys.stderr, flush=True)
    pool: dict[str, list[SliceOutcome]] = {}
    for o in outcomes:
        pool.setdefault(o.kind, []).append(o)
    node_hours = sum(
        SLICE_NODES * (HEALTHY_S if o.kind == "healthy" else SLICE_S) / 3600 for o in outcomes
    )
    false_counts = {p: sum(o.false_cordons[p] for o in outcomes) for p in ("guard", "rules")}
    return pool, false_counts, node_hours


def poisson_upper(k: int, conf: float = 0.95) -> float:
    """The one-sided ``conf`` upper bound on a Poisson mean after ``k`` events (bisection)."""
    lo, hi = 0.0, 10.0 + 10 * k
    for _ in range(60):
        mid = (lo + hi) / 2
        cdf = sum(math.exp(-mid) * mid**i / math.factorial(i) for i in range(k + 1))
        lo, hi = (mid, hi) if cdf > 1 - conf else (lo, mid)
    return hi


def print_slices(pool: dict[str, list[SliceOutcome]]) -> None:
    print("\nslices (real detectors + orchestrator; times from onset, s; '-' not within 780 s)")
    head = ("kind", "job slowdown", "guard detect/cordon", "rules detect/cordon")
    print("{:<18} {:>14}  {:>24}  {:>24}".format(*head))

    def fmt(values: list[float | None]) -> str:
        return ",".join("-" if v is None else f"{v:.0f}" for v in values)

    for kind, outs in sorted(pool.items()):
        if kind == "healthy":
            continue
        sd = ",".join(f"{o.slowdown:.0%}" for o in outs)
        g = f"{fmt([o.detect['guard'] for o in outs])}/{fmt([o.cordon['guard'] for o in outs])}"
        r = f"{fmt([o.detect['rules'] for o in outs])}/{fmt([o.cordon['rules'] for o in outs])}"
        print(f"{kind:<18} {sd:>14}  {g:>24}  {r:>24}")


@dataclass
class Setting:
    """Everything a day depends on but the seed and the policy."""

    rate: float
    mix: dict[str, float]
    pool: dict[str, list[SliceOutcome]]
    false_rate: dict[str, float]  # per node-hour, by detector (guard, rules)
    restart_s: float = RESTART_S
    operator: Operator = Operator()

    def day(self, seed: int, policy: str) -> tuple[DayResult, list[Fault]]:
        detector = "rules" if policy == "operator" else policy
        rng = random.Random(seed)
        faults = draw_faults(rng, self.rate, self.mix, self.pool, policy, self.operator)
        falses = false_cordon_times(seed, policy, self.false_rate.get(detector, 0.0))
        if not faults and not falses:
            return IDEAL_DAY, faults
        return simulate_day(faults, falses, self.restart_s), faults


def gain(setting: Setting, seeds: int, baseline: str) -> tuple[float, float, float]:
    """Guard's goodput gain over ``baseline``, %: mean and 95 % interval of the paired
    per-seed difference (the same faults under both), relative to the baseline's mean."""
    diffs, base = [], []
    for s in range(seeds):
        g = setting.day(s, "guard")[0].goodput
        b = setting.day(s, baseline)[0].goodput
        diffs.append(g - b)
        base.append(b)
    mean_b = statistics.fmean(base)
    m = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(seeds) if seeds > 1 else math.inf
    return 100 * m / mean_b, 100 * (m - half) / mean_b, 100 * (m + half) / mean_b


ROW = "{:<9} {:>10.2f} {:>9.3%} {:>9.4f}s {:>10.3%} {:>9.3%} {:>11.1f} {:>9.3f} {:>7} {:>13}"
BASELINES = ("rules", "operator", "none")


def print_day_table(setting: Setting, seeds: int) -> None:
    ideal = 3600 / STEP_S
    print(
        f"\n{NODES * GPUS_PER_NODE} GPUs, 24 h, mean over {seeds} seeds "
        f"(fault-free goodput {ideal:.0f} steps/h)"
    )
    head = (
        "policy",
        "goodput/h",
        "vs ideal",
        "mean step",
        "hourly CV",
        "downtime",
        "lost steps",
        "restarts",
        "faults",
        "TTD median s",
    )
    print("{:<9} {:>10} {:>9} {:>10} {:>10} {:>9} {:>11} {:>9} {:>7} {:>13}".format(*head))
    for policy in POLICIES:
        days = [setting.day(s, policy) for s in range(seeds)]
        rs = [r for r, _ in days]
        ttd = [f.detect for _, fs in days for f in fs if f.detect is not None]
        print(
            ROW.format(
                policy,
                statistics.fmean(r.goodput for r in rs),
                statistics.fmean(r.goodput for r in rs) / ideal,
                statistics.fmean(r.mean_step_s for r in rs),
                statistics.fmean(r.hourly_cv for r in rs),
                statistics.fmean(r.down_s / HORIZON_S for r in rs),
                statistics.fmean(r.lost_steps for r in rs),
                statistics.fmean(r.restarts for r in rs),
                sum(len(fs) for _, fs in days),
                "-" if not ttd else f"{statistics.median(ttd):.0f}",
            )
        )


def break_even(setting: Setting, seeds: int, baseline: str) -> float | None:
    """The false-cordon rate (per 1,000 node-hours) at which Guard's mean gain over
    ``baseline`` reaches 0 (bisection; None: Guard does not pay even at 0)."""

    def at(per_1000: float) -> float:
        rates = {**setting.false_rate, "guard": per_1000 / 1000}
        return gain(Setting(**{**setting.__dict__, "false_rate": rates}), seeds, baseline)[0]

    if at(0.0) <= 0:
        return None
    lo, hi = 0.0, 1.0
    while at(hi) > 0 and hi < 64:
        lo, hi = hi, hi * 2
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


Headline = dict[float, dict[str, tuple[float, float, float]]]


def print_headline(
    setting: Setting, seeds: int, false_axis: list[float]
) -> tuple[Headline, dict[str, float | None]]:
    """Print (and return) Guard's gain over each baseline along the false-cordon axis, and
    the break-even false-cordon rate per baseline."""
    print(
        f"\nGuard's goodput gain at 1x the trace's fault rate, %, mean [95 % interval], "
        f"{seeds} paired seeds; false cordons per 1,000 node-hours as the axis (each a drain "
        f"with an on-demand checkpoint, a restart on a spare, a {SWEEP_S:.0f}-s sweep)"
    )
    print(f"{'false/1000nh':>12} " + " ".join(f"{'vs ' + b:>24}" for b in BASELINES))
    headline: Headline = {}
    for per_1000 in false_axis:
        rates = {**setting.false_rate, "guard": per_1000 / 1000}
        s = Setting(**{**setting.__dict__, "false_rate": rates})
        headline[per_1000] = {b: gain(s, seeds, b) for b in BASELINES}
        cells = [f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" for m, lo, hi in headline[per_1000].values()]
        print(f"{per_1000:>12g} " + " ".join(f"{c:>24}" for c in cells), flush=True)
    evens = {}
    for b in BASELINES:
        evens[b] = be = break_even(setting, seeds, b)
        text = "Guard does not pay even at 0" if be is None else f"{be:.3f} per 1,000 node-hours"
        print(f"break-even false-cordon rate vs {b}: {text}", flush=True)
    return headline, evens


def print_operator_grid(setting: Setting, seeds: int) -> None:
    xs, ys = (0.02, 0.05, 0.10, 0.20), (1.0, 4.0, 12.0)
    print(
        "\nGuard's gain over the operator baseline at 1x, % [95 %], by what the operator "
        "notices (rows: slowdown >= X) and how soon (columns: Y hours); Guard's misses go "
        "to the same operator"
    )
    print(f"{'X':>5} " + " ".join(f"{f'Y={y:g} h':>24}" for y in ys))
    for x in xs:
        cells = []
        for y in ys:
            s = Setting(**{**setting.__dict__, "operator": Operator(x, y * 3600)})
            m, lo, hi = gain(s, seeds, "operator")
            cells.append(f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        print(f"{x:>5.0%} " + " ".join(f"{c:>24}" for c in cells), flush=True)


def sensitivity(
    setting: Setting, seeds: int, accelerations: list[float], restarts: list[float]
) -> dict[tuple[float, float], dict[str, float]]:
    """Guard's mean goodput gain (%) over each baseline, per (fault rate x restart cost)."""
    grid = {}
    for acc in accelerations:
        for restart_s in restarts:
            s = Setting(**{**setting.__dict__, "rate": setting.rate * acc, "restart_s": restart_s})
            grid[(acc, restart_s)] = {b: gain(s, seeds, b)[0] for b in BASELINES}
        print(f"  sensitivity {acc:g}x done", file=sys.stderr, flush=True)
    return grid


def print_sensitivity(grid: dict[tuple[float, float], dict[str, float]], seeds: int) -> None:
    accs = sorted({a for a, _ in grid})
    restarts = sorted({r for _, r in grid})
    for key in BASELINES:
        print(
            f"\nsensitivity, Guard's mean gain over {key}, % ({seeds} seeds a cell; rows: "
            "fault-rate multiple; columns: restart cost)"
        )
        print(f"{'rate':>6} " + " ".join(f"{r / 60:>8.0f}min" for r in restarts))
        for a in accs:
            print(f"{a:>5g}x " + " ".join(f"{grid[(a, r)][key]:>+11.3f}" for r in restarts))


#: One colour per baseline in the benchmark's plots.
BASELINE_COLORS = {"rules": "#d62728", "operator": "#ff7f0e", "none": "#7f7f7f"}
#: The rules and the operator are often within a hair of each other: dashes keep both seen.
BASELINE_DASHES = {"rules": "solid", "operator": "dash", "none": "solid"}


def false_cordon_figure(
    headline: Headline, evens: dict[str, float | None], seeds: int, bound: float | None = None
) -> Any:
    """Guard's gain over each baseline at 1x along the false-cordon axis (mean, 95 % interval),
    each break-even rate marked; the right panel repeats the rates up to 1 per 1,000 node-hours,
    where the break-evens lie; the measured upper bound of Guard's rate in the subtitle."""
    from plotly.subplots import make_subplots

    zoom = 1.0
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        subplot_titles=("all rates", f"0 to {zoom:g}: where Guard stops paying"),
    )
    for col, upto in ((1, math.inf), (2, zoom)):
        axis = [x for x in sorted(headline) if x <= upto]
        for b in BASELINES:
            color = BASELINE_COLORS[b]
            means = [headline[x][b][0] for x in axis]
            fig.add_scatter(
                x=axis,
                y=means,
                mode="lines+markers",
                name=f"vs {b}",
                legendgroup=b,
                showlegend=col == 1,
                line={"color": color, "dash": BASELINE_DASHES[b]},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [headline[x][b][2] - m for x, m in zip(axis, means, strict=True)],
                    "arrayminus": [m - headline[x][b][1] for x, m in zip(axis, means, strict=True)],
                    "color": color,
                },
                row=1,
                col=col,
            )
            if (be := evens.get(b)) is not None and be <= upto:
                fig.add_scatter(
                    x=[be],
                    y=[0.0],
                    mode="markers",
                    name=f"break-even vs {b}: {be:.3g}",
                    legendgroup=b,
                    showlegend=col == 1,
                    marker={"color": color, "symbol": "diamond", "size": 11},
                    row=1,
                    col=col,
                )
        fig.add_hline(y=0, line={"color": "black", "width": 1}, row=1, col=col)
        fig.update_xaxes(title_text="Guard's false cordons per 1,000 node-hours", row=1, col=col)
    measured = (
        ""
        if bound is None
        else f"; Guard's measured rate: 95 % upper bound {bound:.1f} per 1,000 node-hours"
    )
    fig.update_layout(
        title=f"Guard's goodput gain at 1x vs its false cordons<br><sub>{seeds} paired seeds a "
        f"point; bars: 95 % interval; diamonds: break-even{measured}</sub>",
        yaxis_title="goodput gain, %",
        margin={"t": 110},
    )
    return fig


def plot_sensitivity(
    grid: dict[tuple[float, float], dict[str, float]],
    path: Path,
    seeds: int,
    false_cordons: Any = None,
    false_per_1000: float = 0.0,
) -> None:
    """A diverging heat map per baseline (green where Guard wins, red where it loses), each
    with its own colour bar (the gains over no remediation are ten times those over the
    rules: one shared scale would wash the others out, and one bar for three scales would
    mislabel two), under the false-cordon figure when given; one page, plotly.js inlined
    once."""
    import plotly.io as pio
    from plotly.subplots import make_subplots

    accs = sorted({a for a, _ in grid})
    restarts = sorted({r for _, r in grid})
    fig = make_subplots(
        rows=1,
        cols=len(BASELINES),
        subplot_titles=[f"vs {b}" for b in BASELINES],
        horizontal_spacing=0.1,
    )
    for col, key in enumerate(BASELINES, start=1):
        z = [[grid[(a, r)][key] for r in restarts] for a in accs]
        domain = fig.layout[f"xaxis{col if col > 1 else ''}"].domain
        fig.add_heatmap(
            z=z,
            x=[f"{r / 60:.0f} min" for r in restarts],
            y=[f"{a:g}x" for a in accs],
            zmid=0,
            colorscale="RdYlGn",
            text=[[f"{v:+.2f}%" for v in row] for row in z],
            texttemplate="%{text}",
            colorbar={"x": domain[1] + 0.005, "xanchor": "left", "thickness": 12},
            row=1,
            col=col,
        )
    fig.update_layout(
        title="Guard's mean goodput gain, %, 1,024 GPUs over 24 h, by fault rate x restart cost"
        f"<br><sub>{seeds} paired seeds a cell; Guard's false cordons {false_per_1000:g} per "
        "1,000 node-hours (their cost: the figure above)</sub>",
        yaxis_title="fault rate (x InfiniteHBD)",
    )
    figures = [f for f in (false_cordons, fig) if f is not None]
    divs = "\n".join(
        pio.to_html(f, include_plotlyjs=i == 0, full_html=False, div_id=f"plot-{i}")
        for i, f in enumerate(figures)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>Guard goodput sensitivity</title></head><body>" + divs + "</body></html>",
        encoding="utf-8",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test (~1 min)")
    parser.add_argument("--restart-s", type=float, default=RESTART_S)
    parser.add_argument("--seeds", type=int, default=None, help="days per policy at 1x")
    parser.add_argument("--slices", type=int, default=None, help="slices per fault kind")
    parser.add_argument("--healthy", type=int, default=None, help="healthy 30-min slices")
    parser.add_argument("--jobs", type=int, default=2, help="processes for the slices")
    parser.add_argument("--plot", type=Path, default=OUT / "goodput-sensitivity.html")
    args = parser.parse_args(argv)
    for name in ("seeds", "slices", "healthy", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1 (got {value})")
    slices = args.slices or (1 if args.quick else 3)
    healthy = args.healthy or (1 if args.quick else 4)
    seeds = args.seeds or (200 if args.quick else 4000)
    started = time.monotonic()
    rate, mix = trace_rate_and_mix()
    print(
        f"InfiniteHBD rate of the kinds Guard sees: {rate:.3g} per node-hour "
        f"= {rate * NODES * 24:.2f} faults expected per day on {NODES} nodes (1x)"
    )
    print("mix: " + ", ".join(f"{k} {v:.1%}" for k, v in mix.items()))
    print(
        f"spares held: {SPARES} nodes ({SPARES / NODES:.1%} of the job: goodput per provisioned "
        f"GPU is {NODES / (NODES + SPARES):.3f}x the figures below, the same for every policy); "
        f"sweep {SWEEP_S:.0f} s; on-demand checkpoint {ONDEMAND_CKPT_S:.0f} s; restart "
        f"{args.restart_s:.0f} s"
    )
    pool, false_counts, node_hours = build_pool(slices, healthy, args.jobs)
    false_rate = {p: n / node_hours for p, n in false_counts.items()}
    print(
        f"slices: {slices} per kind + {healthy} healthy, {node_hours:.0f} node-hours, "
        f"{time.monotonic() - started:.0f} s; false cordons measured: "
        + ", ".join(
            f"{p} {n} ({1000 * n / node_hours:.2f} per 1,000 node-hours, 95 % upper bound "
            f"{1000 * poisson_upper(n) / node_hours:.1f})"
            for p, n in false_counts.items()
        )
    )
    print_slices(pool)
    setting = Setting(rate, mix, pool, {"guard": 0.0, "rules": false_rate["rules"]}, args.restart_s)
    print(
        "\nGuard's false cordons are an axis below (measured bound above); the rules' measured "
        "rate is used for the rules and the operator"
    )
    print_day_table(setting, seeds)
    headline, evens = print_headline(setting, seeds, [0.0, 0.5, 1.0, 5.0])
    print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    print_operator_grid(setting, max(50, seeds // 2))
    accs = [1, 5, 20]
    restarts = [120, 600, 1800]
    grid_seeds = max(20, seeds // 10)
    grid = sensitivity(setting, grid_seeds, accs, restarts)
    print_sensitivity(grid, grid_seeds)
    bound = 1000 * poisson_upper(false_counts["guard"]) / node_hours
    plot_sensitivity(
        grid, args.plot, grid_seeds, false_cordon_figure(headline, evens, seeds, bound)
    )
    print(f"\nplot: {args.plot}; wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

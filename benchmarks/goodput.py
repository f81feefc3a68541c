"""Goodput: what Guard's detection and remediation are worth to a 1,024-GPU job over a day.

Prints, for Guard, for static alert rules acted on and for no remediation: goodput (useful
steps per hour), mean step time, step-time variation over hourly windows (CV of the hourly
mean step time), downtime fraction, restarts, and time to detect per fault; then a
sensitivity sweep (fault rate x restart cost) of Guard's goodput gain, also drawn as a
plotly heat map (``benchmarks/out/goodput-sensitivity.html``, plotly.js inlined).

What is simulated how (a hybrid, so that a run takes minutes on two shared cores):

1. **Detection, per fault, with the real code.** For each fault kind, ``--slices`` runs of the
   real simulator (``guard.agents.simulator``, one 16-node / 128-GPU data-parallel job, all
   confounders on) with that fault injected at t+120 s, 15 simulated minutes each. Every
   message goes through the real :class:`~guard.detectors.engine.MessageFeed`; Guard's
   flags go, in event time, through the real orchestrator core
   (:class:`~guard.sweeps.orchestrator.Orchestrator`: policy, state machine, cordon cap,
   simulated sweeps; dry-run scheduler; no Kafka). A slice gives: Guard's time to detect
   (first warning/critical flag on the faulty node) and to cordon; the same for the static
   rules of ``benchmarks/detection_quality.py`` (temperature > 85 C, any Xid, DBE increase,
   ``link_downed`` increase, step time > 1.2x the job median), acted on at their first alert
   (an Alertmanager runbook that cordons); and the job's measured step-time slowdown (mean
   step time after onset / before, checkpoint and data-stall steps left out). A slow rank slows
   a synchronous job by the same factor whatever its size, so the 128-GPU slowdown is carried
   to the 1,024-GPU job. A fault not cordoned within the slice counts as never cordoned.
2. **False claims from healthy telemetry, with the real code.** ``--healthy`` fault-free
   30-minute slices (16 nodes, confounders on) through the same detectors and orchestrator: the
   cordons there, per node-hour, are each policy's false-cordon rate, drawn (Poisson) across
   the big job's day.
3. **The day, as an event-time model of the big job** (128 nodes x 8 GPUs, 24 h, 10-s ticks):
   faults arrive as a Poisson process at the InfiniteHBD trace's rate of the fault kinds Guard
   can see, times ``--acceleration``; each fault draws its detection outcome from the slices
   of its kind. Fail-stop faults (Xid, double-bit ECC) hang the job until the NCCL watchdog
   fires (or until the node is cordoned, which kills and restarts the job), then the job
   restarts from its last checkpoint (work since then is lost, plus the restart cost) and,
   while the node is still in the job, crashes again ``RECRASH_S`` after each restart. Grey
   faults slow the whole job by their measured slowdown until the node is cordoned; a cordon
   for a grey fault restarts the job on a spare right after the next checkpoint (no work lost,
   the restart cost paid). Without remediation a person drains a crash-looping node after
   ``HUMAN_TTR_S``; grey faults persist (compute, thermal, power) or end by themselves
   (communication: exponential, mean 24 min).

Telemetry rate: GPU and NIC samples every 10 s, the coarsest at which every fault kind is
still found by its own detector in the slices (at 30 s, the dcgm-exporter default, power
faults are found only through the straggler detector and an Xid sample can precede the
fault's onset); step and collective timings are per step (2 s nominal).

Parameters and their sources (``assumed`` where no public figure was found):

* fault rate: 387 faults of the kinds mapped in ``guard.agents.calibration`` on 400 servers
  over 348 days (InfiniteHBD trace, ``tests/data/infinitehbd/fault_statistics.json``) =
  1.16e-4 per node-hour; the mix is the trace's relative counts. Cross-check: Llama 3 405B
  saw 419 unexpected interruptions on 2,048 8-GPU servers in 54 days = 1.58e-4 per
  node-hour ("The Llama 3 Herd of Models", 2024). Accelerated ``--acceleration`` times
  (default 20x, about 7 faults a day on 128 nodes) so that a day shows faults;
* NCCL watchdog 600 s: PyTorch's default process-group timeout;
* restart cost 600 s (relaunch + checkpoint reload): assumed; swept 120-3,600 s;
* checkpoint every 1,800 s: assumed; work since the last checkpoint is lost at a crash;
* re-crash 120 s after a restart on a still-faulty node: assumed (an Xid 79 / DBE GPU fails
  at its first kernels);
* human time to drain a crash-looping node 2 h: assumed;
* communication fail-slows last 24 min on average (Falcon, ATC 2025, 10k-GPU study); compute,
  thermal and power faults persist through the day: assumed;
* spares: a cordoned node is replaced by an idle spare (assumed always available);
* checkpoint save time: the same under every policy, not modelled.

Usage::

    nice -n 10 .venv/bin/python benchmarks/goodput.py           # full: ~5-10 min here
    nice -n 10 .venv/bin/python benchmarks/goodput.py --quick   # smoke test, ~1 min
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
POLICIES = ("guard", "static", "none")


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
    alert (static rules acted on)."""
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
    """One simulated slice through Guard's detectors and the static rules."""
    from guard.agents.simulator import ClusterSimulator, FaultSpec, JobSpec, SimConfig
    from guard.detectors.baselines import StaticRulesBaseline
    from guard.detectors.core import MessageFeed

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
    dets = {"guard": MessageFeed(), "static": StaticRulesBaseline()}
    flags: dict[str, list[Any]] = {name: [] for name in dets}
    for message in sim.messages():
        for name, det in dets.items():
            found = det.update(message)
            if found:
                flags[name] += found
    truth = sim.truth()
    fault = truth.faults[0] if truth.faults else None
    out = SliceOutcome(kind or "healthy", _job_slowdown(sim, truth, fault.onset) if fault else 0.0)
    for name, det in dets.items():
        flags[name] += det.flush()
        cordons = _cordons(flags[name], truth, act_at_once=name == "static")
        claims = [
            f.ts for f in flags[name] if fault and f.node == fault.node and f.severity != "info"
        ]
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
    removed: float  # when the node leaves the job (inf: never within the horizon)
    detect: float | None  # time to detect (s from onset), for the table


@dataclass
class DayResult:
    useful_steps: float = 0.0
    steps_run: float = 0.0
    running_s: float = 0.0
    down_s: float = 0.0
    lost_steps: float = 0.0
    restarts: int = 0
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


def draw_faults(
    rng: random.Random,
    rate: float,
    mix: dict[str, float],
    pool: dict[str, list[SliceOutcome]],
    policy: str,
) -> list[Fault]:
    """The day's faults (the same draws for every policy: the rng is re-seeded per policy)."""
    faults, t = [], 0.0
    per_s = rate * NODES / 3600
    kinds, weights = list(mix), list(mix.values())
    while True:
        t += rng.expovariate(per_s)
        if t >= HORIZON_S:
            return faults
        kind = rng.choices(kinds, weights)[0]
        outcome = rng.choice(pool[kind])
        natural = rng.expovariate(1 / COMM_FAULT_MEAN_S) if kind in COMM else math.inf
        cordon = None if policy == "none" else outcome.cordon[policy]
        if cordon is not None:
            removed = t + cordon
        elif kind in FAIL_STOP:
            removed = t + HUMAN_TTR_S  # a person drains the crash-looping node
        else:
            removed = math.inf
        detect = None if policy == "none" else outcome.detect[policy]
        # a fail-stop fault costs crashes, not slow steps (its slice's pre-crash steps are noise)
        slowdown = 0.0 if kind in FAIL_STOP else outcome.slowdown
        faults.append(Fault(kind, t, slowdown, t + natural, removed, detect))


def simulate_day(faults: list[Fault], false_cordons: list[float], restart_s: float) -> DayResult:
    """Tick the job through the day: running, hung, restarting; checkpoints and rollbacks."""
    res = DayResult(hourly=[(0.0, 0.0) for _ in range(int(HORIZON_S // 3600))])
    progress = saved = 0.0
    next_ckpt, busy_until = CHECKPOINT_S, 0.0
    crash_at = {id(f): f.onset for f in faults if f.kind in FAIL_STOP}
    # grey-fault cordons and false cordons restart the job after the next checkpoint
    planned = sorted(
        [f.removed for f in faults if f.kind not in FAIL_STOP and f.removed < f.end] + false_cordons
    )
    t = 0.0
    while t < HORIZON_S:
        if t < busy_until:
            res.down_s += TICK_S
            t += TICK_S
            continue
        due = [f for f in faults if f.kind in FAIL_STOP and crash_at.get(id(f), math.inf) <= t]
        if due:
            f = due[0]
            hang = max(0.0, min(WATCHDOG_S, f.removed - t))
            res.lost_steps += progress - saved
            progress = saved
            res.restarts += 1
            busy_until = t + hang + restart_s
            next_ckpt = busy_until + CHECKPOINT_S
            again = busy_until + RECRASH_S
            crash_at[id(f)] = again if again < f.removed else math.inf
            continue
        slow = max(
            (f.slowdown for f in faults if f.onset <= t < min(f.end, f.removed)), default=0.0
        )
        step = STEP_S * (1 + slow)
        progress += TICK_S / step
        res.steps_run += TICK_S / step
        res.running_s += TICK_S
        h = int(t // 3600)
        run_s, n = res.hourly[h]
        res.hourly[h] = (run_s + TICK_S, n + TICK_S / step)
        t += TICK_S
        if t >= next_ckpt:
            saved, next_ckpt = progress, t + CHECKPOINT_S
            if planned and planned[0] <= t:
                while planned and planned[0] <= t:
                    planned.pop(0)
                res.restarts += 1
                busy_until = t + restart_s
                next_ckpt = busy_until + CHECKPOINT_S
    res.useful_steps = progress
    return res


def run_day(
    seed: int,
    policy: str,
    rate: float,
    mix: dict[str, float],
    pool: dict[str, list[SliceOutcome]],
    false_rate: dict[str, float],
    restart_s: float,
) -> tuple[DayResult, list[Fault]]:
    rng = random.Random(seed)
    faults = draw_faults(rng, rate, mix, pool, policy)
    frng = random.Random(seed * 7919 + POLICIES.index(policy))
    per_s = false_rate.get(policy, 0.0) * NODES / 3600
    false_cordons: list[float] = []
    t = frng.expovariate(per_s) if per_s > 0 else math.inf
    while t < HORIZON_S:
        false_cordons.append(t)
        t += frng.expovariate(per_s)
    return simulate_day(faults, false_cordons, restart_s), faults


# --- the report ----------------------------------------------------------------------------


def build_pool(
    quick: bool, slices: int, healthy: int, jobs: int
) -> tuple[dict[str, list[SliceOutcome]], dict[str, float], float]:
    from concurrent.futures import ProcessPoolExecutor

    from guard.agents.calibration import FAULT_KINDS

    specs: list[tuple[str | None, int]] = [
        (k, 100 + i) for k in FAULT_KINDS for i in range(slices)
    ] + [(None, 500 + i) for i in range(healthy)]
    with ProcessPoolExecutor(max_workers=jobs) as pool_exec:
        outcomes = list(pool_exec.map(run_slice, specs))
    pool: dict[str, list[SliceOutcome]] = {}
    for o in outcomes:
        pool.setdefault(o.kind, []).append(o)
    node_hours = sum(
        SLICE_NODES * (HEALTHY_S if o.kind == "healthy" else SLICE_S) / 3600 for o in outcomes
    )
    false_rate = {
        p: sum(o.false_cordons[p] for o in outcomes) / node_hours for p in ("guard", "static")
    }
    return pool, false_rate, node_hours


def print_slices(pool: dict[str, list[SliceOutcome]]) -> None:
    print("\nslices (real detectors + orchestrator; times from onset, s; '-' not within 780 s)")
    print(
        f"{'kind':<18} {'job slowdown':>12}  "
        f"{'guard detect/cordon':>22}  {'static detect/cordon':>22}"
    )

    def fmt(values: list[float | None]) -> str:
        return ",".join("-" if v is None else f"{v:.0f}" for v in values)

    for kind, outs in sorted(pool.items()):
        if kind == "healthy":
            continue
        sd = ",".join(f"{o.slowdown:.0%}" for o in outs)
        g = f"{fmt([o.detect['guard'] for o in outs])}/{fmt([o.cordon['guard'] for o in outs])}"
        s = f"{fmt([o.detect['static'] for o in outs])}/{fmt([o.cordon['static'] for o in outs])}"
        print(f"{kind:<18} {sd:>12}  {g:>22}  {s:>22}")


ROW = "{:<8} {:>10.1f} {:>9.1%} {:>9.3f}s {:>10.2%} {:>9.2%} {:>11.0f} {:>9.1f} {:>7} {:>13}"


def print_day_table(days: dict[str, list[tuple[DayResult, list[Fault]]]]) -> None:
    ideal = 3600 / STEP_S
    print(
        f"\n{NODES * GPUS_PER_NODE} GPUs, 24 h, mean over {len(days['guard'])} seeds "
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
    print("{:<8} {:>10} {:>9} {:>10} {:>10} {:>9} {:>11} {:>9} {:>7} {:>13}".format(*head))
    for policy in POLICIES:
        rs = [r for r, _ in days[policy]]
        ttd = [f.detect for _, fs in days[policy] for f in fs if f.detect is not None]
        nfaults = sum(len(fs) for _, fs in days[policy])
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
                nfaults,
                "-" if not ttd else f"{statistics.median(ttd):.0f}",
            )
        )


def print_faults(faults_by_policy: dict[str, list[Fault]]) -> None:
    """Seed 0's faults: onset, measured slowdown, and when each policy took the node out."""
    print("\nfaults of seed 0 (time to detect / node out of the job, s from onset; '-' never)")
    print(f"{'onset':>8} {'kind':<18} {'slowdown':>8}  {'guard':>12}  {'static':>12}  {'none':>8}")

    def cell(f: Fault) -> str:
        out = "-" if math.isinf(f.removed) else f"{f.removed - f.onset:.0f}"
        return f"{'-' if f.detect is None else f'{f.detect:.0f}'}/{out}"

    rows = zip(*(faults_by_policy[p] for p in POLICIES), strict=True)
    for g, s, n in rows:
        none = "-" if math.isinf(n.removed) else f"{n.removed - n.onset:.0f}"
        print(
            f"{g.onset / 3600:>7.2f}h {g.kind:<18} {g.slowdown:>8.1%}  {cell(g):>12}  "
            f"{cell(s):>12}  {none:>8}"
        )


def sensitivity(
    seeds: int,
    accelerations: list[float],
    restarts: list[float],
    rate: float,
    mix: dict[str, float],
    pool: dict[str, list[SliceOutcome]],
    false_rate: dict[str, float],
) -> dict[tuple[float, float], dict[str, float]]:
    """Guard's goodput gain (%) over no remediation and over static rules, per grid cell."""
    grid = {}
    for acc in accelerations:
        for restart_s in restarts:
            gp = {
                p: statistics.fmean(
                    run_day(s, p, rate * acc, mix, pool, false_rate, restart_s)[0].goodput
                    for s in range(seeds)
                )
                for p in POLICIES
            }
            grid[(acc, restart_s)] = {
                "vs_none": 100 * (gp["guard"] / gp["none"] - 1),
                "vs_static": 100 * (gp["guard"] / gp["static"] - 1),
            }
    return grid


def print_sensitivity(grid: dict[tuple[float, float], dict[str, float]]) -> None:
    accs = sorted({a for a, _ in grid})
    restarts = sorted({r for _, r in grid})
    for key, title in (("vs_none", "no remediation"), ("vs_static", "static rules acted on")):
        print(
            f"\nGuard's goodput gain over {title}, % (rows: fault-rate acceleration; "
            "columns: restart cost)"
        )
        print(f"{'accel':>6} " + " ".join(f"{r / 60:>8.0f}min" for r in restarts))
        for a in accs:
            print(f"{a:>5.0f}x " + " ".join(f"{grid[(a, r)][key]:>+11.2f}" for r in restarts))


def plot_sensitivity(grid: dict[tuple[float, float], dict[str, float]], path: Path) -> None:
    """A diverging heat map per baseline: green where Guard wins, red where it loses."""
    from plotly.subplots import make_subplots

    accs = sorted({a for a, _ in grid})
    restarts = sorted({r for _, r in grid})
    fig = make_subplots(rows=1, cols=2, subplot_titles=("vs no remediation", "vs static rules"))
    for col, key in enumerate(("vs_none", "vs_static"), start=1):
        z = [[grid[(a, r)][key] for r in restarts] for a in accs]
        fig.add_heatmap(
            z=z,
            x=[f"{r / 60:.0f} min" for r in restarts],
            y=[f"{a:g}x" for a in accs],
            zmid=0,
            colorscale="RdYlGn",
            text=[[f"{v:+.1f}%" for v in row] for row in z],
            texttemplate="%{text}",
            colorbar={"x": 0.45 if col == 1 else 1.0, "len": 0.9},  # one scale per panel
            row=1,
            col=col,
        )
    fig.update_layout(
        title="Guard's goodput gain, 1,024 GPUs over 24 h (fault rate x restart cost)",
        xaxis_title="restart cost",
        xaxis2_title="restart cost",
        yaxis_title="fault rate (x InfiniteHBD)",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs=True, full_html=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test (~1 min)")
    parser.add_argument("--acceleration", type=float, default=20.0)
    parser.add_argument("--restart-s", type=float, default=RESTART_S)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--slices", type=int, default=None, help="slices per fault kind")
    parser.add_argument("--healthy", type=int, default=None, help="healthy 30-min slices")
    parser.add_argument("--jobs", type=int, default=2, help="processes for the slices")
    parser.add_argument("--plot", type=Path, default=OUT / "goodput-sensitivity.html")
    args = parser.parse_args(argv)
    slices = args.slices or (1 if args.quick else 3)
    healthy = args.healthy or (1 if args.quick else 4)
    seeds = args.seeds or (3 if args.quick else 20)
    started = time.monotonic()
    rate, mix = trace_rate_and_mix()
    print(
        f"InfiniteHBD rate of the kinds Guard sees: {rate:.3g} per node-hour; "
        f"x{args.acceleration:g} "
        f"= {rate * args.acceleration * NODES * 24:.1f} faults expected per day on {NODES} nodes"
    )
    print("mix: " + ", ".join(f"{k} {v:.1%}" for k, v in mix.items()))
    pool, false_rate, node_hours = build_pool(args.quick, slices, healthy, args.jobs)
    print(
        f"slices: {slices} per kind + {healthy} healthy, {node_hours:.0f} node-hours, "
        f"{time.monotonic() - started:.0f} s; false cordons per 1,000 node-hours: "
        + ", ".join(f"{p} {1000 * r:.2f}" for p, r in false_rate.items())
    )
    print_slices(pool)
    days = {
        p: [
            run_day(s, p, rate * args.acceleration, mix, pool, false_rate, args.restart_s)
            for s in range(seeds)
        ]
        for p in POLICIES
    }
    print_day_table(days)
    print_faults({p: days[p][0][1] for p in POLICIES})
    accs = [1, 5, 20, 50] if args.quick else [1, 5, 10, 20, 50, 100]
    restarts = [120, 600, 1800] if args.quick else [120, 300, 600, 1200, 1800, 3600]
    grid = sensitivity(max(2, seeds // 2), accs, restarts, rate, mix, pool, false_rate)
    print_sensitivity(grid)
    plot_sensitivity(grid, args.plot)
    print(f"\nplot: {args.plot}; wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

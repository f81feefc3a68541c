"""Detection quality: Guard's detectors against two baselines, on simulated and real data.

Prints one table. Simulated scenario families (``guard.agents.simulator``; several seeds,
16-256 nodes, fault mixes, slowdowns from 3 % to 50 %, all the confounders on):

* ``stragglers`` — silent slow GPUs (steady and degrading), 3-15 % and 10-50 %;
* ``thermal+power`` — thermal throttling (steady, intermittent), power caps and brakes;
* ``network`` — degraded NICs, NICs at reduced speed, link flaps;
* ``gpu_errors`` — Xid and double-bit ECC errors;
* ``mixed`` — the fault mix calibrated from the InfiniteHBD production trace;
* ``confounders`` — no fault at all: every warning/critical flag is false;
* ``fleet`` — a shared fleet: short-step jobs (a 5 s data-parallel job and an 8 s two-stage
  pipeline job), host clocks off by up to +-0.5 s, jobs ending and new ones warming up on
  the same nodes (churn), two hot idle nodes, and a fault mix with whole-node host-side
  slowdowns (``host_slow``) besides GPU stragglers, thermal, power, NIC, link and Xid faults.

Each scenario's messages go, in one pass, to Guard's :class:`MessageFeed`, to the static
alert rules a dcgm-exporter user writes (temperature > 85 C, any Xid, DBE increase,
``link_downed`` increase, step time > 1.2x the job median) and to an NVRx-style relative
score < 0.75; each set of flags is scored by :func:`guard.evaluation.scoring.evaluate` (node-level
matching; see ``guard eval``). Columns: recall and precision over all faults, F1, false
warning/critical flags per 1,000 node-hours, time to detect (median and p95, s; median in
steps), and recall on the *target* set (faults slowing the job by >= 5 %, plus every Xid,
DBE, link flap and degraded NIC). Then time to detect **per fault kind**, over every
simulated family and over the fleet family alone: seconds from the fault's onset (for a
degrading fault, from when it reaches 5 %) to the first warning/critical claim on its node,
and the same in steps (seconds / the nominal step time of the node's job in the truth).
Thermal faults are timed a second way, ``thermal (bits)``: from the first sample of the GPU
that carries a thermal reason bit while the fault is active, in samples (a thermal fault heats
up for up to two minutes before its bits show). Last, the target faults Guard missed, one
line each (family, seed, kind, node, GPU, onset, slowdown reached, and against its peers),
to look at. Faults count as target, and fall in a slowdown band, by the slowdown their job
sees against its peers (``ClusterSimulator.slowdowns_seen``): a fault on one GPU slows it on
top of that GPU's own speed (about 1 % spread), so a GPU born 2.6 % fast that turns 6 %
slower is 3.2 % behind its peers.

``soak`` — no fault at all, every confounder, 128 nodes for hours (``--soak-hours``,
2,000 node-hours by default in the full suite): the false-claim rate over a long healthy
fleet, Guard only. To fit a shared two-core machine it samples every 10 s (dcgm-exporter's
default is 30 s) and its jobs step every 10 s (the other families: 1 s and 2-3 s), so it has
fewer rounds per hour than they do: read it together with the ``confounders`` family.
``--soak-fleet`` runs it on the fleet family's shared fleet instead (its 5 s and 8 s jobs,
clock offsets, churn and hot idle nodes; samples still every 10 s).

Real data: Alibaba PAI mini-batch times (job 1: worker 6 is slow at t = 1811-1941 s, workers
3-9 never otherwise; job 3: workers 0 and 1 slow throughout, no other; a claim against any
other worker in those spans is false, workers 0-2 of job 1 are not scored) and the NAB
machine-temperature series (NAB-style score of the alarms of Guard's river-based signal
detector against fixed threshold rules, one alarm per day at most for all), and SMD (three
machines of 38 server metrics: labelled segments found, alarms inside and outside; not in
``--quick``).

Usage::

    .venv/bin/python benchmarks/detection_quality.py            # full suite (~15 min, 2 cores)
    .venv/bin/python benchmarks/detection_quality.py --quick    # one small run per family
    .venv/bin/python benchmarks/detection_quality.py --jobs 1   # one process
    .venv/bin/python benchmarks/detection_quality.py --family fleet --soak-hours 0  # one family
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
DETECTORS = ("guard", "static", "nvrx")

FAMILIES: dict[str, dict[str, Any]] = {
    "stragglers": {"fault_mix": {"slow_gpu": 1.0}},
    "thermal+power": {
        "fault_mix": {"thermal_throttle": 0.5, "power_cap": 0.25, "power_brake": 0.25}
    },
    "network": {"fault_mix": {"degraded_nic": 0.4, "nic_reduced_speed": 0.3, "link_flap": 0.3}},
    "gpu_errors": {"fault_mix": {"xid": 0.5, "ecc_dbe": 0.5}},
    "mixed": {},
    "confounders": {"random_faults": 0},
    "fleet": {
        "fault_mix": {
            "slow_gpu": 0.3,
            "host_slow": 0.2,
            "thermal_throttle": 0.1,
            "power_cap": 0.1,
            "degraded_nic": 0.1,
            "link_flap": 0.1,
            "xid": 0.1,
        },
        "clock_offset_s": 0.5,
        "job_lifetime_s": 900.0,
        "job_gap_s": 90.0,
        "hot_idle_nodes": 2,
    },
    "soak": {"random_faults": 0, "sample_interval_s": 10.0, "step_s_nominal": 10.0},
    # the soak on a shared fleet (--soak-fleet): the fleet family's jobs and confounders
    "soak-fleet": {
        "random_faults": 0,
        "sample_interval_s": 10.0,
        "clock_offset_s": 0.5,
        "job_lifetime_s": 900.0,
        "job_gap_s": 90.0,
        "hot_idle_nodes": 2,
    },
}
SOAKS = ("soak", "soak-fleet")

# (family, nodes, duration_s, seed, severity): severity scales every drawn slowdown
FULL = [
    ("stragglers", 16, 1800, 1, 0.6),
    ("stragglers", 64, 1200, 2, 0.6),
    ("stragglers", 64, 600, 3, 2.0),
    ("thermal+power", 16, 900, 4, 1.0),
    ("thermal+power", 64, 900, 5, 1.0),
    ("network", 16, 900, 6, 1.0),
    ("network", 64, 900, 7, 1.0),
    ("gpu_errors", 16, 900, 8, 1.0),
    ("gpu_errors", 64, 600, 9, 1.0),
    ("mixed", 64, 1200, 10, 1.0),
    ("mixed", 256, 300, 11, 1.0),
    ("confounders", 64, 1800, 12, 1.0),
    ("confounders", 256, 300, 13, 1.0),
    ("fleet", 32, 1800, 14, 1.0),
    ("fleet", 64, 1800, 15, 1.0),
]
QUICK = [
    ("stragglers", 16, 600, 1, 0.6),
    ("thermal+power", 16, 600, 4, 1.0),
    ("network", 16, 600, 6, 1.0),
    ("gpu_errors", 16, 600, 8, 1.0),
    ("mixed", 32, 600, 10, 1.0),
    ("confounders", 32, 900, 12, 1.0),
    ("fleet", 32, 1200, 14, 1.0),
]
FAULTS_PER_NODE_HOUR = 1.0
SOAK_NODES = 128
SOAK_RUN_S = 3600.0
#: The fleet family's jobs: steps of 5 s and 8 s (short next to the 11 s of issue 26's traces).
FLEET_STEPS_S = (5.0, 8.0)


def fleet_jobs(nodes: int) -> list[Any]:
    """Half the nodes in a 5 s data-parallel job, most of the rest in an 8 s two-stage
    pipeline job, an eighth (at least the two hot ones) idle."""
    from guard.agents.simulator import JobSpec

    idle = max(2, nodes // 8)
    first = nodes // 2
    second = (nodes - first - idle) // 2 * 2
    return [
        JobSpec("job-a", first, 1, FLEET_STEPS_S[0]),
        JobSpec("job-b", second, 2, FLEET_STEPS_S[1]),
    ]


@dataclass
class Tally:
    """Counts summed over scenarios, for one (family, detector)."""

    faults: int = 0
    detected: int = 0
    target_faults: int = 0
    target_detected: int = 0
    claims: int = 0
    true_claims: int = 0
    false_claims: int = 0
    node_hours: float = 0.0
    ttd_s: list[float] = field(default_factory=list)
    ttd_steps: list[float] = field(default_factory=list)
    min_slowdown: float = math.inf
    max_slowdown: float = 0.0
    runs: int = 0
    false_by: dict[str, int] = field(default_factory=dict)
    #: fault kind -> [(time to detect s or None: missed, nominal step s of its node's job,
    #: the slowdown it reached)]
    by_kind: dict[str, list[tuple[float | None, float, float]]] = field(default_factory=dict)
    #: the target faults (>= 5 % or must-catch) no claim found, one line each, to look at
    missed: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name in (
            "faults",
            "detected",
            "target_faults",
            "target_detected",
            "claims",
            "true_claims",
            "false_claims",
            "node_hours",
            "runs",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttd_s += other.ttd_s
        self.ttd_steps += other.ttd_steps
        self.min_slowdown = min(self.min_slowdown, other.min_slowdown)
        self.max_slowdown = max(self.max_slowdown, other.max_slowdown)
        for k, v in other.false_by.items():
            self.false_by[k] = self.false_by.get(k, 0) + v
        for k, rows in other.by_kind.items():
            self.by_kind.setdefault(k, []).extend(rows)
        self.missed += other.missed

    @property
    def recall(self) -> float | None:
        return self.detected / self.faults if self.faults else None

    @property
    def target_recall(self) -> float | None:
        return self.target_detected / self.target_faults if self.target_faults else None

    @property
    def precision(self) -> float | None:
        return self.true_claims / self.claims if self.claims else None

    @property
    def f1(self) -> float | None:
        r, p = self.recall, self.precision
        if r is None:
            return None
        if p is None or p + r == 0:
            return 0.0
        return 2 * p * r / (p + r)


def run_scenario(spec: tuple[str, int, float, int, float]) -> dict[str, Tally]:
    """Simulate one scenario and score the three detectors (Guard only in a soak) on it."""
    from guard.agents.simulator import ClusterSimulator, SimConfig
    from guard.evaluation.backtest import make_detector
    from guard.evaluation.scoring import FLAG_FIELDS, MUST_CATCH_KINDS, evaluate
    from guard.schemas.nvml_codes import THERMAL_REASONS

    family, nodes, duration, seed, severity = spec
    options = dict(FAMILIES[family])
    if family in ("fleet", "soak-fleet"):
        options["jobs"] = fleet_jobs(nodes)
    sim = ClusterSimulator(
        SimConfig(
            nodes=nodes,
            duration_s=duration,
            seed=seed,
            severity=severity,
            faults_per_node_hour=FAULTS_PER_NODE_HOUR,
            **options,
        )
    )
    names = ("guard",) if family in SOAKS else DETECTORS
    detectors: dict[str, Any] = {name: make_detector(name) for name in names}
    flags: dict[str, list[Any]] = {name: [] for name in detectors}
    processes = [(flags[name], det.update) for name, det in detectors.items()]
    bits_at: dict[tuple[str, int], list[float]] = {}  # (node, gpu) -> ts of thermal bits
    for message in sim.messages():
        if message.kind == "gpu" and (message.clock_event_reasons or 0) & THERMAL_REASONS:
            bits_at.setdefault((message.node, message.gpu), []).append(message.ts)
        for sink, process in processes:
            found = process(message)
            if found:
                sink.extend(found)
    truth = sim.truth()
    # The target set by the slowdown each job sees against its peers (a fault on a GPU born
    # fast slows the job by less than it slows its GPU), not by the fault's own figure.
    seen = sim.slowdowns_seen(truth)
    interval = float(sim.config.sample_interval_s)
    result: dict[str, Tally] = {}
    for name, det in detectors.items():
        flags[name] += det.flush()
        ev = evaluate(
            truth,
            [f.model_dump(include=set(FLAG_FIELDS)) for f in flags[name]],
            seen=seen,
        )
        tally = Tally(runs=1)
        all_row, target = ev.rows["all"], ev.rows.get("target")
        tally.faults, tally.detected = all_row.faults, all_row.detected
        tally.ttd_s, tally.ttd_steps = list(all_row.ttd_s), list(all_row.ttd_steps)
        if target is not None:
            tally.target_faults, tally.target_detected = target.faults, target.detected
        tally.claims, tally.true_claims = ev.claims, ev.true_claims
        tally.false_claims = len(ev.false_claims)
        tally.node_hours = ev.node_hours
        for f in ev.false_claims:
            key = f"{f['detector']}/{f['category']}"
            tally.false_by[key] = tally.false_by.get(key, 0) + 1
        tally.by_kind = per_kind(truth, ev.first_hit, seen)
        tally.by_kind[BITS_KIND] = from_bits(truth, ev.first_hit, bits_at, interval)
        tally.missed = [
            f"{family} seed {seed}: {f.kind} on {f.node} gpu {f.gpu} from t+"
            f"{f.onset - truth.start_ts:.0f} s, reached {100 * f.reached(truth.end_ts):.1f} % "
            f"({f.pattern}), {100 * seen[f.id]:.1f} % against its peers"
            for f in truth.faults
            if f.id not in ev.first_hit and (seen[f.id] >= 0.05 or f.kind in MUST_CATCH_KINDS)
        ]
        slowdowns = [s for s in seen.values() if s > 0]
        if slowdowns:
            tally.min_slowdown, tally.max_slowdown = min(slowdowns), max(slowdowns)
        result[name] = tally
    g = result["guard"]
    print(
        f"  done: {family} {nodes} nodes x {duration:.0f} s seed {seed} severity {severity}: "
        f"guard {g.node_hours:.0f} node-hours, {g.false_claims} false claims "
        f"{g.false_by or ''}",
        file=sys.stderr,
        flush=True,
    )
    return result


def per_kind(
    truth: Any, first_hit: dict[str, float], seen: dict[str, float], level: float = 0.05
) -> dict[str, list[tuple[float | None, float, float]]]:
    """Per fault kind: each fault's time to detect (s; None: missed), the nominal step time
    of its node's job and the slowdown its job sees against its peers (``seen``), timed as
    ``guard eval`` times it (from when the fault reaches ``level`` slowdown)."""
    step_of_node = {node: job.step_s_nominal or 0.0 for job in truth.jobs for node in job.nodes}
    out: dict[str, list[tuple[float | None, float, float]]] = {}
    for fault in truth.faults:
        hit = first_hit.get(fault.id)
        ttd = None if hit is None else max(0.0, hit - fault.reaches_at(level))
        row = (ttd, step_of_node.get(fault.node, 0.0), seen[fault.id])
        out.setdefault(fault.kind, []).append(row)
    return out


#: Thermal faults timed from the first sample with a thermal reason bit (issue 26: "thermal
#: with throttle bits <= 2 samples after the bits"); its "steps" are sampling intervals.
BITS_KIND = "thermal (bits)"


def from_bits(
    truth: Any,
    first_hit: dict[str, float],
    bits_at: dict[tuple[str, int], list[float]],
    interval: float,
) -> list[tuple[float | None, float, float]]:
    """Each thermal fault whose GPU reported a thermal reason bit while it was active: the
    time from that first sample to the first claim on its node (s; None: missed), the
    sampling interval, and the slowdown it reached."""
    rows: list[tuple[float | None, float, float]] = []
    for fault in truth.faults:
        if fault.kind != "thermal_throttle" or fault.gpu is None:
            continue
        seen = [t for t in bits_at.get((fault.node, fault.gpu), ()) if fault.active(t)]
        if not seen:
            continue
        hit = first_hit.get(fault.id)
        ttd = None if hit is None else max(0.0, hit - min(seen))
        rows.append((ttd, interval, fault.reached(truth.end_ts)))
    return rows


#: Stragglers are also shown by the slowdown they reached (issue 26's targets are per band).
STRAGGLER_KINDS = ("slow_gpu", "host_slow")
BANDS = (("<5%", 0.0, 0.05), ("5-7%", 0.05, 0.07), ("7-12%", 0.07, 0.12), (">=12%", 0.12, 9.0))


def print_per_kind(title: str, tallies: dict[str, Tally]) -> None:
    """Time to detect per fault kind (stragglers also per slowdown band), in seconds and in
    steps: Guard, and how many the two baselines found and their median."""
    kinds = sorted({k for t in tallies.values() for k in t.by_kind})
    if not kinds:
        return
    print(
        f"\ntime to detect per fault kind, {title} (s from onset; steps = s / nominal step; "
        f"'{BITS_KIND}': from the first sample with a thermal bit, steps = samples)"
    )
    head = (
        f"{'kind':<18} {'step_s':>7} {'guard found':>11} {'med_s':>6} {'p95_s':>6} "
        f"{'med_steps':>9} {'p95_steps':>9} {'static found':>12} {'med_s':>6} "
        f"{'nvrx found':>10} {'med_s':>6}"
    )
    print(head)
    print("-" * len(head))

    def cells(name: str, kind: str, lo: float, hi: float) -> tuple[str, list[float], list[float]]:
        rows = tallies[name].by_kind.get(kind, []) if name in tallies else []
        rows = [r for r in rows if lo <= r[2] < hi]
        seconds = [t for t, _, _ in rows if t is not None]
        steps = [t / st for t, st, _ in rows if t is not None and st > 0]
        return f"{len(seconds)}/{len(rows)}", seconds, steps

    def line(label: str, kind: str, lo: float = 0.0, hi: float = math.inf) -> None:
        found, secs, steps = cells("guard", kind, lo, hi)
        if found.endswith("/0"):
            return
        s_found, s_secs, _ = cells("static", kind, lo, hi)
        n_found, n_secs, _ = cells("nvrx", kind, lo, hi)
        rows = [r for r in tallies["guard"].by_kind[kind] if lo <= r[2] < hi]
        nominal = sorted({st for _, st, _ in rows if st > 0})
        span = "-" if not nominal else "/".join(f"{v:g}" for v in nominal)
        print(
            f"{label:<18} {span:>7} {found:>11} {_f(_q(secs, 0.5), 0):>6} "
            f"{_f(_q(secs, 0.95), 0):>6} {_f(_q(steps, 0.5), 1):>9} {_f(_q(steps, 0.95), 1):>9} "
            f"{s_found:>12} {_f(_q(s_secs, 0.5), 0):>6} {n_found:>10} {_f(_q(n_secs, 0.5), 0):>6}"
        )

    for kind in kinds:
        line(kind, kind)
        if kind in STRAGGLER_KINDS:
            for band, lo, hi in BANDS:
                line(f"  {band}", kind, lo, hi)


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# --- real data ------------------------------------------------------------------------------


def pai_rows() -> list[tuple[str, str, str]]:
    from guard.detectors.baselines import NvrxBaseline, StaticRulesBaseline
    from guard.detectors.core import MessageFeed
    from guard.evaluation.public_data import PAI_EPOCH, pai_step_timings

    # job -> (worker -> (slow from, slow to) or None: never slow; workers absent: not scored)
    truth: dict[int, dict[int, tuple[float, float] | None]] = {
        1: {6: (1811.0, 1941.0), **{w: None for w in (3, 4, 5, 7, 8, 9)}},
        3: {0: (0.0, 1e9), 1: (0.0, 1e9), **{w: None for w in range(2, 10)}},
    }
    rows = []
    for job, workers in truth.items():
        messages = pai_step_timings(DATA / "alibaba-pai" / f"job_{job}_norm.csv", f"pai-{job}")
        for name, det in (
            ("guard", MessageFeed()),
            ("static", StaticRulesBaseline()),
            ("nvrx", NvrxBaseline()),
        ):
            flags = [f for m in messages for f in det.update(m)] + det.flush()
            claims = [f for f in flags if f.severity != "info" and f.node]
            found, false, first = set(), 0, {}
            for f in claims:
                worker = int(str(f.node).split("-")[1])
                if worker not in workers:
                    continue
                t = f.ts - PAI_EPOCH
                span = workers[worker]
                if span is not None and span[0] <= t <= span[1] + 60.0:
                    found.add(worker)
                    first.setdefault(worker, t - span[0])
                else:
                    false += 1
            slow = [w for w, s in workers.items() if s is not None]
            ttd = statistics.median(first.values()) if first else None
            rows.append(
                (
                    f"PAI job {job}",
                    name,
                    f"stragglers found {len(found)}/{len(slow)} "
                    f"({', '.join(f'worker {w}' for w in sorted(found)) or 'none'}); "
                    f"false claims {false}; ttd median {_f(ttd, 0)} s",
                )
            )
    return rows


def nab_rows() -> list[tuple[str, str, str]]:
    from guard.detectors.signal_anomaly import SignalAnomalyDetector
    from guard.evaluation.public_data import nab_score, nab_series, nab_windows

    series = nab_series(DATA / "nab" / "machine_temperature_system_failure.csv")
    windows = nab_windows(
        DATA / "nab" / "combined_windows.json",
        "realKnownCause/machine_temperature_system_failure.csv",
    )
    det = SignalAnomalyDetector()
    guard_alarms = [ts for ts, v in series if det.update(ts, v) is not None]

    def rule(above: float | None = None, below: float | None = None) -> list[float]:
        alarms: list[float] = []
        for ts, v in series:
            hit = (above is not None and v > above) or (below is not None and v < below)
            if hit and (not alarms or ts - alarms[-1] > 86400.0):
                alarms.append(ts)
        return alarms

    rows = []
    for name, alarms in (
        ("guard", guard_alarms),
        ("static >85", rule(above=85.0)),
        ("static <50", rule(below=50.0)),
    ):
        s = nab_score(alarms, windows)
        rows.append(
            (
                "NAB machine temp",
                name,
                f"NAB score {s['nab_score']}; windows hit {s['windows_hit']}/{s['windows']}; "
                f"alarms {s['alarms']} (inside {s['inside']}, outside {s['outside']})",
            )
        )
    return rows


SMD_MACHINES = ("machine-2-1", "machine-3-3", "machine-3-4")
SMD_DIR = ROOT.parent / "shared" / "data" / "SMD"


def smd_rows() -> list[tuple[str, str, str]]:
    """SMD (38 normalised server metrics per machine, one row a minute): per-metric alarms.

    Guard's river-based :class:`SignalAnomalyDetector` runs on every metric (train half
    then test half; window one day, quiet hour after an alarm); the static rule alarms when
    any metric exceeds 0.95 of its normalised range. A labelled segment is found when an
    alarm falls inside it; alarms outside every segment are false.
    """
    import gzip

    import numpy as np

    from guard.detectors.signal_anomaly import SignalAnomalyDetector

    rows = []
    totals = {"guard": [0, 0, 0, 0], "static >0.95": [0, 0, 0, 0]}  # hit, segs, in, out
    for machine in SMD_MACHINES:
        with gzip.open(SMD_DIR / "processed_csv" / f"{machine}_train.csv.gz", "rt") as fh:
            train = np.loadtxt(fh, delimiter=",")
        with gzip.open(SMD_DIR / "processed_csv" / f"{machine}_test.csv.gz", "rt") as fh:
            test = np.loadtxt(fh, delimiter=",")
        labels = np.loadtxt(SMD_DIR / "test_label" / f"{machine}.txt", dtype=int)
        segments = []
        for line in (SMD_DIR / "interpretation_label" / f"{machine}.txt").read_text().split():
            a, b = line.split(":")[0].split("-")
            segments.append((int(a), int(b)))
        data = np.vstack([train, test])
        first = len(train)
        alarms: dict[str, set[int]] = {"guard": set(), "static >0.95": set()}
        for j in range(data.shape[1]):
            det = SignalAnomalyDetector(
                window=1440, grace=720, threshold=0.999, hold=5, refractory_s=3600.0
            )
            last_static = -(10**9)
            for i, v in enumerate(data[:, j].tolist()):
                if det.update(60.0 * i, v) is not None and i >= first:
                    alarms["guard"].add(i - first)
                if v > 0.95 and i >= first and i - last_static > 60:
                    alarms["static >0.95"].add(i - first)
                    last_static = i
        for name, found in alarms.items():
            hit = sum(1 for a, b in segments if any(a <= x < b for x in found))
            inside = sum(1 for x in found if labels[x])
            t = totals[name]
            t[0] += hit
            t[1] += len(segments)
            t[2] += inside
            t[3] += len(found) - inside
    for name, (hit, segs, inside, outside) in totals.items():
        rows.append(
            (
                "SMD (3 machines)",
                name,
                f"segments found {hit}/{segs}; alarms {inside + outside} "
                f"(inside {inside}, outside {outside})",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small scenario per family")
    parser.add_argument("--jobs", type=int, default=2, help="parallel scenario processes")
    parser.add_argument("--no-smd", action="store_true", help="leave out SMD (about 2 min)")
    parser.add_argument(
        "--soak-only", action="store_true", help="only the soak family (and no real data)"
    )
    parser.add_argument(
        "--soak-hours",
        type=float,
        default=None,
        help="healthy node-hours of the soak family (default: 2000, 0 with --quick)",
    )
    parser.add_argument(
        "--soak-fleet",
        action="store_true",
        help="the soak on a shared fleet: 5 s and 8 s jobs, host clocks off by up to +-0.5 s, "
        "churn, hot idle nodes (the fleet family's options, no fault)",
    )
    parser.add_argument(
        "--family",
        action="append",
        choices=[f for f in FAMILIES if f not in SOAKS],
        help="only this simulated family (repeatable; default: all), no real data",
    )
    args = parser.parse_args(argv)
    specs = [] if args.soak_only else list(QUICK if args.quick else FULL)
    if args.family:
        specs = [spec for spec in specs if spec[0] in args.family]
    soak = args.soak_hours if args.soak_hours is not None else (0.0 if args.quick else 2000.0)
    runs = math.ceil(soak * 3600.0 / (SOAK_NODES * SOAK_RUN_S)) if soak > 0 else 0
    soak_family = "soak-fleet" if args.soak_fleet else "soak"
    specs += [(soak_family, SOAK_NODES, SOAK_RUN_S, 100 + i, 1.0) for i in range(runs)]
    started = time.perf_counter()
    tallies: dict[tuple[str, str], Tally] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_scenario, specs))
    else:
        results = [run_scenario(spec) for spec in specs]
    for spec, result in zip(specs, results, strict=True):
        for name, tally in result.items():
            tallies.setdefault((spec[0], name), Tally()).add(tally)
    for name in DETECTORS:  # every simulated family together
        total = Tally()
        for (_, det), tally in tallies.items():
            if det == name:
                total.add(tally)
        tallies[("ALL", name)] = total

    head = (
        f"{'family':<14} {'detector':<8} {'runs':>4} {'faults':>6} {'slowdown':>11} "
        f"{'recall':>6} {'target':>6} {'prec':>5} {'F1':>5} {'false/1kNh':>10} "
        f"{'ttd_med_s':>9} {'ttd_p95_s':>9} {'ttd_steps':>9}"
    )
    print(head)
    print("-" * len(head))
    for family in [*FAMILIES, "ALL"]:
        for name in DETECTORS:
            t = tallies.get((family, name))
            if t is None or not t.runs:
                continue
            span = (
                f"{100 * t.min_slowdown:.0f}-{100 * t.max_slowdown:.0f}%"
                if t.max_slowdown > 0
                else "-"
            )
            false_rate = 1000.0 * t.false_claims / t.node_hours if t.node_hours else 0.0
            print(
                f"{family:<14} {name:<8} {t.runs:>4} {t.faults:>6} {span:>11} "
                f"{_f(t.recall):>6} {_f(t.target_recall):>6} {_f(t.precision):>5} "
                f"{_f(t.f1):>5} {false_rate:>10.1f} {_f(_q(t.ttd_s, 0.5), 1):>9} "
                f"{_f(_q(t.ttd_s, 0.95), 1):>9} {_f(_q(t.ttd_steps, 0.5), 1):>9}"
            )
    for family in FAMILIES:
        t = tallies.get((family, "guard"))
        if t and t.false_by:
            print(f"  guard false claims in {family}: {t.false_by}")
    print("-" * len(head))
    print_per_kind("every simulated family", {d: tallies[("ALL", d)] for d in DETECTORS})
    fleet = {d: t for (family, d), t in tallies.items() if family == "fleet"}
    print_per_kind("the fleet family alone", fleet)
    missed = tallies[("ALL", "guard")].missed if ("ALL", "guard") in tallies else []
    if missed:
        print("\nguard missed these target faults (>= 5 % or Xid/DBE/link/NIC):")
        for line in missed:
            print(f"  {line}")
    print()
    real = [] if args.soak_only or args.family else pai_rows() + nab_rows()
    if not (args.quick or args.no_smd or args.soak_only or args.family):
        real += smd_rows()
    for source, name, text in real:
        print(f"{source:<17} {name:<11} {text}")
    node_hours = tallies[("ALL", "guard")].node_hours
    print(
        f"({len(specs)} simulated runs, {node_hours:.0f} node-hours, "
        f"{time.perf_counter() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

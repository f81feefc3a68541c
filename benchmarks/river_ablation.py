"""River ablation: detection quality and cost of the engine with and without its river models.

The engine's river models (:mod:`guard.detectors.peer_anomaly`, ``EngineConfig.peer_anomaly``)
give ``info`` findings only: corroboration that fusion lists beside a claim, never a claim by
itself. This benchmark shows what they change, on the simulator's scenario families of
``benchmarks/detection_quality.py`` (the same specs, imported from it):

* **claims** — the engine's warning/critical flags scored by ``guard eval``'s matching, with
  the models off and on (recall, target recall, precision, false claims per 1,000
  node-hours): the models must not change them;
* **river alone** — the models' own ``anomaly`` findings scored as if they were claims:
  which faults they see (recall, target recall), how often they fire on healthy nodes (false
  per 1,000 node-hours) and how soon (median time to detect);
* **corroborated** — the share of the engine's true claims whose node also carries a river
  finding inside the fault's window (what fusion can list as an agreeing detector);
* **cost** — messages per second of CPU time of the whole engine (median over the
  scenarios of a family; each engine timed alone over the same message list, off then on)
  and pickled state per GPU.

Usage::

    nice -n 10 .venv/bin/python benchmarks/river_ablation.py --quick   # one run per family
    nice -n 10 .venv/bin/python benchmarks/river_ablation.py           # the full specs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from detection_quality import (  # a sibling script, not a package
    FAMILIES,
    FAULTS_PER_NODE_HOUR,
    FULL,
    QUICK,
    Tally,
    _f,
    _q,
)

Spec = tuple[str, int, float, int, float]


@dataclass
class Ablation:
    """One family's figures, summed over its scenarios."""

    off: Tally = field(default_factory=Tally)
    on: Tally = field(default_factory=Tally)
    river: Tally = field(default_factory=Tally)
    true_claims: int = 0
    corroborated: int = 0
    rate_off: list[float] = field(default_factory=list)
    rate_on: list[float] = field(default_factory=list)
    bytes_off: list[float] = field(default_factory=list)
    bytes_on: list[float] = field(default_factory=list)

    def add(self, other: Ablation) -> None:
        self.off.add(other.off)
        self.on.add(other.on)
        self.river.add(other.river)
        self.true_claims += other.true_claims
        self.corroborated += other.corroborated
        for name in ("rate_off", "rate_on", "bytes_off", "bytes_on"):
            getattr(self, name).extend(getattr(other, name))


def _tally(ev: Any) -> Tally:
    tally = Tally(runs=1)
    all_row, target = ev.rows["all"], ev.rows.get("target")
    tally.faults, tally.detected = all_row.faults, all_row.detected
    tally.ttd_s = list(all_row.ttd_s)
    if target is not None:
        tally.target_faults, tally.target_detected = target.faults, target.detected
    tally.claims, tally.true_claims = ev.claims, ev.true_claims
    tally.false_claims = len(ev.false_claims)
    tally.node_hours = ev.node_hours
    return tally


def _timed(engine: Any, messages: list[Any]) -> tuple[list[Any], float]:
    flags: list[Any] = []
    started = time.process_time()  # CPU time of this process: the machine is shared
    for message in messages:
        found = engine.update(message)
        if found:
            flags.extend(found)
    flags += engine.flush()
    return flags, len(messages) / (time.process_time() - started)


def _per_gpu(engine: Any) -> float:
    gpus = sum(len(part.errors.gpus) for part in engine.nodes.values()) or 1
    return sum(engine.state_bytes().values()) / gpus


def _corroborated(truth: Any, claims: list[Any], river: list[Any], grace_s: float) -> int:
    """True claims whose node has a river finding inside one of the node's fault windows."""
    windows: dict[str, list[tuple[float, float]]] = {}
    for fault in truth.faults:
        end = fault.end if fault.end is not None else truth.end_ts
        windows.setdefault(fault.node, []).append((fault.onset - 5.0, end + grace_s))
    seen = {(f.node, f.ts) for f in river}

    def inside(node: str, ts: float) -> bool:
        return any(lo <= ts <= hi for lo, hi in windows.get(node, ()))

    count = 0
    for claim in claims:
        if claim.node is None or not inside(claim.node, claim.ts):
            continue
        if any(node == claim.node and inside(node, ts) for node, ts in seen):
            count += 1
    return count


def run_scenario(spec: Spec) -> Ablation:
    """Simulate one scenario; score the engine with and without the river models."""
    from guard.agents.simulator import ClusterSimulator, SimConfig
    from guard.detectors.core import MessageFeed
    from guard.detectors.engine import EngineConfig
    from guard.evaluation.scoring import FLAG_FIELDS, evaluate

    family, nodes, duration, seed, severity = spec
    sim = ClusterSimulator(
        SimConfig(
            nodes=nodes,
            duration_s=duration,
            seed=seed,
            severity=severity,
            faults_per_node_hour=FAULTS_PER_NODE_HOUR,
            **dict(FAMILIES[family]),
        )
    )
    messages = list(sim.messages())
    truth = sim.truth()
    result = Ablation()
    for switch in (False, True):
        engine = MessageFeed(EngineConfig(peer_anomaly=switch))
        flags, rate = _timed(engine, messages)
        dumps = [f.model_dump(include=set(FLAG_FIELDS)) for f in flags]
        ev = evaluate(truth, dumps)
        (result.on if switch else result.off).add(_tally(ev))
        (result.rate_on if switch else result.rate_off).append(rate)
        (result.bytes_on if switch else result.bytes_off).append(_per_gpu(engine))
        if not switch:
            continue
        river = [f for f in flags if f.detector == "peer_anomaly"]
        as_claims = [{**d, "severity": "warning"} for d in dumps if d["detector"] == "peer_anomaly"]
        result.river.add(_tally(evaluate(truth, as_claims)))
        claims = [f for f in flags if f.severity != "info"]
        result.true_claims = ev.true_claims
        result.corroborated = _corroborated(truth, claims, river, 120.0)
    return result


def _claims_row(label: str, t: Tally) -> str:
    false_rate = 1000.0 * t.false_claims / t.node_hours if t.node_hours else 0.0
    return (
        f"{label:<12} {t.faults:>6} {_f(t.recall):>6} {_f(t.target_recall):>6} "
        f"{_f(t.precision):>5} {false_rate:>10.1f} {_f(_q(t.ttd_s, 0.5), 1):>9}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small scenario per family")
    parser.add_argument("--jobs", type=int, default=1, help="parallel scenario processes")
    args = parser.parse_args(argv)
    specs = QUICK if args.quick else FULL
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_scenario, specs))
    else:
        results = [run_scenario(spec) for spec in specs]
    families: dict[str, Ablation] = {}
    for spec, result in zip(specs, results, strict=True):
        families.setdefault(spec[0], Ablation()).add(result)
        families.setdefault("ALL", Ablation()).add(result)
    head = (
        f"{'family':<14} {'engine':<12} {'faults':>6} {'recall':>6} {'target':>6} "
        f"{'prec':>5} {'false/1kNh':>10} {'ttd_med_s':>9}"
    )
    print(head)
    print("-" * len(head))
    for family, a in sorted(families.items(), key=lambda item: item[0] == "ALL"):
        print(f"{family:<14} {_claims_row('river off', a.off)}")
        print(f"{'':<14} {_claims_row('river on', a.on)}")
        print(f"{'':<14} {_claims_row('river alone', a.river)}")
        share = a.corroborated / a.true_claims if a.true_claims else None
        print(
            f"{'':<14} corroborated true claims {a.corroborated}/{a.true_claims} "
            f"({_f(share)}); msg/s off {statistics.median(a.rate_off):,.0f} "
            f"on {statistics.median(a.rate_on):,.0f}; state B/GPU off "
            f"{statistics.median(a.bytes_off):,.0f} on {statistics.median(a.bytes_on):,.0f}"
        )
    node_hours = families["ALL"].on.node_hours
    print(
        f"({len(specs)} simulated runs, {node_hours:.0f} node-hours, "
        f"{time.perf_counter() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``guard eval``: flags against the simulator's ground truth (docs/simulator-truth.md).

Matching is node-level: a warning or critical flag on a node *detects* every fault of that
node whose window ``[onset - early_s, end + grace_s]`` contains the flag's time (``end``
null: the end of the run), and is *true*; a claim that matches no fault is *false* (caused
by a confounder or by noise). ``info`` flags are observations and are not scored.

Reported per fault category and overall: recall (faults detected / faults), precision
(true claims / claims; per category: claims that matched a fault of the category against
those plus false claims of that flag category), false claims per 1,000 node-hours, time
to detect (median, p95, in seconds and in steps of the node's job), and the same for the
*target* set of faults: those that slow a job by at least ``target_slowdown`` plus every
Xid, DBE, link flap and degraded NIC (the faults that must be caught). A fault that
degrades gradually (``pattern: "degrading"`` with ``detail.ramp_s``) counts with the
slowdown it reached before the run ended, and is timed from the moment its slowdown
reaches ``target_slowdown`` (before that it is not yet a fault that must be caught; a
detection earlier counts as 0 s).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

__all__ = ["Evaluation", "evaluate", "format_report", "load_flags", "load_truth"]

MUST_CATCH_KINDS = frozenset({"xid", "ecc_dbe", "link_flap", "degraded_nic"})


def load_truth(path: str | Path) -> dict[str, Any]:
    truth: dict[str, Any] = json.loads(Path(path).read_text())
    if not isinstance(truth, dict) or "faults" not in truth or "nodes" not in truth:
        raise ValueError(f"{path}: not a simulator truth file (needs 'nodes' and 'faults')")
    return truth


def load_flags(path: str | Path) -> list[dict[str, Any]]:
    """Flags of a JSONL file as dicts (only the fields evaluation needs are read)."""
    flags = []
    with Path(path).open() as fh:
        for line in fh:
            if line.strip():
                item = json.loads(line)
                if item.get("kind", "flag") == "flag":
                    flags.append(item)
    return flags


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Row:
    """Scores of one group of faults (a category, the target set, or all)."""

    name: str
    faults: int = 0
    detected: int = 0
    ttd_s: list[float] = field(default_factory=list)
    ttd_steps: list[float] = field(default_factory=list)
    true_claims: int = 0  # claims that matched a fault of this group
    false_claims: int = 0  # unmatched claims whose flag category is this group's

    @property
    def recall(self) -> float | None:
        return self.detected / self.faults if self.faults else None

    @property
    def precision(self) -> float | None:
        total = self.true_claims + self.false_claims
        return self.true_claims / total if total else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "faults": self.faults,
            "detected": self.detected,
            "recall": self.recall,
            "precision": self.precision,
            "true_claims": self.true_claims,
            "false_claims": self.false_claims,
            "ttd_median_s": _quantile(self.ttd_s, 0.5),
            "ttd_p95_s": _quantile(self.ttd_s, 0.95),
            "ttd_median_steps": _quantile(self.ttd_steps, 0.5),
            "ttd_p95_steps": _quantile(self.ttd_steps, 0.95),
        }


@dataclass
class Evaluation:
    rows: dict[str, Row]
    claims: int
    true_claims: int
    false_claims: list[dict[str, Any]]
    node_hours: float
    flagged_nodes: int
    true_flagged_nodes: int
    missed: list[dict[str, Any]]
    #: fault id → event time of the first claim that detected it
    first_hit: dict[str, float] = field(default_factory=dict)

    @property
    def precision(self) -> float | None:
        return self.true_claims / self.claims if self.claims else None

    @property
    def node_precision(self) -> float | None:
        return self.true_flagged_nodes / self.flagged_nodes if self.flagged_nodes else None

    @property
    def false_per_1000_node_hours(self) -> float:
        return 1000.0 * len(self.false_claims) / self.node_hours if self.node_hours else 0.0

    def f1(self, row: str = "all") -> float | None:
        recall = self.rows[row].recall
        precision = self.precision
        if recall is None:
            return None
        if precision is None:
            return 0.0 if recall == 0 else None
        return 2 * precision * recall / (precision + recall) if precision + recall else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "categories": {k: v.as_dict() for k, v in self.rows.items()},
            "claims": self.claims,
            "true_claims": self.true_claims,
            "precision": self.precision,
            "node_precision": self.node_precision,
            "false_claims": len(self.false_claims),
            "false_per_1000_node_hours": self.false_per_1000_node_hours,
            "node_hours": self.node_hours,
            "f1": self.f1(),
            "missed": self.missed,
            "false_claim_examples": self.false_claims[:20],
        }


def evaluate(
    truth: Mapping[str, Any],
    flags: Iterable[Mapping[str, Any]],
    early_s: float = 5.0,
    grace_s: float = 120.0,
    target_slowdown: float = 0.05,
) -> Evaluation:
    """Score ``flags`` (dicts or models' dumps) against ``truth``."""
    start, end = float(truth["start_ts"]), float(truth["end_ts"])
    step_of_node: dict[str, float] = {}
    for job in truth.get("jobs", []):
        for node in job.get("nodes", []):
            step_of_node[node] = float(job.get("step_s_nominal") or 0.0)
    faults_by_node: dict[str, list[dict[str, Any]]] = {}
    for fault in truth["faults"]:
        faults_by_node.setdefault(fault["node"], []).append(fault)
    first_hit: dict[str, float] = {}
    claims = true_claims = 0
    false_claims: list[dict[str, Any]] = []
    flagged: set[str] = set()
    true_flagged: set[str] = set()
    seen_ids: set[str] = set()
    rows: dict[str, Row] = {}
    for flag in flags:
        if flag.get("severity") == "info" or not flag.get("node"):
            continue
        fid = flag.get("id")
        if fid in seen_ids:
            continue  # a duplicate delivery of the same flag
        seen_ids.add(fid)
        claims += 1
        node, ts = flag["node"], float(flag["ts"])
        flagged.add(node)
        matched: set[str] = set()
        for fault in faults_by_node.get(node, []):
            f_end = end if fault.get("end") is None else float(fault["end"])
            if float(fault["onset"]) - early_s <= ts <= f_end + grace_s:
                matched.add(fault["category"])
                if fault["id"] not in first_hit or ts < first_hit[fault["id"]]:
                    first_hit[fault["id"]] = ts
        if matched:
            true_claims += 1
            true_flagged.add(node)
            for name in matched:
                rows.setdefault(name, Row(name)).true_claims += 1
        else:
            category = str(flag.get("category"))
            rows.setdefault(category, Row(category)).false_claims += 1
            false_claims.append(
                {
                    k: flag.get(k)
                    for k in (
                        "ts",
                        "node",
                        "gpu",
                        "device",
                        "rank",
                        "detector",
                        "category",
                        "severity",
                        "score",
                    )
                }
            )
    missed: list[dict[str, Any]] = []
    for fault in truth["faults"]:
        target = (
            _effective_slowdown(fault, end) >= target_slowdown
            or fault.get("kind") in MUST_CATCH_KINDS
        )
        groups = [fault["category"], "all"] + (["target"] if target else [])
        hit = first_hit.get(fault["id"])
        onset = float(fault["onset"])
        ramp = (fault.get("detail") or {}).get("ramp_s")
        slowdown = float(fault.get("slowdown") or 0.0)
        if fault.get("pattern") == "degrading" and ramp and slowdown > 0:
            onset += float(ramp) * min(1.0, target_slowdown / slowdown)
        for name in groups:
            row = rows.setdefault(name, Row(name))
            row.faults += 1
            if hit is not None:
                row.detected += 1
                ttd = max(0.0, hit - onset)
                row.ttd_s.append(ttd)
                step_s = step_of_node.get(fault["node"], 0.0)
                if step_s > 0:
                    row.ttd_steps.append(ttd / step_s)
        if hit is None:
            missed.append({k: fault.get(k) for k in ("id", "node", "kind", "slowdown", "pattern")})
    everything = rows.setdefault("all", Row("all"))
    everything.true_claims, everything.false_claims = true_claims, len(false_claims)
    node_hours = len(truth["nodes"]) * (end - start) / 3600.0
    return Evaluation(
        rows,
        claims,
        true_claims,
        false_claims,
        node_hours,
        len(flagged),
        len(true_flagged),
        missed,
        first_hit,
    )


def _effective_slowdown(fault: Mapping[str, Any], run_end: float) -> float:
    """The largest slowdown a fault reached before it (or the run) ended.

    A degrading fault's ``slowdown`` is the level at the end of its ramp, which a short run
    may never reach.
    """
    slowdown = float(fault.get("slowdown") or 0.0)
    ramp = (fault.get("detail") or {}).get("ramp_s")
    if fault.get("pattern") != "degrading" or not ramp:
        return slowdown
    until = run_end if fault.get("end") is None else min(run_end, float(fault["end"]))
    return slowdown * max(0.0, min(1.0, (until - float(fault["onset"])) / float(ramp)))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(ev: Evaluation) -> str:
    """A plain-text table: one row per fault category, then the target set and overall."""
    order = sorted(k for k in ev.rows if k not in ("all", "target")) + [
        k for k in ("target", "all") if k in ev.rows
    ]
    lines = [
        f"{'category':<12} {'faults':>6} {'found':>6} {'recall':>7} {'prec':>5} {'false':>5} "
        f"{'false/1kNh':>10} {'ttd_med_s':>10} {'ttd_p95_s':>10} {'ttd_med_steps':>13}"
    ]
    for name in order:
        r = ev.rows[name]
        false_rate = 1000.0 * r.false_claims / ev.node_hours if ev.node_hours else 0.0
        lines.append(
            f"{name:<12} {r.faults:>6} {r.detected:>6} {_fmt(r.recall):>7} "
            f"{_fmt(r.precision):>5} {r.false_claims:>5} {false_rate:>10.2f} "
            f"{_fmt(_quantile(r.ttd_s, 0.5), 1):>10} {_fmt(_quantile(r.ttd_s, 0.95), 1):>10} "
            f"{_fmt(_quantile(r.ttd_steps, 0.5), 1):>13}"
        )
    lines.append("")
    lines.append(
        f"claims {ev.claims} (true {ev.true_claims}, false {len(ev.false_claims)}); "
        f"precision {_fmt(ev.precision)}; node precision {_fmt(ev.node_precision)} "
        f"({ev.true_flagged_nodes}/{ev.flagged_nodes} flagged nodes had a fault); "
        f"false warning/critical per 1000 node-hours {ev.false_per_1000_node_hours:.2f} "
        f"({ev.node_hours:.1f} node-hours); F1 {_fmt(ev.f1())}"
    )
    if ev.missed:
        lines.append(
            "missed: "
            + ", ".join(
                f"{m['id']} {m['kind']}@{m['node']} ({_fmt(m.get('slowdown'))})" for m in ev.missed
            )
        )
    if ev.false_claims:
        by_kind: dict[str, int] = {}
        for f in ev.false_claims:
            key = f"{f['detector']}/{f['category']}"
            by_kind[key] = by_kind.get(key, 0) + 1
        lines.append(
            "false claims by detector: " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items()))
        )
    return "\n".join(lines)


# --- real data (../shared/data; copies in tests/data) ---------------------------------------

PAI_EPOCH = 1_600_000_000.0  # PAI times are seconds since the job started; any epoch will do


def pai_step_timings(path: str | Path, job: str) -> list[Any]:
    """Alibaba PAI mini-batch times as ``StepTiming`` messages, in time order.

    Each ``time`` is one step; worker *w* is rank *w* on node ``worker-w``; the normalised
    mini-batch time (0-1000), in thousandths, is both the rank's ``compute_s`` and its
    ``step_s`` (the trace gives each worker's own mini-batch time, not a synchronised wall
    time, so a step-time alert rule sees the same differences the peer detector sees).
    """
    import csv

    from guard.schemas import StepTiming

    by_time: dict[int, dict[int, float]] = {}
    with Path(path).open(newline="") as fh:
        for row in csv.DictReader(fh):
            by_time.setdefault(int(row["time"]), {})[int(row["worker"])] = float(
                row["batch_time_norm"]
            )
    messages = []
    for step, t in enumerate(sorted(by_time)):
        for worker, value in sorted(by_time[t].items()):
            messages.append(
                StepTiming(
                    ts=PAI_EPOCH + t,
                    node=f"worker-{worker}",
                    job=job,
                    rank=worker,
                    gpu=0,
                    step=step,
                    step_s=value / 1000.0,
                    compute_s=value / 1000.0,
                )
            )
    return messages


def nab_series(path: str | Path) -> list[tuple[float, float]]:
    """A NAB CSV as ``(epoch seconds, value)`` pairs (NAB timestamps are naive; read as UTC)."""
    import csv
    from datetime import datetime

    out = []
    with Path(path).open(newline="") as fh:
        for row in csv.DictReader(fh):
            when = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=UTC)
            out.append((when.timestamp(), float(row["value"])))
    return out


def nab_windows(path: str | Path, key: str) -> list[tuple[float, float]]:
    """Labelled anomaly windows of one NAB series from ``combined_windows.json``."""
    from datetime import datetime

    def epoch(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()

    raw = json.loads(Path(path).read_text())[key]
    return [(epoch(a), epoch(b)) for a, b in raw]


def nab_score(alarms: list[float], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """NAB-style scoring (standard profile: TP 1, FP -0.11, FN -1) of alarm times.

    The first alarm in a window earns ``2 / (1 + exp(5 y)) - 1`` where ``y`` is its position
    relative to the window's end (-1 at the start, 0 at the end): early is better; later alarms
    in the same window neither earn nor cost. An alarm outside every window costs 0.11. A
    window without an alarm costs 1. The normalised score is 100 for perfect detection and 0
    for a detector that never alarms.
    """
    raw = 0.0
    inside = 0
    hit = [False] * len(windows)
    for ts in sorted(alarms):
        for i, (a, b) in enumerate(windows):
            if a <= ts <= b:
                inside += 1
                if not hit[i]:
                    hit[i] = True
                    y = (ts - b) / (b - a) if b > a else 0.0
                    raw += 2.0 / (1.0 + math.exp(5.0 * y)) - 1.0
                break
        else:
            raw -= 0.11
    raw -= sum(1 for h in hit if not h)
    perfect = len(windows) * (2.0 / (1.0 + math.exp(-5.0)) - 1.0)
    null = -float(len(windows))
    return {
        "alarms": len(alarms),
        "inside": inside,
        "outside": len(alarms) - inside,
        "windows_hit": sum(hit),
        "windows": len(windows),
        "nab_score": round(100.0 * (raw - null) / (perfect - null), 1) if windows else None,
    }

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
detection earlier counts as 0 s). ``seen`` (optional, per fault id) chooses the target set by
the slowdown the job sees instead, where that differs from the fault's own: a fault on a GPU
born faster than its peers slows the job by less than it slows its GPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from guard.schemas.truth import Fault, Truth

__all__ = ["FLAG_FIELDS", "Evaluation", "evaluate", "format_report", "load_flags", "load_truth"]

MUST_CATCH_KINDS = frozenset({"xid", "ecc_dbe", "link_flap", "degraded_nic"})


def load_truth(path: str | Path) -> Truth:
    """Read a simulator truth file (``guard simulate --truth``)."""
    try:
        return Truth.load(path)
    except ValidationError as exc:
        raise ValueError(f"{path}: not a simulator truth file: {exc}") from None


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
    truth: Truth | Mapping[str, Any],
    flags: Iterable[Mapping[str, Any]],
    early_s: float = 5.0,
    grace_s: float = 120.0,
    target_slowdown: float = 0.05,
    seen: Mapping[str, float] | None = None,
) -> Evaluation:
    """Score ``flags`` (dicts or models' dumps) against ``truth`` (the model or its dict)."""
    if not isinstance(truth, Truth):
        truth = Truth.model_validate(truth)
    rows: dict[str, Row] = {}
    claims = _score_claims(truth, flags, rows, early_s, grace_s)
    missed = _score_faults(truth, claims.first_hit, rows, target_slowdown, seen or {})
    everything = rows.setdefault("all", Row("all"))
    everything.true_claims, everything.false_claims = claims.true, len(claims.false)
    node_hours = len(truth.nodes) * (truth.end_ts - truth.start_ts) / 3600.0
    return Evaluation(
        rows,
        claims.count,
        claims.true,
        claims.false,
        node_hours,
        len(claims.flagged),
        len(claims.true_flagged),
        missed,
        claims.first_hit,
    )


@dataclass
class _Claims:
    """What the warning/critical flags claimed, and which of them matched a fault."""

    count: int = 0
    true: int = 0
    false: list[dict[str, Any]] = field(default_factory=list)
    flagged: set[str] = field(default_factory=set)
    true_flagged: set[str] = field(default_factory=set)
    #: fault id → event time of the first claim that detected it
    first_hit: dict[str, float] = field(default_factory=dict)


_FALSE_CLAIM_FIELDS = (
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
#: The fields of a flag that :func:`evaluate` reads (``id``: to count a redelivery once).
FLAG_FIELDS = ("id", *_FALSE_CLAIM_FIELDS)


def _score_claims(
    truth: Truth,
    flags: Iterable[Mapping[str, Any]],
    rows: dict[str, Row],
    early_s: float,
    grace_s: float,
) -> _Claims:
    """Match every warning/critical flag to the faults of its node (duplicates once)."""
    faults_by_node: dict[str, list[Fault]] = {}
    for fault in truth.faults:
        faults_by_node.setdefault(fault.node, []).append(fault)
    claims = _Claims()
    first_hit = claims.first_hit
    seen_ids: set[str] = set()
    for flag in flags:
        if flag.get("severity") == "info" or not flag.get("node"):
            continue
        fid = flag.get("id")
        if fid in seen_ids:
            continue  # a duplicate delivery of the same flag
        seen_ids.add(fid)
        claims.count += 1
        node, ts = flag["node"], float(flag["ts"])
        claims.flagged.add(node)
        matched: set[str] = set()
        for fault in faults_by_node.get(node, []):
            f_end = truth.end_ts if fault.end is None else fault.end
            if fault.onset - early_s <= ts <= f_end + grace_s:
                matched.add(fault.category)
                if fault.id not in first_hit or ts < first_hit[fault.id]:
                    first_hit[fault.id] = ts
        if matched:
            claims.true += 1
            claims.true_flagged.add(node)
            for name in matched:
                rows.setdefault(name, Row(name)).true_claims += 1
        else:
            category = str(flag.get("category"))
            rows.setdefault(category, Row(category)).false_claims += 1
            claims.false.append({k: flag.get(k) for k in _FALSE_CLAIM_FIELDS})
    return claims


def _score_faults(
    truth: Truth,
    first_hit: dict[str, float],
    rows: dict[str, Row],
    target_slowdown: float,
    seen: Mapping[str, float],
) -> list[dict[str, Any]]:
    """Count every fault in its category, ``all`` and (if it must be caught) ``target``,
    with its time to detect; return the faults no claim detected."""
    step_of_node: dict[str, float] = {}
    for job in truth.jobs:
        for node in job.nodes:
            step_of_node[node] = float(job.step_s_nominal or 0.0)
    missed: list[dict[str, Any]] = []
    for fault in truth.faults:
        reached = seen.get(fault.id, fault.reached(truth.end_ts))
        target = reached >= target_slowdown or fault.kind in MUST_CATCH_KINDS
        groups = [fault.category, "all"] + (["target"] if target else [])
        hit = first_hit.get(fault.id)
        onset = fault.reaches_at(target_slowdown)
        for name in groups:
            row = rows.setdefault(name, Row(name))
            row.faults += 1
            if hit is not None:
                row.detected += 1
                ttd = max(0.0, hit - onset)
                row.ttd_s.append(ttd)
                step_s = step_of_node.get(fault.node, 0.0)
                if step_s > 0:
                    row.ttd_steps.append(ttd / step_s)
        if hit is None:
            missed.append(fault.model_dump(include={"id", "node", "kind", "slowdown", "pattern"}))
    return missed


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

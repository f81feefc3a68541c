"""Fusion: one current suspicion per node, turned into few, stable, explained flags.

Several detectors see the same fault: a GPU that throttles thermally is hot (thermal), its
clock is low (clocks), its rank computes slowly (peer straggler) and arrives late at every
collective (C4D). :class:`NodeFusion` keeps the node's active findings and emits a flag only
when the node's suspicion *starts*, *escalates* (a higher severity) or is *explained* by a
more specific cause (a category of higher :data:`PRIORITY`, e.g. a straggler turns out to be
thermal). Every other finding only adds to the evidence of the next flag. A suspicion ends
when its detectors withdraw all their findings.

Each flag's id is :func:`guard.schemas.stable_id` of the finding that triggered it (node,
category, detector, component and the event time its evidence began), so replays and
duplicated deliveries give the same ids. Its evidence says why at a glance: a one-line
``summary``, the triggering detector's figures, and ``also``: the node's other active
findings.

Job-level findings (``node`` is ``None``: imbalance, communication hang, step-time
regression) pass through :class:`JobFusion`, which drops repeats of an active finding.

Example
-------
>>> from guard.detectors.findings import Finding
>>> from guard.detectors.fusion import NodeFusion
>>> fusion = NodeFusion("n1")
>>> slow = Finding("peer_straggler", "straggler", "warning", "n1", 100.0, 90.0, 0.12, gpu=4,
...                evidence={"metric": "compute_s", "slowdown_pct": 12.0})
>>> hot = Finding("thermal", "thermal", "warning", "n1", 105.0, 80.0, 1.4, gpu=4,
...               evidence={"metric": "temp_c", "above_peers_c": 17.0})
>>> low_clock = Finding("clocks", "clock", "warning", "n1", 106.0, 82.0, 0.2, gpu=4)
>>> [f.category for f in (fusion.update(slow), fusion.update(hot)) if f]
['straggler', 'thermal']
>>> fusion.update(low_clock) is None  # explained by the thermal suspicion already flagged
True
>>> fusion.update(hot) is None  # the same finding again: nothing new
True
>>> from guard.detectors.fusion import to_flag
>>> to_flag(hot).id == to_flag(hot).id  # stable: the same evidence gives the same id
True

"""

from __future__ import annotations

from typing import Any

from guard.schemas import SEVERITY_RANK, Flag, stable_id

from .findings import Finding

__all__ = ["PRIORITY", "JobFusion", "NodeFusion", "to_flag"]

#: How specific a category is as an explanation of a node's trouble (higher wins).
PRIORITY = {
    "gpu_error": 10,
    "comm_hang": 9,
    "link": 8,
    "nic": 7,
    "thermal": 6,
    "power": 5,
    "clock": 4,
    "comm_slow": 3,
    "straggler": 2,
    "imbalance": 1,
    "anomaly": 0,
}

_SUMMARY_KEYS = (
    "slowdown_pct",
    "late_pct_of_interval",
    "slower_than_peers_pct",
    "above_peers_c",
    "temp_c",
    "below_peers_pct",
    "error",
    "xid",
    "signal",
    "physical_errors_per_s",
    "retransmits_per_s",
    "speed_gbps",
    "hang",
)


def _summary(f: Finding) -> str:
    where = f.node or f.job or "job"
    parts = [f"{f.category} on {where}"]
    if f.component != "node":
        parts[0] += f" {f.component}"
    figures = ", ".join(
        f"{k}={f.evidence[k]}" for k in _SUMMARY_KEYS if f.evidence.get(k) not in (None, "")
    )
    if figures:
        parts.append(figures)
    parts.append(f"by {f.detector} since ts {f.since:.0f}")
    return "; ".join(parts)


def to_flag(f: Finding, also: list[dict[str, Any]] | None = None) -> Flag:
    """The wire flag of one finding (its id is stable over its evidence)."""
    evidence: dict[str, Any] = {"summary": _summary(f), **f.evidence}
    if also:
        evidence["also"] = also
    return Flag(
        ts=f.ts,
        node=f.node,
        job=f.job,
        id=stable_id(f.detector, f.category, f.node, f.job, f.component, f.severity, f.since),
        gpu=f.gpu,
        device=f.device,
        rank=f.rank,
        detector=f.detector,
        category=f.category,
        severity=f.severity,
        score=float(f.score),
        evidence=evidence,
        window_s=max(0.0, f.ts - f.since),
    )


class NodeFusion:
    """The current suspicion of one node (state: its active findings)."""

    __slots__ = ("active", "level", "node", "top")

    def __init__(self, node: str) -> None:
        self.node = node
        self.active: dict[tuple[str, str, str], Finding] = {}
        self.level = -1  # severity rank of the suspicion flagged so far; -1: none
        self.top = -1  # priority of the most specific category flagged so far

    def update(self, f: Finding) -> Flag | None:
        """Fold one finding into the node's suspicion; return a flag when it is news."""
        key = (f.detector, f.category, f.component)
        if f.clear:
            self.active.pop(key, None)
            if not any(a.severity != "info" for a in self.active.values()):
                self.level = -1
                self.top = -1
            return None
        previous = self.active.get(key)
        self.active[key] = f
        severity = SEVERITY_RANK[f.severity]
        if severity == 0:
            if previous is not None:
                return None
            return self._emit(f)
        priority = PRIORITY.get(f.category, 0)
        if severity > self.level or (severity == self.level and priority > self.top):
            self.level = max(self.level, severity)
            self.top = max(self.top, priority)
            return self._emit(f)
        return None

    def _emit(self, f: Finding) -> Flag:
        also = [
            {
                "category": a.category,
                "detector": a.detector,
                "component": a.component,
                "severity": a.severity,
                "score": a.score,
                "since_ts": a.since,
            }
            for k, a in sorted(self.active.items())
            if a is not f
        ]
        return to_flag(f, also)


class JobFusion:
    """Job-level findings of one job: each active finding is flagged once."""

    __slots__ = ("active", "job")

    def __init__(self, job: str) -> None:
        self.job = job
        self.active: set[tuple[str, str, str]] = set()

    def update(self, f: Finding) -> Flag | None:
        key = (f.detector, f.category, f.component)
        if f.clear:
            self.active.discard(key)
            return None
        if key in self.active and f.category != "anomaly":
            return None
        self.active.add(key)
        return to_flag(f)

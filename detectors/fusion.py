"""Fusion: one current suspicion per node, turned into few, stable, explained flags.

Several detectors see the same fault: a GPU that throttles thermally is hot (thermal), its
clock is low (clocks), its rank computes slowly (peer straggler) and arrives late at every
collective (C4D). :class:`NodeFusion` keeps the node's active findings and emits a flag only
when the node's suspicion *starts*, *escalates* (a higher severity) or is *explained* by a
more specific cause (a category of higher :data:`PRIORITY`, e.g. a straggler turns out to be
thermal), or when **new independent evidence** arrives on a node already under suspicion: a
claim on a component (GPU, NIC, rank) not yet claimed, or a materially worse slowdown
(``score`` at least :data:`WORSE_FACTOR` times the flagged one and :data:`WORSE_MIN` more)
of the same category on the same component — a second fault is never absorbed by the first
suspicion. Every other finding only adds to the evidence of the next flag. A suspicion ends
when its detectors withdraw all their claims.

Each flag's id is :func:`guard.schemas.stable_id` of the finding that triggered it (node,
category, detector, component and the event time its evidence began), so replays and
duplicated deliveries give the same ids. Its evidence says why at a glance: a one-line
``summary``, the triggering detector's figures, ``also``: the node's other active
findings, and ``agree``: every detector with an active finding on the same component or on
the node as a whole, info observations included (a thermal ``info``, a river ``anomaly``
score from ``peer_anomaly``), so corroboration is visible at a glance.

A job's detectors and a node's own are consumed from different partitions, at their own
paces, so a straggler finding can reach fusion before the node's thermal finding that
explains it. Such findings (:data:`EXPLAINABLE`) wait until the node's own stream on this
worker has reached their time (:meth:`NodeFusion.wait`): every kind of its telemetry seen
here, GPU and NIC, whose topics are consumed at their own paces too (a NIC partition ahead
of the GPU one must not let a straggler through before the thermal finding that explains
it). So a node's claims do not depend on which partition ran ahead, and a live worker
claims what a backtest of the same records claims. A node stream that *lags* (it still
advances) is waited for up to :data:`WAIT_MAX_S` of the runner's clock; one that has
*stopped* (no newer event time for :data:`WAIT_S`) lets the finding through after
:data:`WAIT_S`, and one that is absent at once. One that is *behind* (a live runner's read
offsets say its partitions hold records unread since the finding came, e.g. behind a flood
of dead letters) is waited for until they are read (the core's read barriers). A node's
findings that come while one waits queue behind it: fusion takes them in event-time order.

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

import math
from typing import Any

from guard.schemas import SEVERITY_RANK, Flag, stable_id

from .findings import UNPLACED, Finding

__all__ = [
    "EXPLAINABLE",
    "PRIORITY",
    "WAIT_MAX_S",
    "WAIT_S",
    "WORSE_FACTOR",
    "WORSE_MIN",
    "JobFusion",
    "NodeFusion",
    "to_flag",
]

#: A finding is materially worse than the flagged one of its component at this many times
#: its score, and at least :data:`WORSE_MIN` more (scores of slowdowns are fractions).
WORSE_FACTOR = 1.5
WORSE_MIN = 0.05

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


#: Findings a job's detectors make about a node that the node's own findings can explain
#: (a straggler that is a hot GPU): fusion takes them once the node's own stream has reached
#: their time (:meth:`NodeFusion.wait`), so the order in which two partitions are consumed
#: does not decide which claims a node gets.
EXPLAINABLE = frozenset({"straggler", "comm_slow"})
#: How long a finding waits for a node's stream that does not advance, on the runner's
#: clock (seconds): a node whose telemetry stopped is fused in arrival order.
WAIT_S = 5.0
#: The longest a finding waits for a node's stream that still advances but lags behind it.
WAIT_MAX_S = 30.0


class NodeFusion:
    """The current suspicion of one node (state: its active findings, what was flagged, and
    the job findings waiting for the node's own stream)."""

    __slots__ = ("active", "flagged", "level", "node", "top", "waiting")

    def __init__(self, node: str) -> None:
        self.node = node
        #: (detector, category, component, claim?, raised by a sequential test?) -> finding:
        #: a rule's hold and its CUSUM may both claim one GPU; each clears its own
        self.active: dict[tuple[str, str, str, bool, bool], Finding] = {}
        self.level = -1  # severity rank of the suspicion flagged so far; -1: none
        self.top = -1  # priority of the most specific category flagged so far
        self.flagged: dict[str, tuple[int, str, float]] = {}  # component -> priority, cat, score
        #: (finding, when it arrived on the runner's clock)
        self.waiting: list[tuple[Finding, float]] = []

    def wait(self, f: Finding, node_time: float | None, wall: float) -> bool:
        """Keep ``f`` for later if it is a job finding a node finding could explain and the
        node's own stream (``node_time``: the event time all its telemetry kinds on this worker
        have reached; None: no node telemetry here) has not reached its time yet, or if a
        finding of its time or earlier waits already (fusion stays in event-time order: a
        thermal finding that came after a waiting straggler of an earlier time must not be
        fused before it); True if kept."""
        unexplained = f.category in EXPLAINABLE and node_time is not None and f.ts > node_time
        if unexplained or any(w.ts <= f.ts for w, _ in self.waiting):
            self.waiting.append((f, wall))
            return True
        return False

    def release(
        self,
        node_time: float | None,
        moved: float,
        wall: float,
        every: bool = False,
        behind: bool = False,
        read_at: float = -math.inf,
    ) -> list[Flag]:
        """Fuse, in event-time order, the waiting findings up to the first that must wait on:
        a job finding the node's stream (``node_time``) has not reached, whose node's stream
        has advanced (last at ``moved``) within :data:`WAIT_S` and that has not waited
        :data:`WAIT_MAX_S` (on the runner's clock); ``every``: all of them. While the node's
        partitions are unread up to where they stood when a finding came (``behind``; read
        through at ``read_at``), the stream is behind, not quiet, and only its reaching a
        finding's time releases it."""
        due: list[Finding] = []
        keep: list[tuple[Finding, float]] = []
        for n, (f, at) in enumerate(queue := sorted(self.waiting, key=lambda e: e[0].ts)):
            start = max(at, read_at)
            ready = (
                every
                or f.category not in EXPLAINABLE
                or (node_time is not None and f.ts <= node_time)
                or (
                    not behind
                    and (wall - max(start, moved) >= WAIT_S or wall - start >= WAIT_MAX_S)
                )
            )
            if not ready:
                keep = queue[n:]
                break
            due.append(f)
        self.waiting = keep
        if not due:
            return []
        flags = []
        for f in due:
            if (flag := self.update(f)) is not None:
                flags.append(flag)
        return flags

    def update(self, f: Finding) -> Flag | None:
        """Fold one finding into the node's suspicion; return a flag when it is news."""
        severity = SEVERITY_RANK[f.severity]
        key = (
            f.detector,
            f.category,
            f.component,
            severity > 0,
            f.evidence.get("raised_by") == "cusum",
        )
        if f.clear:
            self.active.pop(key, None)
            if not any(k[3] for k in self.active):
                self.level = -1
                self.top = -1
                self.flagged.clear()
            return None
        previous = self.active.get(key)
        self.active[key] = f
        if severity == 0:
            if previous is not None:
                return None
            return self._emit(f)
        priority = PRIORITY.get(f.category, 0)
        news = severity > self.level or (severity == self.level and priority > self.top)
        if not news:
            news = self._independent(f, priority)
        if not news:
            return None
        self.level = max(self.level, severity)
        self.top = max(self.top, priority)
        old = self.flagged.get(f.component)
        if old is None or priority >= old[0]:
            self.flagged[f.component] = (
                priority,
                f.category,
                max(f.score, old[2] if old and old[1] == f.category else 0.0),
            )
        return self._emit(f)

    def _independent(self, f: Finding, priority: int) -> bool:
        """New evidence on a node already under suspicion: a new component, a more specific
        cause on a flagged one, or a materially worse slowdown of the same category."""
        flagged = self.flagged
        if f.component == "node" or UNPLACED in f.evidence:
            # a node-wide finding, or one on a rank whose GPU is not known because its steps,
            # which place it, were not read yet: explained by any flagged component (a rank
            # whose steps name no GPU is a component of its own, ``rankN``)
            return not flagged
        old = flagged.get(f.component)
        if old is None:
            return True
        if priority > old[0]:
            return True
        return (
            f.category == old[1]
            and f.score >= WORSE_FACTOR * old[2]
            and f.score - old[2] >= WORSE_MIN
        )

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
        agree = sorted(
            {a.detector for a in self.active.values() if a.component in (f.component, "node")}
            | {f.detector}
        )
        flag = to_flag(f, also)
        flag.evidence["agree"] = list(agree)
        return flag


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

"""Peer straggler detection: is each rank keeping up with its peers?

In synchronous training every rank's wall step time is the same (everyone waits for the
slowest), so a slow rank shows in ``compute_s``, the time it was busy before entering the
step's synchronising collective. Per job, per pipeline stage and per step, each rank's
residual is ``compute_s / median(peers) - 1``;
:class:`~guard.detectors.persistent_deviation.TrackerTable`
turns the residuals into a claim only when the slowness persists. A whole-job slowdown
(checkpoint, data stall) moves the median with it and cancels out; ranks of different
pipeline stages are never compared, and where ranks report no stage, ranks persistently
slow together on several nodes form their own group (:mod:`~guard.detectors.peer_groups`):
group medians that differ by more than ``imbalance_ratio`` give one job-level ``imbalance``
info flag, while one rank slow within its own group stays a claim. A claimed rank whose
slowdown becomes materially worse (``worse_factor`` times the reported one, and 5 points
more) is reported again, so a second fault on a suspect GPU is not absorbed.

A step is closed (evaluated) when all ranks seen in earlier steps have reported, or when a
message ``close_lag`` steps later arrives, so late or missing ranks and slightly
out-of-order input are tolerated. Ranks that report no ``compute_s`` are left to the
collective arrival-order detector (:mod:`guard.detectors.collective`).

Parameters
----------
job
    The job this detector watches (one instance per job).
rule
    Persistence thresholds (:class:`~guard.detectors.persistent_deviation.PersistenceRule`).
min_peers
    Smallest stage group that is compared.
close_lag
    Steps after which a step is closed even if ranks are missing.
imbalance_ratio
    Ratio of the slowest to the fastest stage median that is reported as imbalance.
critical_slowdown
    Mean slowdown from which a straggler is ``critical`` rather than ``warning``.

References
----------
Guard: "Scalable Straggler Detection and Node Health Management for Large-Scale Training"
(MLSys 2026). NVIDIA Resiliency Extension straggler detection (relative scores).

Example
-------
>>> from guard.schemas import StepTiming
>>> from guard.detectors.peer_straggler import PeerStragglerDetector
>>> det = PeerStragglerDetector("job-a")
>>> found = []
>>> for step in range(12):
...     for rank in range(8):
...         slow = 1.10 if (rank == 5 and step >= 3) else 1.0
...         found += det.update(StepTiming(ts=1000.0 + 2 * step, node=f"n{rank}", job="job-a",
...             rank=rank, step=step, step_s=2.2, compute_s=1.5 * slow * (1 + 0.003 * (rank % 3))))
>>> [(f.node, f.category, f.severity, f.evidence["slowdown_pct"]) for f in found]
[('n5', 'straggler', 'warning', 10.3)]

"""

from __future__ import annotations

from typing import Any

import numpy as np

from guard.schemas import StepTiming

from .findings import Finding, imbalance_info
from .job_columns import StepColumns
from .peer_groups import LevelTracker
from .persistent_deviation import GroupNoise, PersistenceRule, SequentialTest, TrackerTable
from .robust import median

__all__ = ["PeerStragglerDetector"]


class PeerStragglerDetector:
    """Per-job peer comparison of ranks' busy time, grouped by pipeline stage."""

    name = "peer_straggler"

    def __init__(
        self,
        job: str,
        rule: PersistenceRule | None = None,
        min_peers: int = 4,
        close_lag: int = 2,
        imbalance_ratio: float = 1.05,
        critical_slowdown: float = 0.5,
        structure_gap: float = 0.02,
        min_group: int = 8,
        worse_factor: float = 2.0,
    ) -> None:
        self.structure_gap = structure_gap
        self.min_group = min_group  # smallest structural group: a stage, a rack
        self.worse_factor = worse_factor
        self.level = LevelTracker()  # smoothed slowness against the job (stage unknown)
        self.group_of: dict[int, tuple[tuple[str, int | None], int]] = {}
        self.reported: dict[int, float] = {}  # claimed rank -> slowdown last reported
        self.job = job
        self.rule = rule or PersistenceRule(sequential=SequentialTest())
        self.min_peers = min_peers
        self.close_lag = close_lag
        self.imbalance_ratio = imbalance_ratio
        self.critical_slowdown = critical_slowdown
        self.pending: dict[int, dict[int, float]] = {}
        self.pending_ts: dict[int, float] = {}
        self.ranks: dict[int, tuple[str, int | None, int | None]] = {}  # node, gpu, stage
        #: each rank's dense id, and by it the code of its node and its stage (-1: none)
        self.slot_of: dict[int, int] = {}
        self.placed = np.full((0, 2), -2, dtype=np.int64)
        self.node_codes: dict[str, int] = {}
        self.trackers = TrackerTable(self.rule)
        self.tracker_slot: dict[int, int] = {}  # rank -> its slot in ``trackers``
        self.noise: dict[tuple[str, int | None], GroupNoise] = {}
        self.expected = 0
        self.closed_through = -1
        self.imbalanced = False

    def update(self, message: StepTiming) -> list[Finding]:
        """Add one rank's step timing (:meth:`add_steps` of one row)."""
        return self.add_steps(StepColumns.of_records([(message, [message])]))

    def add_steps(self, cols: StepColumns) -> list[Finding]:
        """Add a poll's step reports of the job; return findings made by the steps they closed.

        A run of reports of one step (a node's batch) is added at once; a step closes once
        as many ranks reported it as the job's largest step so far, or when a step
        ``close_lag`` later is seen."""
        self._place(cols)
        found: list[Finding] = []
        has = ~np.isnan(cols.compute_s)
        pending = self.pending
        for a, b in cols.runs:
            step = int(cols.step[a])
            keep = has[a:b]
            if step <= self.closed_through or not keep.any():
                continue
            row = pending.get(step)
            if row is None:
                row = pending[step] = {}
            ranks, values = cols.rank[a:b][keep].tolist(), cols.compute_s[a:b][keep].tolist()
            row.update(zip(ranks, values, strict=True))
            newest = float(cols.ts[a:b][keep].max())
            if newest > self.pending_ts.get(step, -1.0):
                self.pending_ts[step] = newest
            if self.expected and len(row) >= self.expected:
                found += self._close_through(step)
            if len(pending) > 1 and step - min(pending) >= self.close_lag:
                found += self._close_through(step - self.close_lag)
        return found

    def _place(self, cols: StepColumns) -> None:
        """Each reporting rank's node, GPU and stage; a rank that moved (another node or
        stage) starts a fresh history. Compared as arrays over dense rank ids; only the
        rare rank that moved is looked at one by one."""
        slot_of = self.slot_of
        ranks = cols.rank.tolist()
        for r in set(ranks) - slot_of.keys():
            slot_of[r] = len(slot_of)
        slots = np.array([slot_of[r] for r in ranks], dtype=np.intp)
        if len(slot_of) > len(self.placed):
            grown = np.full((max(len(slot_of), 2 * len(self.placed)), 2), -2, dtype=np.int64)
            grown[: len(self.placed)] = self.placed
            self.placed = grown
        codes = np.array(
            [self.node_codes.setdefault(n, len(self.node_codes)) for n in cols.nodes],
            dtype=np.int64,
        )[cols.node]
        moved = (self.placed[slots, 0] != codes) | (self.placed[slots, 1] != cols.stage)
        if not moved.any():
            return
        for i in np.flatnonzero(np.isin(cols.rank, cols.rank[moved])).tolist():
            rank, stage, gpu = ranks[i], int(cols.stage[i]), int(cols.gpu[i])
            if self.placed[slots[i], 0] != codes[i] or self.placed[slots[i], 1] != stage:
                self.placed[slots[i]] = (codes[i], stage)
                node = cols.nodes[cols.node[i]]
                self.ranks[rank] = (node, None if gpu < 0 else gpu, None if stage < 0 else stage)
                self._restart(rank)  # a rank that moved starts a fresh history

    def tick(self, now: float) -> list[Finding]:
        return []  # steps close on later steps' messages, not on time

    def flush(self) -> list[Finding]:
        """Close every pending step (end of input)."""
        if not self.pending:
            return []
        return self._close_through(max(self.pending))

    def _close_through(self, last: int) -> list[Finding]:
        found: list[Finding] = []
        for step in sorted(s for s in self.pending if s <= last):
            row = self.pending.pop(step)
            ts = self.pending_ts.pop(step)
            self.closed_through = max(self.closed_through, step)
            self.expected = max(self.expected, len(row))
            found += self._evaluate(step, ts, row)
        return found

    def _groups(self, row: dict[int, float]) -> dict[tuple[str, int | None], list[int]]:
        """The step's ranks by the work they do: pipeline stage where known, else structure."""
        ranks = self.ranks
        groups: dict[tuple[str, int | None], list[int]] = {}
        unknown = []
        for rank in row:
            stage = ranks[rank][2]
            if stage is None:
                unknown.append(rank)
            else:
                groups.setdefault(("stage", stage), []).append(rank)
        if len(unknown) < self.min_peers:
            if unknown:
                groups[("late", 0)] = unknown
            return groups
        center = median([row[r] for r in unknown])
        if center > 0.0:
            self.level.update({r: row[r] / center - 1.0 for r in unknown})
        node_of = {r: ranks[r][0] for r in unknown}
        found = self.level.groups(unknown, node_of, self.structure_gap, self.min_group)
        for rank in unknown:
            groups.setdefault(("late", found[rank]), []).append(rank)
        return groups

    def _restart(self, rank: int) -> None:
        slot = self.tracker_slot.get(rank)
        if slot is not None:
            self.trackers.reset(slot)

    def _slots(self, key: tuple[str, int | None], members: list[int]) -> np.ndarray:
        """The members' slots in ``trackers``, new ones for ranks never seen."""
        table, slot_of, group_of = self.trackers, self.tracker_slot, self.group_of
        where = (key, self.level.version)
        slots = np.empty(len(members), dtype=np.intp)
        for i, rank in enumerate(members):
            slot = slot_of.get(rank)
            if slot is None:
                slot = slot_of[rank] = table.new_slot()
            elif group_of.get(rank) != where:
                if not table.active(slot):
                    table.reset(slot)  # a rank that changed groups starts afresh among its peers
                elif rank in self.reported:
                    # a claimed one keeps its claim (its own lateness may have moved it), but
                    # its residuals against new peers are no measure of a worse slowdown
                    self.reported[rank] = float("inf")
            group_of[rank] = where
            slots[i] = slot
        return slots

    def _evaluate(self, step: int, ts: float, row: dict[int, float]) -> list[Finding]:
        found: list[Finding] = []
        stage_medians: dict[object, float] = {}
        for key, members in self._groups(row).items():
            if len(members) < self.min_peers:
                continue
            values = np.array([row[r] for r in members])
            center = float(np.median(values))
            if center <= 0.0:
                continue
            stage_medians[key[1] if key[0] == "stage" else f"late{key[1]}"] = center
            slots = self._slots(key, members)
            noise = self.noise.get(key)
            if noise is None:
                noise = self.noise[key] = GroupNoise()
            for i, event in self.trackers.judge(noise, slots, values / center - 1.0, ts):
                rank = members[i]
                found.append(self._finding(event, rank, step, ts, int(slots[i]), center, row[rank]))
            found += self._worse(members, slots, step, ts, center, row)
        found += self._imbalance(step, ts, stage_medians)
        return found

    def _worse(
        self,
        members: list[int],
        slots: np.ndarray,
        step: int,
        ts: float,
        center: float,
        row: dict[int, float],
    ) -> list[Finding]:
        """Claimed ranks whose slowdown became materially worse than the one reported."""
        if not self.reported:
            return []
        found = []
        table = self.trackers
        for rank, slot in zip(members, slots.tolist(), strict=True):
            old = self.reported.get(rank)
            if old is None or not table.active(slot):
                continue
            mean = table.slow_mean(slot)
            if mean >= self.worse_factor * old and mean - old >= 0.05:
                f = self._finding("raise", rank, step, ts, slot, center, row[rank])
                f.since = ts  # new evidence: a flag of its own
                f.evidence["previous_slowdown_pct"] = round(100.0 * old, 1)
                found.append(f)
        return found

    def _finding(
        self,
        event: str,
        rank: int,
        step: int,
        ts: float,
        slot: int,
        center: float,
        value: float,
    ) -> Finding:
        node, gpu, stage = self.ranks[rank]
        table = self.trackers
        mean = table.slow_mean(slot)
        since = table.since_ts(slot)
        if event == "raise":
            self.reported[rank] = mean
        else:
            self.reported.pop(rank, None)
        severity = "critical" if mean >= self.critical_slowdown else "warning"
        evidence: dict[str, Any] = {
            "metric": "compute_s",
            "slowdown_pct": round(100.0 * mean, 1),
            "relative_score": round(1.0 / (1.0 + mean), 3),
            "own_baseline_pct": round(100.0 * table.baseline(slot), 1),
            "peer_median_s": round(center, 6),
            "rank_s": round(value, 6),
            "slow_steps": f"{table.slow_rounds(slot)}/{table.filled(slot)}",
            "pp_stage": stage,
            "step": step,
            "since_ts": since,
        }
        if self.rule.sequential is not None:
            evidence.update(table.sequential_evidence(slot, self.rule.sequential))
        return Finding(
            detector=self.name,
            category="straggler",
            severity=severity,
            node=node,
            ts=ts,
            since=since,
            score=round(mean, 4),
            job=self.job,
            gpu=gpu,
            rank=rank,
            evidence=evidence,
            clear=event == "clear",
        )

    def _imbalance(self, step: int, ts: float, stage_medians: dict[object, float]) -> list[Finding]:
        if len(stage_medians) < 2:
            return []
        low, high = min(stage_medians.values()), max(stage_medians.values())
        ratio = high / low if low > 0 else 1.0
        # a little hysteresis, so a ratio that hovers at the threshold does not flap
        now = ratio >= (self.imbalance_ratio - 0.02 if self.imbalanced else self.imbalance_ratio)
        if now == self.imbalanced:
            return []
        self.imbalanced = now
        evidence: dict[str, Any] = {
            "metric": "compute_s",
            "stage_medians_s": {str(k): round(v, 6) for k, v in sorted(stage_medians.items())},
            "ratio": round(ratio, 3),
            "step": step,
        }
        return [imbalance_info(self.name, self.job, ts, round(ratio, 3), evidence, not now)]

"""Collective homogeneity (C4D): every collective is a synchronisation point, so compare ranks.

In a healthy bulk-synchronous job the ranks of one communicator enter each collective at
about the same time and every connection moves its bytes at about the same speed. Per job,
per communicator and sequence number, this detector finds:

* **non-communication slow** — the rank that persistently arrives late *within its own
  group*: its lateness ``(arrive - median arrive of its group) / typical interval between
  collectives``, on a clock common to all hosts (see *host clocks* below), goes through the
  same persistence rule as
  :mod:`~guard.detectors.peer_straggler` (category ``straggler``); this is also the fallback
  when ranks report no ``compute_s``. Groups are the ranks that do the same work
  (:mod:`~guard.detectors.peer_groups`): the pipeline stage from the job's step telemetry
  (:meth:`observe`), or, where unknown, ranks persistently late together on several nodes.
  A group late as a whole at a collective that spans groups is structure, not a fault: a
  job-level ``imbalance`` info finding;
* **communication slow** — connections slower per byte than the op's median; a node whose
  connections to other nodes are *all* persistently slow (its fastest connection is slower
  than its peers' — a node's NIC, not one neighbour's) is at fault (category ``comm_slow``);
* **hang** — an op that has not ended ``hang_factor`` times the communicator's typical
  duration (and at least ``hang_min_s``) after its first rank arrived. Ranks that never
  arrived are at fault (``comm_hang``, critical, on their nodes: a non-communication hang);
  when every rank arrived but some never left, it is a communication hang of the job, and
  the job-level flag lists the ranks stuck inside.

**Host clocks.** Every timestamp a rank reports comes from its host's clock, and hosts
disagree: NTP keeps healthy ones within milliseconds, a loaded or misconfigured one drifts by
hundreds of milliseconds. Judged on raw timestamps, every rank of a host whose clock is
0.4 s ahead "arrives" 0.4 s late at every collective (8 % of a 5 s step). But all ranks leave
a synchronising collective (all-reduce, all-gather, reduce-scatter, barrier: the last arrival
releases everyone) at about the same true time, so in each such op a host's offset against
the op's median rank is ``median over its ranks of (end_ts - median end_ts)``; arrivals are
corrected by it before anything is compared. That is the same as comparing each rank's wait
inside the op on its own clock (``end_ts - arrive_ts``: a late rank waits less), robust to
one rank's end jitter. Ops without a common end (send, recv, broadcast) and ranks whose end
is missing use the host's offset smoothed over the communicator's earlier ops; a host never
seen leaving an op with a common end is not corrected. A claim says the offset it used
(evidence ``host_offset_s``, ahead positive); agents' own clock notices are separate ``info``
observations, untouched here.

Call :meth:`tick` with the current event time (the engine does) so hangs are found while no
messages of the job arrive.

Parameters
----------
job
    The job this detector watches.
rule
    Persistence thresholds for late arrival.
link_rule
    Persistence thresholds for slow connections.
close_lag
    Sequence numbers after which an op is closed even if ranks are missing.
hang_factor, hang_min_s
    An op is hung after ``max(hang_min_s, hang_factor * typical duration)`` seconds.

References
----------
Dong et al., "Boosting Large-scale Parallel Training Efficiency with C4: A
Communication-Driven Approach" (HPCA 2025): C4D classifies communication hang,
non-communication hang, communication slow and non-communication slow.

Example
-------
>>> from guard.schemas import CollectiveTiming, StepTiming
>>> from guard.detectors.collective import CollectiveHomogeneityDetector
>>> det = CollectiveHomogeneityDetector("job-a")
>>> found = []
>>> for seq in range(12):
...     t0 = 1000.0 + 2.0 * seq
...     for rank in range(8):
...         late = 0.2 if (rank == 2 and seq >= 2) else 0.002 * (rank % 3)
...         found += det.update(CollectiveTiming(ts=t0 + 0.6, node=f"n{rank}", job="job-a",
...             rank=rank, comm="dp", op="allreduce", seq=seq, bytes=1 << 20,
...             arrive_ts=t0 + late, end_ts=t0 + 0.5))
>>> [(f.node, f.category, f.evidence["metric"]) for f in found]
[('n2', 'straggler', 'arrival_lateness')]
>>> found = det.tick(1100.0)  # the next op never started: nothing is hung
>>> found
[]

"""

from __future__ import annotations

from typing import Any

import numpy as np

from guard.schemas import CollectiveTiming, StepTiming

from .findings import UNPLACED, Finding, imbalance_info
from .job_columns import CollectiveColumns, StepColumns
from .peer_groups import LevelTracker
from .persistent_deviation import GroupNoise, PersistenceRule, TrackerTable
from .robust import median

__all__ = ["CollectiveHomogeneityDetector"]

_SMOOTHING = 0.1
#: Ops every rank leaves at about the same true time (the last arrival releases all): their
#: common end measures each host's clock offset. Names compared lower case, without ``_``/``-``.
_COMMON_END = frozenset({"allreduce", "allgather", "reducescatter", "barrier"})


def common_end(op: str) -> bool:
    """Does every rank leave op ``op`` at about the same true time?

    >>> common_end("all_reduce"), common_end("AllGather"), common_end("send")
    (True, True, False)
    """
    return op.lower().replace("_", "").replace("-", "") in _COMMON_END


class _PendingOp:
    """One op (communicator, sequence number) while its ranks report."""

    __slots__ = ("arrive", "common", "conns", "end", "first_arrive", "hung", "left", "ts")

    def __init__(self, common: bool = False) -> None:
        self.common = common  # every rank leaves it at about the same true time
        self.arrive: dict[int, float] = {}
        self.end: dict[int, float | None] = {}
        self.conns: dict[tuple[int, int], float] = {}  # (rank, peer) -> seconds per byte
        self.first_arrive = float("inf")
        self.left: set[int] = set()  # ranks that reported leaving it
        self.hung = False
        self.ts = 0.0


class CollectiveHomogeneityDetector:
    """Per-job C4D-style comparison of collective arrival, connection speed and completion."""

    name = "c4d"

    def __init__(
        self,
        job: str,
        rule: PersistenceRule | None = None,
        link_rule: PersistenceRule | None = None,
        close_lag: int = 2,
        hang_factor: float = 20.0,
        hang_min_s: float = 20.0,
        min_peers: int = 4,
        structure_gap: float = 0.02,
        min_group: int = 8,
        imbalance_late: float = 0.02,
    ) -> None:
        self.job = job
        self.structure_gap = structure_gap
        self.min_group = min_group  # smallest structural group: a stage, a rack
        self.imbalance_late = imbalance_late
        self.stage_of: dict[int, int | None] = {}  # rank -> pipeline stage (step telemetry)
        self.gpu_of: dict[int, int] = {}
        self.level: dict[str, LevelTracker] = {}  # ranks' smoothed lateness against the job
        self.imbalanced: dict[str, bool] = {}
        self.group_of: dict[tuple[str, int], str] = {}
        self.rule = rule or PersistenceRule(min_residual=0.02, abs_residual=0.06)
        self.link_rule = link_rule or PersistenceRule(min_residual=0.15, abs_residual=0.3)
        self.close_lag = close_lag
        self.hang_factor = hang_factor
        self.hang_min_s = hang_min_s
        self.min_peers = min_peers
        self.ops: dict[tuple[str, int], _PendingOp] = {}
        self.oldest: dict[str, int] = {}  # comm -> its lowest pending seq (an op in ``ops``)
        self.members: dict[str, set[int]] = {}
        self.closed_through: dict[str, int] = {}
        self.expected: dict[str, int] = {}
        self.last_center: dict[str, float] = {}
        self.interval: dict[str, float] = {}
        self.duration: dict[str, float] = {}
        self.noise: dict[str, GroupNoise] = {}
        self.link_noise = GroupNoise()
        self.node_of: dict[int, str] = {}
        self.late = TrackerTable(self.rule)  # each (comm, rank)'s arrivals
        self.late_slot: dict[tuple[str, int], int] = {}
        self.slow_nodes = TrackerTable(self.link_rule)  # each node's connections
        self.node_slot: dict[str, int] = {}
        #: comm -> host -> its clock offset against the comm's median rank, smoothed over ops
        self.host_offset: dict[str, dict[str, float]] = {}

    # --- input -----------------------------------------------------------------------------

    def observe(self, message: StepTiming) -> None:
        """Learn a rank's pipeline stage and GPU (:meth:`observe_steps` of one row)."""
        self.observe_steps(StepColumns.of_records([(message, [message])]))

    def observe_steps(self, cols: StepColumns) -> None:
        """Learn ranks' pipeline stages and GPUs from the job's step reports."""
        ranks = cols.rank.tolist()
        stages = [None if s < 0 else s for s in cols.stage.tolist()]
        self.stage_of.update(zip(ranks, stages, strict=True))
        known = cols.gpu >= 0
        self.gpu_of.update(zip(cols.rank[known].tolist(), cols.gpu[known].tolist(), strict=True))

    def update(self, message: CollectiveTiming) -> list[Finding]:
        """Add one rank's timing of one op (:meth:`add_collectives` of one row)."""
        return self.add_collectives(CollectiveColumns.of_records([(message, [message])]))

    def add_collectives(self, cols: CollectiveColumns) -> list[Finding]:
        """Add a poll's collective reports of the job, a run of one op's reports (a node's
        batch) at a time; return findings of the ops they closed. An op closes once as many
        ranks left it as the communicator's largest op so far, or when an op ``close_lag``
        later is seen."""
        ranks = cols.rank.tolist()
        self.node_of.update(zip(ranks, [cols.nodes[k] for k in cols.node.tolist()], strict=True))
        ended = ~np.isnan(cols.end_ts)
        # an end of nan: the rank is still inside (None, as a record says it)
        ends = np.where(ended, cols.end_ts, np.array(None)).tolist()
        found: list[Finding] = []
        for (a, b), comm, name in zip(cols.runs, cols.comms, cols.ops, strict=True):
            seq = int(cols.seq[a])
            members = self.members.get(comm)
            if members is None:
                members = self.members[comm] = set()
            members.update(ranks[a:b])
            if seq <= self.closed_through.get(comm, -1):
                continue
            key = (comm, seq)
            op = self.ops.get(key)
            if op is None:
                op = self.ops[key] = _PendingOp(common_end(name))
                oldest = self.oldest.get(comm)
                if oldest is None or seq < oldest:
                    self.oldest[comm] = seq
            op.arrive.update(zip(ranks[a:b], cols.arrive_ts[a:b].tolist(), strict=True))
            op.first_arrive = min(op.first_arrive, float(cols.arrive_ts[a:b].min()))
            op.end.update(zip(ranks[a:b], ends[a:b], strict=True))
            op.left.update(cols.rank[a:b][ended[a:b]].tolist())
            op.ts = max(op.ts, float(cols.ts[a:b].max()))
            for i in np.flatnonzero(ended[a:b]).tolist():
                if cols.peers[a + i]:
                    self._add_connections(op, ranks[a + i], cols.peers[a + i])
            expected = self.expected.get(comm, 0)
            if expected and len(op.left) >= expected:
                found += self._close(comm, seq)
            if len(self.ops) > 1 and seq - self.oldest.get(comm, seq) >= self.close_lag:
                found += self._close(comm, seq - self.close_lag)
        return found

    @staticmethod
    def _add_connections(op: _PendingOp, rank: int, peers: list[Any]) -> None:
        """The rank's connections in ``op``: the slowest seconds per byte seen per pair."""
        conns = op.conns
        for peer in peers:
            if peer.bytes > 0 and peer.duration_s > 0.0:
                pair = (rank, peer.rank) if rank < peer.rank else (peer.rank, rank)
                spb = peer.duration_s / peer.bytes
                old = conns.get(pair)
                if old is None or spb > old:  # max(conns.get(pair, 0.0), spb): spb >= 0
                    conns[pair] = spb

    def tick(self, now: float) -> list[Finding]:
        """Look for hung ops at event time ``now``."""
        found: list[Finding] = []
        for (comm, seq), op in self.ops.items():
            if op.hung:
                continue
            limit = max(self.hang_min_s, self.hang_factor * self.duration.get(comm, 0.0))
            if now - op.first_arrive > limit:
                op.hung = True
                found += self._hang(comm, seq, op, now)
        return found

    def flush(self) -> list[Finding]:
        """Close every pending op that is not hung (end of input)."""
        found: list[Finding] = []
        for comm, seq in sorted(self.ops):
            if (comm, seq) in self.ops and not self.ops[(comm, seq)].hung:
                found += self._close(comm, seq)
        return found

    # --- evaluation ------------------------------------------------------------------------

    def _close(self, comm: str, last: int) -> list[Finding]:
        found: list[Finding] = []
        for key in sorted(k for k in self.ops if k[0] == comm and k[1] <= last):
            op = self.ops.pop(key)
            self.closed_through[comm] = max(self.closed_through.get(comm, -1), key[1])
            self.expected[comm] = max(self.expected.get(comm, 0), len(op.arrive))
            if op.hung:
                continue
            found += self._arrivals(comm, key[1], op)
            found += self._connections(comm, key[1], op)
        left = [s for c, s in self.ops if c == comm]
        if left:
            self.oldest[comm] = min(left)
        else:
            self.oldest.pop(comm, None)
        return found

    def _host_offsets(self, comm: str, op: _PendingOp) -> dict[str, float]:
        """Each host's clock offset in ``op`` (s, ahead positive), against the op's median rank.

        From this op's common end where the host's ranks left it, else smoothed over the
        communicator's earlier ops; hosts with neither are absent (not corrected).
        """
        smoothed = self.host_offset.get(comm)
        if smoothed is None:
            smoothed = self.host_offset[comm] = {}
        offsets = dict(smoothed)
        if not op.common:
            return offsets
        ends = {r: e for r, e in op.end.items() if e is not None}
        if len(ends) < self.min_peers:
            return offsets
        common = median(list(ends.values()))
        by_host: dict[str, list[float]] = {}
        node_of = self.node_of
        for rank, end in ends.items():
            by_host.setdefault(node_of[rank], []).append(end - common)
        for host, deltas in by_host.items():
            here = offsets[host] = median(deltas)
            prev = smoothed.get(host)
            smoothed[host] = here if prev is None else prev + _SMOOTHING * (here - prev)
        return offsets

    def _arrivals(self, comm: str, seq: int, op: _PendingOp) -> list[Finding]:
        offsets = self._host_offsets(comm, op)
        node_of = self.node_of
        if offsets:  # every time on the clock of the op's median rank
            op.arrive = {r: t - offsets.get(node_of[r], 0.0) for r, t in op.arrive.items()}
            op.end = {
                r: None if e is None else e - offsets.get(node_of[r], 0.0)
                for r, e in op.end.items()
            }
        arrive = op.arrive
        ends = [e for e in op.end.values() if e is not None]
        center = median(list(arrive.values()))
        if ends:
            dur = max(ends) - center
            prev = self.duration.get(comm)
            self.duration[comm] = dur if prev is None else prev + _SMOOTHING * (dur - prev)
        last_center = self.last_center.get(comm)
        self.last_center[comm] = center
        if last_center is None or center <= last_center:
            return []
        gap = center - last_center
        prev_gap = self.interval.get(comm)
        # the median gap is robust to a skipped op; smoothing keeps it stable across steps
        interval = (
            gap if prev_gap is None else prev_gap + _SMOOTHING * (min(gap, 3 * prev_gap) - prev_gap)
        )
        self.interval[comm] = interval
        if len(arrive) < self.min_peers or interval <= 0.0:
            return []
        found: list[Finding] = []
        groups = self._groups(comm, arrive, center, interval)
        for key, members in groups.items():
            found += self._judge_group(
                comm, seq, op, f"{comm}#{key[0]}{key[1]}", members, interval, offsets
            )
        found += self._imbalance(comm, seq, op, groups, interval)
        return found

    def _groups(
        self, comm: str, arrive: dict[int, float], center: float, interval: float
    ) -> dict[tuple[str, int | None], list[int]]:
        """The op's ranks by the work they do: pipeline stage where known, else structure."""
        level = self.level.get(comm)
        if level is None:
            level = self.level[comm] = LevelTracker()
        level.update({rank: (t - center) / interval for rank, t in arrive.items()})
        stage_of = self.stage_of
        known = {r: stage_of[r] for r in arrive if stage_of.get(r) is not None}
        groups: dict[tuple[str, int | None], list[int]] = {}
        if len(known) == len(arrive):
            for rank in arrive:
                groups.setdefault(("stage", known[rank]), []).append(rank)
            return groups
        found = level.groups(list(arrive), self.node_of, self.structure_gap, self.min_group)
        for rank in arrive:
            groups.setdefault(("late", found[rank]), []).append(rank)
        return groups

    def _judge_group(
        self,
        comm: str,
        seq: int,
        op: _PendingOp,
        noise_key: str,
        members: list[int],
        interval: float,
        offsets: dict[str, float],
    ) -> list[Finding]:
        arrive = op.arrive
        if len(members) < self.min_peers:
            return []
        times = np.array([arrive[r] for r in members])
        residuals = (times - np.median(times)) / interval
        table = self.late
        level = self.level.get(comm)
        version = level.version if level is not None else 0
        slots = self._slots(comm, members, f"{noise_key}@{version}")
        noise = self.noise.get(noise_key)
        if noise is None:
            noise = self.noise[noise_key] = GroupNoise()
        context = (comm, seq, op.ts, len(members), interval, offsets)
        return [
            self._finding(context, members[i], int(slots[i]), event)
            for i, event in table.judge(noise, slots, residuals, op.ts)
        ]

    def _slots(self, comm: str, members: list[int], where: str) -> np.ndarray:
        """Each member's slot in the lateness table; a rank that changed groups (``where``:
        its noise group and level version) starts a fresh history among its new peers (a
        claimed one keeps its claim: its own lateness may have moved it)."""
        table, slot_of, group_of = self.late, self.late_slot, self.group_of
        slots = np.empty(len(members), dtype=np.intp)
        for i, rank in enumerate(members):
            key = (comm, rank)
            slot = slot_of.get(key)
            if slot is None:
                slot = slot_of[key] = table.new_slot()
            elif group_of.get(key) != where and not table.active(slot):
                table.reset(slot)
            group_of[key] = where
            slots[i] = slot
        return slots

    def _finding(
        self,
        context: tuple[str, int, float, int, float, dict[str, float]],
        rank: int,
        slot: int,
        event: str,
    ) -> Finding:
        """A rank's straggler claim (or its clear) with the evidence of its window;
        ``context``: the op's communicator, sequence number, time, group size, interval
        and host clock offsets."""
        comm, seq, ts, group_ranks, interval, offsets = context
        table = self.late
        mean = table.slow_mean(slot)
        since = table.since_ts(slot)
        evidence: dict[str, Any] = {
            "metric": "arrival_lateness",
            "comm": comm,
            "seq": seq,
            "late_pct_of_interval": round(100.0 * mean, 1),
            "interval_s": round(interval, 6),
            "late_ops": f"{table.slow_rounds(slot)}/{table.filled(slot)}",
            "group_ranks": group_ranks,
            "pp_stage": self.stage_of.get(rank),
            "since_ts": since,
        }
        offset = offsets.get(self.node_of[rank])
        if offset is not None:  # its arrivals were put on the op's common clock
            evidence["host_offset_s"] = round(offset, 4)
        if rank not in self.stage_of:  # every step read names a stage (maybe None)
            # no step of the rank read yet (steps, which name its GPU, read after the
            # collectives): fusion takes the rank for any GPU of its node
            evidence[UNPLACED] = "no step read yet"
        return Finding(
            detector=self.name,
            category="straggler",
            severity="warning",
            node=self.node_of.get(rank),
            ts=ts,
            since=since,
            score=round(mean, 4),
            job=self.job,
            gpu=self.gpu_of.get(rank),
            rank=rank,
            evidence=evidence,
            clear=event == "clear",
        )

    def _imbalance(
        self,
        comm: str,
        seq: int,
        op: _PendingOp,
        groups: dict[tuple[str, int | None], list[int]],
        interval: float,
    ) -> list[Finding]:
        """A group late as a whole against the earliest group: job-level structure (info)."""
        if len(groups) < 2:
            return []
        levels = self.level[comm].levels
        means = {
            str(k[1]): median([levels[r] for r in members])
            for k, members in groups.items()
            if len(members) >= self.min_peers
        }
        if len(means) < 2:
            return []
        late = max(means.values()) - min(means.values())
        was = self.imbalanced.get(comm, False)
        now = late >= (0.5 * self.imbalance_late if was else self.imbalance_late)
        if now == was:
            return []
        self.imbalanced[comm] = now
        evidence: dict[str, Any] = {
            "metric": "arrival_lateness",
            "comm": comm,
            "seq": seq,
            "group_late_pct_of_interval": {
                k: round(100.0 * v, 1) for k, v in sorted(means.items())
            },
            "grouped_by": "pp_stage" if next(iter(groups))[0] == "stage" else "late_together",
        }
        return [imbalance_info(self.name, self.job, op.ts, round(late, 4), evidence, not now)]

    def _connections(self, comm: str, seq: int, op: _PendingOp) -> list[Finding]:
        if len(op.conns) < self.min_peers:
            return []
        center = median(list(op.conns.values()))
        if center <= 0.0:
            return []
        node_of = self.node_of
        per_node: dict[str, list[float]] = {}
        for (a, b), spb in op.conns.items():
            na, nb = node_of.get(a), node_of.get(b)
            if na is None or nb is None or na == nb:
                continue
            r = spb / center - 1.0
            per_node.setdefault(na, []).append(r)
            per_node.setdefault(nb, []).append(r)
        if len(per_node) < self.min_peers:
            return []
        nodes = list(per_node)
        # min: a node at fault slows all its connections; its neighbours have fast ones too
        residuals = np.array([min(per_node[n]) for n in nodes])
        table, slot_of = self.slow_nodes, self.node_slot
        slots = np.empty(len(nodes), dtype=np.intp)
        for i, node in enumerate(nodes):
            slot = slot_of.get(node)
            slots[i] = slot_of[node] = table.new_slot() if slot is None else slot
        found: list[Finding] = []
        for i, event in table.judge(self.link_noise, slots, residuals, op.ts):
            node, slot = nodes[i], int(slots[i])
            mean = table.slow_mean(slot)
            since = table.since_ts(slot)
            evidence: dict[str, Any] = {
                "metric": "connection_s_per_byte",
                "comm": comm,
                "seq": seq,
                "slower_than_peers_pct": round(100.0 * mean, 1),
                "connections": len(per_node[node]),
                "slow_ops": f"{table.slow_rounds(slot)}/{table.filled(slot)}",
                "since_ts": since,
            }
            found.append(
                Finding(
                    detector=self.name,
                    category="comm_slow",
                    severity="warning",
                    node=node,
                    ts=op.ts,
                    since=since,
                    score=round(mean, 4),
                    job=self.job,
                    evidence=evidence,
                    clear=event == "clear",
                )
            )
        return found

    def _hang(self, comm: str, seq: int, op: _PendingOp, now: float) -> list[Finding]:
        members = self.members.get(comm, set())
        missing = sorted(members - set(op.arrive))
        stuck = sorted(r for r, e in op.end.items() if e is None)
        base: dict[str, Any] = {
            "comm": comm,
            "seq": seq,
            "waiting_s": round(now - op.first_arrive, 3),
            "typical_duration_s": round(self.duration.get(comm, 0.0), 6),
        }
        if not stuck:
            # Everyone who arrived also left: the op completed, and a collective cannot
            # complete without all its members. What is missing is telemetry (an agent
            # restart, a gap), not a rank.
            return []
        if missing:
            by_node: dict[str, list[int]] = {}
            for rank in missing:
                node = self.node_of.get(rank)
                if node is not None:
                    by_node.setdefault(node, []).append(rank)
            return [
                Finding(
                    detector=self.name,
                    category="comm_hang",
                    severity="critical",
                    node=node,
                    ts=now,
                    since=op.first_arrive,
                    score=1.0,
                    job=self.job,
                    rank=ranks[0],
                    evidence={**base, "hang": "non_communication", "ranks_never_arrived": ranks},
                )
                for node, ranks in sorted(by_node.items())
            ]
        return [
            Finding(
                detector=self.name,
                category="comm_hang",
                severity="critical",
                node=None,
                ts=now,
                since=op.first_arrive,
                score=1.0,
                job=self.job,
                evidence={**base, "hang": "communication", "ranks_stuck_inside": stuck},
            )
        ]

"""NIC detector: error and retransmit rates, link flaps, reduced speed; congestion is info.

Per NIC port, cumulative counters are turned into rates between consecutive samples. A
counter that goes down was reset (driver reload, agent restart, counter clear): it is
re-baselined, never read as an error. Per port, a sample is suspect when

* a ``link_downed`` increment is seen (a link flap: category ``link``, raised at once) or
  the port reports ``link_up`` false for ``raise_after`` samples (``link``);
* the rate of physical-layer errors (``symbol_error``, ``port_rcv_errors``,
  ``link_error_recovery``, ``port_rcv_remote_physical_errors``) is at least
  ``phys_per_s``, or of transport retransmits (``out_of_sequence``, ``packet_seq_err``,
  ``local_ack_timeout_err``) at least ``retrans_per_s`` (category ``nic``);
* its link speed is below ``speed_ratio`` of the nominal speed (the fastest seen on the
  node's ports) (category ``nic``).

ECN marks, CNPs and ``port_xmit_wait`` rising *without* errors are what a congested fabric
looks like from every node at once: they give an ``info`` observation (category ``nic``,
``evidence.observation = "congestion"``), never a claim against the node.

**Columns.** The core hands in a step's NIC samples of many nodes at once as
:class:`NicColumns` (one row per sample, the watched counters as one integer matrix) and
:func:`update_nics` runs every rule above as array operations over all of them. Each node
keeps its ports' state as two small arrays in its :class:`NicDetector` (checkpointed with
the node, moved with it on a rebalance); a step stacks the arrays of the nodes it touches,
updates them together and hands each node its rows back. Per-sample Python work is the
port lookup; findings (rare) are built per row.

Parameters
----------
phys_per_s, retrans_per_s
    Error rates, per second, that count as degraded.
speed_ratio
    Fraction of the nominal speed below which a port is degraded.
congestion_per_s
    ECN + CNP rate, per second, that counts as congestion.
raise_after, within, clear_after
    Hysteresis, in samples of the port.

Example
-------
>>> from guard.schemas import NicSample
>>> from guard.detectors.nic import NicDetector
>>> det = NicDetector()
>>> def nic(ts, downed, sym):
...     return NicSample(ts=ts, node="n1", device="mlx5_0", port=1, link_up=True, speed_gbps=400,
...                      counters={"link_downed": downed, "symbol_error": sym})
>>> det.update(nic(0.0, 3, 0)) + det.update(nic(10.0, 3, 0))
[]
>>> [(f.category, f.evidence["signal"]) for f in det.update(nic(20.0, 4, 0))]
[('link', 'link_downed')]
>>> det.update(nic(30.0, 0, 0))  # counters reset: not an error
[]

"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guard.schemas import NicSample

from .findings import Finding
from .hold import CLEAR, arrival_rank, step_holds

__all__ = [
    "CONGESTION_COUNTERS",
    "MISSING",
    "PHYSICAL_ERRORS",
    "RETRANSMITS",
    "WATCHED",
    "NicColumns",
    "NicDetector",
    "NicIncreases",
    "update_nics",
]

PHYSICAL_ERRORS = (
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "port_rcv_remote_physical_errors",
)
RETRANSMITS = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err")
CONGESTION_COUNTERS = ("np_ecn_marked_roce_packets", "rp_cnp_handled")
#: the counters the rules read: the columns of :attr:`NicColumns.counters`, in this order
WATCHED = (*PHYSICAL_ERRORS, *RETRANSMITS, *CONGESTION_COUNTERS, "link_downed", "port_xmit_wait")
_PHYS, _RETRANS, _MARKS = slice(0, 4), slice(4, 7), slice(7, 9)
_FLAPS, _WAIT = 9, 10
#: a watched counter the sample did not report
MISSING = -1
_INT64_MAX = 2**63 - 1

# columns of a port's state row: last sample's time, link speed, then the two holds
TS, SPEED, DEGRADED, DOWN, CONGESTED = 0, 1, slice(2, 6), slice(6, 10), 10
_PORT_FIELDS = 11
#: wider than any link speed (Gb/s): a per-node running max in one accumulate
_SPEED_SPAN = 1e7
# columns of a node's state row: nominal speed, the congestion hold, its first port
NOMINAL, CONGESTION, FIRST = 0, slice(1, 5), 5
_NODE_FIELDS = 6


@dataclass(slots=True)
class NicColumns:
    """NIC samples as columns, one row per sample, in arrival order."""

    node: list[str]
    job: list[str | None]
    device: list[str]
    port: list[int]
    ts: np.ndarray  # float64
    link_up: np.ndarray  # int8: 1 up, 0 down, -1 not reported
    speed: np.ndarray  # float64, nan: not reported
    counters: np.ndarray  # int64, (rows, len(WATCHED)), MISSING: not reported

    def __len__(self) -> int:
        return len(self.node)

    def take(self, at: np.ndarray) -> NicColumns:
        """The rows ``at``, in that order."""
        pick = at.tolist()
        return NicColumns(
            node=[self.node[i] for i in pick],
            job=[self.job[i] for i in pick],
            device=[self.device[i] for i in pick],
            port=[self.port[i] for i in pick],
            ts=self.ts[at],
            link_up=self.link_up[at],
            speed=self.speed[at],
            counters=self.counters[at],
        )

    @classmethod
    def of(cls, rows: Sequence[Mapping[str, Any]]) -> NicColumns:
        """Columns of sample dicts (the fields of :class:`~guard.schemas.NicSample`)."""
        counters = [r.get("counters") or {} for r in rows]
        return cls(
            node=[r["node"] for r in rows],
            job=[r.get("job") for r in rows],
            device=[r["device"] for r in rows],
            port=[r["port"] for r in rows],
            ts=np.array([r["ts"] for r in rows], dtype=np.float64),
            link_up=np.array(
                [-1 if (u := r.get("link_up")) is None else int(u) for r in rows], dtype=np.int8
            ),
            speed=np.array(
                [np.nan if (s := r.get("speed_gbps")) is None else s for r in rows],
                dtype=np.float64,
            ),
            counters=_counter_matrix(counters),
        )

    @classmethod
    def of_samples(cls, samples: Iterable[NicSample]) -> NicColumns:
        return cls.of([s.__dict__ for s in samples])

    @classmethod
    def of_records(
        cls, records: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]
    ) -> NicColumns:
        """Columns of decoded records: each its common fields (``ts``, ``node``, ``job``)
        and its entries (:func:`~guard.schemas.sample_decoder.decode_rows`)."""
        node: list[str] = []
        job: list[str | None] = []
        ts: list[float] = []
        entries: list[Mapping[str, Any]] = []
        for head, items in records:
            n = len(items)
            node += [head["node"]] * n
            job += [head.get("job")] * n
            at = head["ts"]
            ts += [at if (t := e.get("ts")) is None else t for e in items]
            entries += items
        return cls(
            node=node,
            job=job,
            device=[e["device"] for e in entries],
            port=[e["port"] for e in entries],
            ts=np.array(ts, dtype=np.float64),
            link_up=np.array(
                [-1 if (u := e.get("link_up")) is None else int(u) for e in entries],
                dtype=np.int8,
            ),
            speed=np.array(
                [np.nan if (s := e.get("speed_gbps")) is None else s for e in entries],
                dtype=np.float64,
            ),
            counters=_counter_matrix([e.get("counters") or {} for e in entries]),
        )


def _counter_matrix(counters: Sequence[Mapping[str, int]]) -> np.ndarray:
    """The watched counters of each sample, a column per name (MISSING: not reported)."""
    out = np.empty((len(counters), len(WATCHED)), dtype=np.int64)
    for k, name in enumerate(WATCHED):
        column = [c.get(name, MISSING) for c in counters]
        try:
            out[:, k] = column
        except OverflowError:  # beyond int64 (pydantic takes any integer): the largest it holds
            out[:, k] = [min(v, _INT64_MAX) for v in column]
    return out


@dataclass(slots=True)
class NicIncreases:
    """What each row of a step added since its port's previous sample, for the fabric and
    the river feed; ``valid`` false: no interval (first sample, duplicate, out of order)."""

    valid: np.ndarray  # bool
    wait: np.ndarray  # int64: port_xmit_wait
    marks: np.ndarray  # int64: ECN + CNP
    ports: np.ndarray  # intp: each row's port as a dense id within the step
    errors: np.ndarray  # float64: physical errors + retransmits per second (the river feed's)
    local: np.ndarray  # intp: each row's port as its row in its node's detector


class NicDetector:
    """A node's NIC ports: thresholds, and each port's state as a row of two arrays."""

    name = "nic"

    def __init__(
        self,
        phys_per_s: float = 0.5,
        retrans_per_s: float = 5.0,
        speed_ratio: float = 0.9,
        congestion_per_s: float = 100.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        self.phys_per_s = phys_per_s
        self.retrans_per_s = retrans_per_s
        self.speed_ratio = speed_ratio
        self.congestion_per_s = congestion_per_s
        self.hold_args = (raise_after, within, clear_after)
        #: (device, port) -> row of :attr:`counts` and :attr:`state`
        self.ports: dict[tuple[str, int], int] = {}
        self.counts = np.empty((0, len(WATCHED)), dtype=np.int64)  # latest counters
        self.state = np.empty((0, _PORT_FIELDS))
        self.node_state = np.zeros(_NODE_FIELDS)
        self.node_state[FIRST] = -1.0

    def update(self, message: NicSample) -> list[Finding]:
        """One sample (what tests and single-node tools use; the core hands in columns)."""
        return update_nics([self], np.zeros(1, dtype=np.intp), NicColumns.of_samples([message]))[0]

    def tick(self, now: float) -> list[Finding]:
        return []  # every rule runs on a port's own samples

    def flush(self) -> list[Finding]:
        return []

    @property
    def nominal_gbps(self) -> float:
        return float(self.node_state[NOMINAL])

    def counters(self, device: str, port: int) -> dict[str, int]:
        """A port's latest watched counters (those it reported)."""
        row = self.counts[self.ports[(device, port)]]
        return {name: int(v) for name, v in zip(WATCHED, row, strict=True) if v != MISSING}

    def _rows(self, keys: Iterable[tuple[str, int]]) -> list[int]:
        """Rows of ``keys``, new ports added (and the node's first port kept)."""
        ports = self.ports
        out = []
        new = []
        for key in keys:
            row = ports.get(key)
            if row is None:
                row = ports[key] = len(ports)
                new.append(key)
            out.append(row)
        if new:
            self._grow(len(new))
        return out

    def _grow(self, n: int) -> None:
        counts = np.full((n, len(WATCHED)), MISSING, dtype=np.int64)
        state = np.zeros((n, _PORT_FIELDS))
        state[:, TS] = state[:, SPEED] = np.nan
        self.counts = np.concatenate([self.counts, counts])
        self.state = np.concatenate([self.state, state])
        self.node_state[FIRST] = self.ports[min(self.ports)]


def update_nics(
    nodes: Sequence[NicDetector], owner: np.ndarray, cols: NicColumns
) -> tuple[list[Finding], NicIncreases]:
    """One step's NIC samples (``cols``) of several nodes: row ``i`` belongs to
    ``nodes[owner[i]]``. Every rule runs over all rows at once; a port sampled more than once
    in the step is handled in arrival order, one sample of each port per pass. The
    thresholds are the first node's (a core configures all its nodes alike)."""
    n = len(cols)
    local = np.empty(n, dtype=np.intp)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(len(nodes) + 1))
    device, port = cols.device, cols.port
    for k, det in enumerate(nodes):
        mine = order[bounds[k] : bounds[k + 1]]
        local[mine] = det._rows([(device[i], port[i]) for i in mine.tolist()])
    sizes = np.array([len(det.ports) for det in nodes])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    step = _Step(
        nodes[0],
        np.concatenate([det.counts for det in nodes]),
        np.concatenate([det.state for det in nodes]),
        np.stack([det.node_state for det in nodes]),
        offsets,
    )
    rows = offsets[owner] + local
    inc = NicIncreases(
        np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64), rows, np.zeros(n), local
    )
    nominal = step.nominal(cols, owner)
    found = step.sequences(cols, owner, rows, inc, nominal)
    if found is None:  # a duplicate or an older sample in the step: one sample a port a pass
        found = []
        for wave in _waves(rows):
            found += step.run(cols, owner, wave, rows[wave], inc, nominal[wave])
    for k, det in enumerate(nodes):
        a, b = offsets[k], offsets[k + 1]
        det.counts, det.state = step.counts[a:b].copy(), step.state[a:b].copy()
        det.node_state = step.nodes[k].copy()
    found.sort(key=lambda item: item[:2])
    return [f for _, _, f in found], inc


def _waves(rows: np.ndarray) -> list[np.ndarray]:
    """Row positions split so that no port appears twice in one, in arrival order."""
    if len(np.unique(rows)) == len(rows):
        return [np.arange(len(rows))]
    wave = arrival_rank(rows)
    return [np.flatnonzero(wave == w) for w in range(int(wave.max()) + 1)]


class _Step:
    """The stacked state of the nodes of one step, and one pass over its samples."""

    def __init__(
        self,
        cfg: NicDetector,
        counts: np.ndarray,
        state: np.ndarray,
        nodes: np.ndarray,
        offsets: np.ndarray,
    ) -> None:
        self.cfg, self.counts, self.state, self.nodes = cfg, counts, state, nodes
        self.offsets = offsets

    def run(
        self,
        cols: NicColumns,
        owner: np.ndarray,
        at: np.ndarray,
        rows: np.ndarray,
        inc: NicIncreases,
        nominal: np.ndarray,
    ) -> list[tuple[int, int, Finding]]:
        """Samples ``at`` (one per port) of ports ``rows``, judged against ``nominal``
        speeds; their findings, by position."""
        state, ts = self.state, cols.ts[at]
        speed = cols.speed[at]
        known = ~np.isnan(speed)
        state[rows[known], SPEED] = speed[known]
        before = state[rows, TS]
        fresh = np.isnan(before)
        keep = fresh | (ts > before)  # a duplicate or an older sample: rates need new time
        at, rows, ts, before, fresh = at[keep], rows[keep], ts[keep], before[keep], fresh[keep]
        prev = self.counts[rows]
        now = cols.counters[at]
        self.counts[rows] = now
        state[rows, TS] = ts
        sel = ~fresh
        at, rows, ts = at[sel], rows[sel], ts[sel]
        dt = ts - before[sel]
        prev, now = prev[sel], now[sel]
        rise = np.where(now > np.maximum(prev, 0), now - prev, 0)
        rise[prev == MISSING] = 0
        phys_n, retrans_n = rise[:, _PHYS].sum(1), rise[:, _RETRANS].sum(1)
        marks = rise[:, _MARKS].sum(1)
        inc.valid[at], inc.wait[at], inc.marks[at] = True, rise[:, _WAIT], marks
        inc.errors[at] = (phys_n + retrans_n) / dt
        found = self._link(cols, at, rows, ts, dt, rise[:, _FLAPS])
        nominal = nominal[keep][sel]
        found += self._degraded(cols, at, rows, ts, phys_n / dt, retrans_n / dt, nominal)
        cfg = self.cfg
        clean = (phys_n == 0) & (retrans_n == 0)
        state[rows, CONGESTED] = (marks / dt >= cfg.congestion_per_s) & clean
        found += self._congestion(cols, owner, at, rows, ts, marks / dt, rise[:, _WAIT] / dt)
        return found

    def sequences(
        self,
        cols: NicColumns,
        owner: np.ndarray,
        rows: np.ndarray,
        inc: NicIncreases,
        nominal: np.ndarray,
    ) -> list[tuple[int, int, Finding]] | None:
        """Every sample of the step at once, each port's samples in arrival order compared
        with the one before; the holds run in order over the ports that have one going.
        None, changing nothing, if a port's times do not increase (then :meth:`run`, a
        pass per sample of a port, drops what is late)."""
        state, cfg = self.state, self.cfg
        n = len(rows)
        order = np.argsort(rows, kind="stable")
        r, t = rows[order], cols.ts[order]
        start = np.r_[True, r[1:] != r[:-1]]
        last = np.r_[start[1:], True]
        before = np.where(start, state[r, TS], np.r_[np.nan, t[:-1]])
        fresh = np.isnan(before)
        if np.any(t[~fresh] <= before[~fresh]):
            return None
        node = owner[order]
        nominal = nominal[order]
        speed = self._speeds(cols.speed[order], r, start)
        rise = self._rises(cols.counters[order], r, start, last, fresh)
        state[r[last], TS] = t[last]
        state[r[last], SPEED] = speed[last]
        iv = ~fresh
        dt = np.where(iv, t - before, 1.0)
        phys, retrans = rise[:, _PHYS].sum(1) / dt, rise[:, _RETRANS].sum(1) / dt
        marks, wait = rise[:, _MARKS].sum(1), rise[:, _WAIT]
        inc.valid[order], inc.wait[order], inc.marks[order] = iv, wait, marks
        inc.errors[order] = np.where(iv, phys + retrans, 0.0)
        errors = iv & ((phys >= cfg.phys_per_s) | (retrans >= cfg.retrans_per_s))
        slow = iv & (nominal > 0.0) & (speed < cfg.speed_ratio * nominal)
        down = iv & (cols.link_up[order] == 0)
        cong = iv & (marks / dt >= cfg.congestion_per_s) & (phys == 0) & (retrans == 0)
        set_cong = last & iv
        state[r[set_cong], CONGESTED] = cong[set_cong]
        rank = np.arange(n) - np.repeat(
            np.flatnonzero(start), np.diff(np.r_[np.flatnonzero(start), n])
        )
        found = _flaps(cols, order, rise[:, _FLAPS], dt, t)
        seq = (cols, order, r, t, rank, iv)  # the step's samples, each port's in order
        found += self._held(
            *seq, down, DOWN, lambda j, i, since, clear: self._down_finding(cols, i, since, clear)
        )
        judged = (errors, speed, nominal, phys, retrans)
        found += self._held(
            *seq,
            errors | slow,
            DEGRADED,
            lambda j, i, since, clear: self._degraded_finding(cols, j, i, since, clear, judged),
        )
        found += self._node_congestion(*seq[:5], node, iv, cong, marks / dt, wait / dt)
        return found

    def _speeds(self, speed: np.ndarray, r: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Each sample's link speed, a port's last known one where a sample has none."""
        known = ~np.isnan(speed)
        lead = start & ~known  # a port's speed carries over from its last sample
        speed[lead] = self.state[r[lead], SPEED]
        out: np.ndarray = speed[
            np.maximum.accumulate(np.where(known | start, np.arange(len(r)), -1))
        ]
        return out

    def _rises(
        self, now: np.ndarray, r: np.ndarray, start: np.ndarray, last: np.ndarray, fresh: np.ndarray
    ) -> np.ndarray:
        """What each sample's counters added to its port's sample before (a reset, a counter
        missing before, a port's first sample: 0); the ports keep their last counters."""
        prev = np.empty_like(now)
        prev[start] = self.counts[r[start]]
        prev[~start] = now[np.flatnonzero(~start) - 1]
        self.counts[r[last]] = now[last]
        rise = np.where(now > np.maximum(prev, 0), now - prev, 0)
        rise[prev == MISSING] = 0
        rise[fresh] = 0
        return rise

    def _held(
        self,
        cols: NicColumns,
        order: np.ndarray,
        r: np.ndarray,
        t: np.ndarray,
        rank: np.ndarray,
        iv: np.ndarray,
        cond: np.ndarray,
        part: slice,
        make: Any,
    ) -> list[tuple[int, int, Finding]]:
        """A hold per port over its samples in order; only ports with a condition in the step
        or a hold going are touched (a healthy fabric: none)."""
        held = self.state[:, part]
        going = (held[:, 0] != 0) | (held[:, 1] != 0)
        busy = iv & (going[r] | np.isin(r, r[cond]))
        if not busy.any():
            return []
        found = []
        for k in range(int(rank[busy].max()) + 1):
            js = np.flatnonzero(busy & (rank == k))
            if not len(js):
                continue
            part_state = self.state[r[js], part]
            events = step_holds(part_state, cond[js], t[js], *self.cfg.hold_args)
            self.state[r[js], part] = part_state
            for e in np.flatnonzero(events).tolist():
                j = js[e]
                found.append(make(j, order[j], part_state[e, 3], events[e] == CLEAR))
        return found

    @staticmethod
    def _down_finding(
        cols: NicColumns, i: int, since: float, clear: bool
    ) -> tuple[int, int, Finding]:
        link_up = None if cols.link_up[i] < 0 else bool(cols.link_up[i])
        evidence = {"signal": "link_up", "link_up": link_up}
        return (i, 1, _finding(cols, i, "link", "warning", since, evidence, clear=clear))

    def _degraded_finding(
        self, cols: NicColumns, j: int, i: int, since: float, clear: bool, judged: tuple[Any, ...]
    ) -> tuple[int, int, Finding]:
        errors, speed, nominal, phys, retrans = judged
        evidence = {
            "signal": "errors" if errors[j] else "speed",
            "physical_errors_per_s": round(float(phys[j]), 3),
            "retransmits_per_s": round(float(retrans[j]), 3),
            "speed_gbps": None if np.isnan(speed[j]) else float(speed[j]),
            "nominal_gbps": float(nominal[j]),
        }
        return (i, 2, _finding(cols, i, "nic", "warning", since, evidence, clear=clear))

    def _node_congestion(
        self,
        cols: NicColumns,
        order: np.ndarray,
        r: np.ndarray,
        t: np.ndarray,
        rank: np.ndarray,
        node: np.ndarray,
        iv: np.ndarray,
        cong: np.ndarray,
        marks_per_s: np.ndarray,
        wait_per_s: np.ndarray,
    ) -> list[tuple[int, int, Finding]]:
        """The node's verdict once per round, at its first port's sample: half of the ports
        that reported in that round congested (marks without errors) is an info."""
        nodes = self.nodes
        first = iv & ((r - self.offsets[node]) == nodes[node, FIRST])
        if not first.any():
            return []
        rounds = int(rank.max()) + 1
        cell = node * rounds + rank  # (node, round)
        size = len(nodes) * rounds
        share = np.bincount(cell, cong, size) / np.maximum(np.bincount(cell, None, size), 1)
        hot = share[cell] >= 0.5
        held = nodes[:, CONGESTION]
        going = (held[:, 0] != 0) | (held[:, 1] != 0)
        busy = first & (going[node] | np.isin(node, node[first & hot]))
        found = []
        for k in range(rounds):
            js = np.flatnonzero(busy & (rank == k))
            if not len(js):
                continue
            part = nodes[node[js], CONGESTION]
            events = step_holds(part, hot[js], t[js], *self.cfg.hold_args)
            nodes[node[js], CONGESTION] = part
            for e in np.flatnonzero(events).tolist():
                j = js[e]
                evidence = {
                    "signal": "congestion",
                    "observation": "congestion",
                    "ports_congested_pct": round(100.0 * float(share[cell[j]])),
                    "ecn_cnp_per_s": round(float(marks_per_s[j]), 1),
                    "xmit_wait_per_s": round(float(wait_per_s[j]), 1),
                }
                clear = events[e] == CLEAR
                f = _finding(cols, order[j], "nic", "info", part[e, 3], evidence, clear, None)
                found.append((order[j], 3, f))
        return found

    def nominal(self, cols: NicColumns, owner: np.ndarray) -> np.ndarray:
        """The nominal speed each sample is judged against: the fastest its node reported
        up to and with it, in arrival order; the nodes' nominal moves on to the step's."""
        node = owner
        by_node = np.argsort(node, kind="stable")
        shift = node[by_node] * _SPEED_SPAN  # a running max per node, in one accumulate
        speed = np.clip(np.nan_to_num(cols.speed[by_node], nan=0.0), 0.0, _SPEED_SPAN / 2)
        running = np.maximum.accumulate(speed + shift) - shift
        out = np.empty(len(node))
        out[by_node] = np.maximum(running, self.nodes[node[by_node], NOMINAL])
        np.maximum.at(self.nodes[:, NOMINAL], node, out)
        return out

    def _holds(self, rows: np.ndarray, part: slice, cond: np.ndarray, ts: np.ndarray) -> Any:
        held = self.state[rows, part]
        events = step_holds(held, cond, ts, *self.cfg.hold_args)
        self.state[rows, part] = held
        return events

    def _link(
        self,
        cols: NicColumns,
        at: np.ndarray,
        rows: np.ndarray,
        ts: np.ndarray,
        dt: np.ndarray,
        flaps: np.ndarray,
    ) -> list[tuple[int, int, Finding]]:
        """A flap (``link_downed`` rose) at once; a port held down through its hold."""
        found = []
        for j in np.flatnonzero(flaps):
            severity = "critical" if flaps[j] >= 3 else "warning"
            evidence = {
                "signal": "link_downed",
                "increase": int(flaps[j]),
                "interval_s": float(dt[j]),
            }
            found.append((at[j], 0, _finding(cols, at[j], "link", severity, ts[j], evidence)))
        down = cols.link_up[at] == 0
        events = self._holds(rows, DOWN, down, ts)
        for j in np.flatnonzero(events):
            link_up = None if cols.link_up[at[j]] < 0 else bool(cols.link_up[at[j]])
            since = self.state[rows[j], DOWN][3]
            evidence = {"signal": "link_up", "link_up": link_up}
            clear = events[j] == CLEAR
            found.append(
                (at[j], 1, _finding(cols, at[j], "link", "warning", since, evidence, clear=clear))
            )
        return found

    def _degraded(
        self,
        cols: NicColumns,
        at: np.ndarray,
        rows: np.ndarray,
        ts: np.ndarray,
        phys: np.ndarray,
        retrans: np.ndarray,
        nominal: np.ndarray,
    ) -> list[tuple[int, int, Finding]]:
        """Error or retransmit rates too high, or the link slower than nominal."""
        cfg = self.cfg
        errors = (phys >= cfg.phys_per_s) | (retrans >= cfg.retrans_per_s)
        speed = self.state[rows, SPEED]
        slow = (nominal > 0.0) & (speed < cfg.speed_ratio * nominal)  # nan: never slow
        events = self._holds(rows, DEGRADED, errors | slow, ts)
        found = []
        for j in np.flatnonzero(events):
            evidence = {
                "signal": "errors" if errors[j] else "speed",
                "physical_errors_per_s": round(float(phys[j]), 3),
                "retransmits_per_s": round(float(retrans[j]), 3),
                "speed_gbps": None if np.isnan(speed[j]) else float(speed[j]),
                "nominal_gbps": float(nominal[j]),
            }
            since = self.state[rows[j], DEGRADED][3]
            found.append(
                (
                    at[j],
                    2,
                    _finding(
                        cols, at[j], "nic", "warning", since, evidence, clear=events[j] == CLEAR
                    ),
                )
            )
        return found

    def _congestion(
        self,
        cols: NicColumns,
        owner: np.ndarray,
        at: np.ndarray,
        rows: np.ndarray,
        ts: np.ndarray,
        marks_per_s: np.ndarray,
        wait_per_s: np.ndarray,
    ) -> list[tuple[int, int, Finding]]:
        """The node's verdict, once per round (at its first port's sample), over its ports
        as this pass left them: half of them congested (marks without errors) is an info."""
        node = owner[at]
        first = (rows - self.offsets[node]) == self.nodes[node, FIRST]
        if not first.any():
            return []
        congested = np.add.reduceat(self.state[:, CONGESTED], self.offsets[:-1])
        share = congested / np.diff(self.offsets)
        at, node, ts = at[first], node[first], ts[first]
        marks_per_s, wait_per_s = marks_per_s[first], wait_per_s[first]
        held = self.nodes[node, CONGESTION]
        events = step_holds(held, share[node] >= 0.5, ts, *self.cfg.hold_args)
        self.nodes[node, CONGESTION] = held
        found = []
        for j in np.flatnonzero(events):
            evidence = {
                "signal": "congestion",
                "observation": "congestion",
                "ports_congested_pct": round(100.0 * float(share[node[j]])),
                "ecn_cnp_per_s": round(float(marks_per_s[j]), 1),
                "xmit_wait_per_s": round(float(wait_per_s[j]), 1),
            }
            found.append(
                (
                    at[j],
                    3,
                    _finding(
                        cols,
                        at[j],
                        "nic",
                        "info",
                        held[j][3],
                        evidence,
                        clear=events[j] == CLEAR,
                        device=None,
                    ),
                )
            )
        return found


def _flaps(
    cols: NicColumns, order: np.ndarray, flaps: np.ndarray, dt: np.ndarray, t: np.ndarray
) -> list[tuple[int, int, Finding]]:
    """A finding at once for each sample whose ``link_downed`` rose (a link flap)."""
    found = []
    for j in np.flatnonzero(flaps).tolist():
        n = int(flaps[j])
        evidence = {"signal": "link_downed", "increase": n, "interval_s": float(dt[j])}
        severity = "critical" if n >= 3 else "warning"
        found.append((order[j], 0, _finding(cols, order[j], "link", severity, t[j], evidence)))
    return found


def _finding(
    cols: NicColumns,
    i: int,
    category: str,
    severity: str,
    since: float,
    evidence: dict[str, Any],
    clear: bool = False,
    device: str | None = "",
) -> Finding:
    return Finding(
        detector=NicDetector.name,
        category=category,
        severity=severity,
        node=cols.node[i],
        ts=float(cols.ts[i]),
        since=float(since),
        score=1.0,
        job=cols.job[i],
        device=cols.device[i] if device == "" else device,
        evidence={"port": cols.port[i], **evidence},
        clear=bool(clear),
    )

"""Sampling rounds of GPUs as columns: the peer groups, and the input, of the node GPU rules.

A node agent samples all its GPUs every interval. A node's round is the latest sample of each
GPU, closed when a GPU reports again (or at flush), so each rule sees one consistent snapshot
of the node and compares a GPU with its siblings. Missing GPUs, gaps and slightly
out-of-order samples only make a round smaller.

**Columns.** The core decodes a step's GPU records of every node straight into
:class:`GpuColumns` (one row per sample, a numeric array per field, NaN where a sample does
not report a field) and closes the rounds of all its nodes at once into :class:`Rounds`: each
field as a matrix of a row per round and a column per GPU of the round, with the siblings'
medians per round (:meth:`Rounds.median`). The rules (thermal, power, clocks) are array
operations over those matrices; their holds (:func:`~guard.detectors.hold.step_holds`) are
rows of the node's state array (:class:`GpuRoundRule`). Per-sample Python work is the round
assembly over integers; findings (rare) are built per event.

**Claims need impact.** A GPU that is hot or draws odd power is a fault only when it is or
will soon be slower: :func:`impact_codes` names the signal that shows it — a throttle or brake
reason bit held (``reason_bits``), an SM-clock deficit against its loaded siblings
(``sm_clock_deficit``), a power deficit against them (``power_deficit``), or a temperature
within ``margin_c`` of the GPU's own slowdown threshold (``near_slowdown_temp``; NVML's
``temp_slowdown_c``, or the rule's absolute limit where the GPU does not report one). A GPU
that runs 10 deg C above its siblings at full clocks (its airflow position) has none.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuColumns, Rounds
>>> cols = GpuColumns.of_samples([GpuSample(ts=1.0 + 0.1 * g, node="n", gpu=g,
...                                         temp_c=60.0 + 10 * g) for g in range(4)])
>>> rounds = Rounds.of(cols, [[0, 1, 2, 3]], owner=[0], job=["job"])
>>> rounds.ts.tolist(), rounds.median("temp").tolist()
([1.3], [75.0])
>>> rounds.median("temp", min_peers=5).tolist()  # fewer than five GPUs report it
[nan]

"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from guard.schemas import GpuSample
from guard.schemas.nvml_codes import SW_POWER_CAP, TROUBLE_REASONS

from .findings import Finding
from .hold import step_holds
from .persistent_deviation import SequentialTest
from .robust import row_medians
from .sibling_cusum import step_cusums

__all__ = [
    "FIELDS",
    "IMPACTS",
    "Event",
    "GpuColumns",
    "GpuRoundRule",
    "Holds",
    "Rounds",
    "impact_codes",
]

#: numeric fields of a GPU sample as columns: column name -> the sample's field
FIELDS = {
    "temp": "temp_c",
    "slowdown": "temp_slowdown_c",
    "power": "power_w",
    "limit": "power_limit_w",
    "clock": "sm_clock_mhz",
    "util": "util_pct",
}
#: what :func:`impact_codes` returns, by code (0: none)
IMPACTS = (None, "reason_bits", "sm_clock_deficit", "power_deficit", "near_slowdown_temp")
_INT64_MAX = 2**63 - 1


def _floats(rows: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    """A float field of ``rows`` (NaN: not reported); a field absent from a row is NaN in
    one C-level conversion, an explicit null (rare) takes the slower path."""
    values = [r.get(name, np.nan) for r in rows]
    try:
        return np.array(values, dtype=np.float64)
    except TypeError:
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _ints(rows: Sequence[Mapping[str, Any]], name: str, missing: int) -> np.ndarray:
    """An integer field of ``rows`` (``missing``: not reported), capped at int64's largest."""
    return _ints_of([r.get(name, missing) for r in rows], missing)


#: the integer fields after the GPU index, and their value when not reported
_INT_FIELDS = (("clock_event_reasons", 0), ("xid", -1), ("ecc_dbe_total", -1))


def _ints_of(values: list[Any], missing: int) -> np.ndarray:
    """Integers (None: ``missing``), capped at int64's largest."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, OverflowError):
        return np.array(
            [missing if v is None else min(v, _INT64_MAX) for v in values], dtype=np.int64
        )


#: the float columns of :class:`GpuColumns`, in the order of its float matrix
_FLOATS = ("ts", *FIELDS)
#: its integer columns: GPU index, reason bits (0: none), Xid and DBE total (-1: not
#: reported), the GPU's row in its node's state (-1: not looked up yet)
_INTS = ("gpu", "reasons", "xid", "dbe", "row")


def _column(matrix: str, k: int) -> property:
    def get(self: GpuColumns) -> np.ndarray:
        out: np.ndarray = getattr(self, matrix)[:, k]
        return out

    def put(self: GpuColumns, values: Any) -> None:
        getattr(self, matrix)[:, k] = values

    return property(get, put)


class GpuColumns:
    """GPU samples as columns, one row per sample, in arrival order: the numeric fields as
    two matrices (floats, NaN where not reported; integers) read and written by field
    name, so taking or joining rows is two array operations."""

    __slots__ = ("floats", "ints", "job", "node")

    def __init__(
        self, node: list[str], job: list[str | None], floats: np.ndarray, ints: np.ndarray
    ) -> None:
        self.node = node
        self.job = job
        self.floats = floats
        self.ints = ints

    def __len__(self) -> int:
        return len(self.node)

    @classmethod
    def of(
        cls,
        rows: Sequence[Mapping[str, Any]],
        node: list[str] | None = None,
        job: list[str | None] | None = None,
        ts: list[float] | None = None,
    ) -> GpuColumns:
        """Columns of sample dicts (the fields of :class:`~guard.schemas.GpuSample`); a
        batch's entries get ``node``, ``job`` and ``ts`` from their record's."""
        n = len(rows)
        floats = np.empty((n, len(_FLOATS)))
        floats[:, 0] = [r["ts"] for r in rows] if ts is None else ts
        for k, name in enumerate(FIELDS.values(), 1):
            floats[:, k] = _floats(rows, name)
        ints = np.empty((n, len(_INTS)), dtype=np.int64)
        ints[:, 0] = [r["gpu"] for r in rows]
        for k, (name, missing) in enumerate(_INT_FIELDS, 1):
            ints[:, k] = _ints(rows, name, missing)
        ints[:, 4] = -1
        return cls(
            [r["node"] for r in rows] if node is None else node,
            [r.get("job") for r in rows] if job is None else job,
            floats,
            ints,
        )

    @classmethod
    def of_samples(cls, samples: Iterable[GpuSample]) -> GpuColumns:
        return cls.of([s.__dict__ for s in samples])

    @classmethod
    def of_records(
        cls, records: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]
    ) -> GpuColumns:
        """Columns of decoded records: each its common fields (``ts``, ``node``, ``job``)
        and its entries (:func:`~guard.schemas.sample_decoder.decode_rows`)."""
        rows: list[Mapping[str, Any]] = []
        node: list[str] = []
        job: list[str | None] = []
        ts: list[float] = []
        for head, items in records:
            n = len(items)
            rows += items
            node += [head["node"]] * n
            job += [head.get("job")] * n
            at = head["ts"]
            ts += [at if (t := e.get("ts")) is None else t for e in items]
        return cls.of(rows, node, job, ts)

    @classmethod
    def of_structs(cls, records: Sequence[tuple[Any, Sequence[Any]]]) -> GpuColumns:
        """Columns of records decoded as Structs
        (:func:`~guard.schemas.sample_decoder.decode_structs`): each the record (``ts``,
        ``node``, ``job``) and its entries, read by attribute (an entry's ``ts`` None: the
        record's; an absent metric None: NaN, or the integer columns' missing value)."""
        entries: list[Any] = []
        node: list[str] = []
        job: list[str | None] = []
        for head, items in records:
            n = len(items)
            entries += items
            node += [head.node] * n
            job += [head.job] * n
        n = len(entries)
        floats = np.empty((n, len(_FLOATS)))
        ts = [e.ts for e in entries]
        if None in ts:
            ts = [h.ts if e.ts is None else e.ts for h, items in records for e in items]
        floats[:, 0] = ts
        for k, name in enumerate(FIELDS.values(), 1):
            floats[:, k] = np.array(list(map(attrgetter(name), entries)), dtype=np.float64)
        ints = np.empty((n, len(_INTS)), dtype=np.int64)
        ints[:, 0] = list(map(attrgetter("gpu"), entries))
        for k, (name, missing) in enumerate(_INT_FIELDS, 1):
            ints[:, k] = _ints_of(list(map(attrgetter(name), entries)), missing)
        ints[:, 4] = -1
        return cls(node, job, floats, ints)

    @classmethod
    def concat(cls, parts: Sequence[GpuColumns]) -> GpuColumns:
        """The rows of ``parts``, one after the other."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            [n for p in parts for n in p.node],
            [j for p in parts for j in p.job],
            np.concatenate([p.floats for p in parts]),
            np.concatenate([p.ints for p in parts]),
        )

    def take(self, at: np.ndarray) -> GpuColumns:
        """The rows ``at``, in that order."""
        pick = at.tolist()
        return GpuColumns(
            [self.node[i] for i in pick],
            [self.job[i] for i in pick],
            self.floats[at],
            self.ints[at],
        )

    @classmethod
    def empty(cls) -> GpuColumns:
        return cls.of([])

    ts = _column("floats", 0)
    temp = _column("floats", 1)
    slowdown = _column("floats", 2)
    power = _column("floats", 3)
    limit = _column("floats", 4)
    clock = _column("floats", 5)
    util = _column("floats", 6)
    gpu = _column("ints", 0)
    reasons = _column("ints", 1)
    xid = _column("ints", 2)
    dbe = _column("ints", 3)
    row = _column("ints", 4)


@dataclass(slots=True)
class Rounds:
    """Closed rounds of many nodes: each field a matrix, a row per round and a column per
    GPU of the round in the order its samples came (NaN beyond a round's GPUs)."""

    cols: GpuColumns
    at: np.ndarray  # (rounds, width) rows of ``cols``; -1 beyond a round's GPUs
    owner: np.ndarray  # each round's node, a position in the caller's list
    job: list[str | None]
    ts: np.ndarray = field(init=False)
    valid: np.ndarray = field(init=False)
    _medians: dict[tuple[str, int], np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.valid = self.at >= 0
        self.ts = np.where(self.valid, self.cols.ts[self.at], -np.inf).max(1)
        self._medians = {}

    @classmethod
    def of(
        cls, cols: GpuColumns, rounds: Sequence[Sequence[int]], owner: Any, job: list[str | None]
    ) -> Rounds:
        """The rounds whose samples are the rows ``rounds`` of ``cols``."""
        width = max((len(r) for r in rounds), default=0)
        at = np.full((len(rounds), width), -1, dtype=np.intp)
        for k, rows in enumerate(rounds):
            at[k, : len(rows)] = rows
        return cls(cols, at, np.asarray(owner, dtype=np.intp), job)

    def __len__(self) -> int:
        return len(self.at)

    def matrix(self, name: str) -> np.ndarray:
        """A column of the samples as a (rounds, width) matrix; NaN (or 0) beyond a round."""
        values: np.ndarray = getattr(self.cols, name)[self.at]
        if values.dtype.kind == "f":
            values[~self.valid] = np.nan
        else:
            values[~self.valid] = 0
        return values

    def median(self, name: str, min_peers: int = 3) -> np.ndarray:
        """Median of ``name`` over the GPUs of each round that report it; NaN below
        ``min_peers`` of them."""
        key = (name, min_peers)
        found = self._medians.get(key)
        if found is None:
            found, n = row_medians(self.matrix(name))
            found[n < min_peers] = np.nan
            self._medians[key] = found
        return found


def impact_codes(
    rounds: Rounds,
    slowdown_c: float,
    margin_c: float = 2.0,
    clock_deficit: float = 0.05,
    power_deficit: float = 0.2,
    min_util: float = 50.0,
    reasons: int = TROUBLE_REASONS,
) -> np.ndarray:
    """The first signal that each GPU of each round is or will soon be slower, as an index
    into :data:`IMPACTS` (0: none), a (rounds, width) matrix.

    ``slowdown_c`` is the threshold used when a sample does not carry NVML's own
    (``temp_slowdown_c``). Deficits count only under load, against loaded siblings; the power
    deficit only from ``power_deficit`` (20 %): healthy GPUs at the same clocks and load differ
    by several per cent in draw (silicon, cooling), which costs no speed.
    """
    bits = rounds.matrix("reasons")
    util, clock, power = rounds.matrix("util"), rounds.matrix("clock"), rounds.matrix("power")
    med_util = rounds.median("util")[:, None]
    med_clock = rounds.median("clock")[:, None]
    med_power = rounds.median("power")[:, None]
    troubled = (bits & reasons) != 0
    # a GPU at its power limit (0x4 alone) is held back by its limit, which every loaded
    # GPU touches now and then: a deficit then is the power rule's business, not this one's
    capped = ((bits & SW_POWER_CAP) != 0) & ~troubled
    loaded = (util >= min_util) & ~capped & (med_util >= min_util)
    clock_low = loaded & (med_clock != 0) & (clock < (1.0 - clock_deficit) * med_clock)
    power_low = loaded & (med_power != 0) & (power < (1.0 - power_deficit) * med_power)
    slowdown = rounds.matrix("slowdown")
    threshold = np.where(np.isnan(slowdown), slowdown_c, slowdown)
    near = rounds.matrix("temp") >= threshold - margin_c
    return np.select([troubled, clock_low, power_low, near], [1, 2, 3, 4], 0)


#: a rule's hold conditions over rounds: (slot, condition, the cells it looks at or None:
#: every GPU), in the order their events are reported
Holds = list[tuple[int, np.ndarray, np.ndarray | None]]
#: a hold's event: (round, GPU column, slot, when the hold's run began, whether it clears)
Event = tuple[int, int, int, float, bool]


class GpuRoundRule:
    """Base of the per-round rules: their thresholds, and the holds they keep per GPU as
    slots of the node's state rows (:meth:`held`). The rule's own parts: ``conditions``, its
    holds' conditions over every closed round of a step at once (and what its findings
    say), and ``finding_of``, the finding of a hold's event. Only the holds go round by
    round (:func:`~guard.detectors.gpu_step.judge_rounds`: one wave per round of a node)."""

    name = "gpu_round_rule"
    #: holds a GPU has under this rule (claims, then observations without impact; with a
    #: sequential test, its CUSUM and its claim last)
    slots = 1
    #: the rule's sequential test on ``seen["z"]`` (:mod:`~guard.detectors.sibling_cusum`),
    #: None: holds only
    test: SequentialTest | None = None

    def __init__(self, raise_after: int, within: int, clear_after: int) -> None:
        self.hold_args = (raise_after, within, clear_after)

    def conditions(self, rounds: Rounds) -> tuple[Holds, dict[str, Any]]:
        """Each hold's condition over ``rounds``, and the matrices its findings read."""
        raise NotImplementedError

    def finding_of(
        self, seen: dict[str, Any], rounds: Rounds, nodes: Sequence[str], event: Event
    ) -> Finding:
        """The finding of a hold's event: ``(round, GPU column, slot, since, clear)``."""
        raise NotImplementedError

    def sequential(
        self, view: np.ndarray, seen: dict[str, Any], rounds: Rounds, rows: np.ndarray, pick: Any
    ) -> tuple[int, np.ndarray, np.ndarray | None, tuple[int, int, int]]:
        """One round per GPU of the rule's CUSUM (``view``: the rule's slots of the GPUs'
        rows, ``rounds``: the rounds ``pick`` of ``seen``'s matrices, one per node), on
        ``seen["z"]`` (NaN: not judged, ``S`` stays) and ``seen["deficit"]``; the CUSUM's
        state per cell goes to ``seen["cusum"]`` for the findings. Call it after the rule's
        holds of the round: it defers to the rule's own claim. Returns the claim's hold:
        its slot, its condition (``S`` at or past the threshold), every GPU, and its
        hysteresis (raise at once: the CUSUM has done the waiting)."""
        test = self.test
        assert test is not None
        cusum = view[:, self.slots - 2]
        z = seen["z"][pick]
        crossed = np.zeros(rounds.at.shape, dtype=bool)
        hold = (self.slots - 1, crossed, None, (1, 1, self.hold_args[2]))
        # only cells with evidence or a round past k change (the common case: none)
        busy = rounds.valid & (z > test.k)  # NaN: False
        if cusum[:, 0].any():
            gathering = np.zeros_like(busy)
            gathering[rounds.valid] = cusum[rows[rounds.valid], 0] > 0.0
            busy |= gathering
        if not busy.any():
            return hold
        r, j = np.nonzero(busy)
        at = rows[r, j]
        part = cusum[at]
        ts = rounds.cols.ts[rounds.at[r, j]]
        step_cusums(part, z[r, j], seen["deficit"][pick][r, j], ts, test)
        cusum[at] = part
        if "cusum" not in seen:
            seen["cusum"] = np.zeros((*seen["z"].shape, 4))
        seen["cusum"][np.asarray(pick)[r], j] = part
        # one claim per GPU and rule (fusion keys them alike): the CUSUM raises only while
        # the rule's own claim (slot 0) is not raised, and once raised holds as it would
        free = (view[at, 0, 1] == 0) | (view[at, self.slots - 1, 1] != 0)
        crossed[r, j] = (part[:, 0] >= test.threshold) & free
        return hold

    def sequential_evidence(
        self, seen: dict[str, Any], r: int, j: int, since: float
    ) -> tuple[dict[str, Any], float]:
        """The CUSUM's figures for a finding of GPU ``j`` of round ``r`` (rounds of evidence,
        ``S`` against the threshold, the mean deficit over those rounds) and when its
        evidence began (``since``, the claim's, once it has drained)."""
        assert self.test is not None
        cells = seen.get("cusum")  # absent: no GPU had evidence this step
        s, steps, start, total = [0.0] * 4 if cells is None else cells[r, j].tolist()
        evidence = {
            "raised_by": "cusum",
            "steps": int(steps),
            "cusum": round(s, 2),
            "threshold": self.test.threshold,
            "excess_pct": round(100.0 * total / steps, 1) if steps else 0.0,
        }
        return evidence, start if steps else since

    def held(
        self,
        state: np.ndarray,
        rounds: Rounds,
        rows: np.ndarray,
        cond: np.ndarray,
        look: np.ndarray | None = None,
        hold_args: tuple[int, int, int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Update one hold of each GPU of ``rounds`` (``state``: that slot's rows, ``rows``:
        each cell's row) with ``cond``, on the cells ``look`` (default: every GPU; the rule
        decides which GPUs it looks at), with the rule's hysteresis or ``hold_args``.
        Returns the round and GPU column of each event, and the event
        (:data:`~guard.detectors.hold.RAISE` or ``CLEAR``); a hold's run starts at its GPU's
        sample time. Cells without a condition and nothing going keep their state
        (the common case: a healthy GPU)."""
        look = rounds.valid if look is None else look & rounds.valid
        held = state[rows[look]]
        c = cond[look]
        busy = c | (held[:, 0] != 0) | (held[:, 1] != 0)
        if not busy.any():
            return _NONE, _NONE, _NONE
        r, j = np.nonzero(look)
        r, j, part = r[busy], j[busy], held[busy]
        args = self.hold_args if hold_args is None else hold_args
        events = step_holds(part, c[busy], rounds.cols.ts[rounds.at[r, j]], *args)
        state[rows[r, j]] = part
        hit = events != 0
        return r[hit], j[hit], events[hit]


_NONE = np.empty(0, dtype=np.intp)


def finding(
    rule: GpuRoundRule,
    rounds: Rounds,
    nodes: Sequence[str],
    r: int,
    j: int,
    category: str,
    severity: str,
    score: float,
    evidence: dict[str, Any],
    since: float,
    clear: bool,
) -> Finding:
    """The finding of GPU ``j`` of round ``r``; the evidence ends with the hold's start."""
    evidence["since_ts"] = since
    i = int(rounds.at[r, j])
    return Finding(
        rule.name,
        category,
        severity,
        nodes[int(rounds.owner[r])],
        float(rounds.ts[r]),
        since,
        score,
        job=rounds.job[r],
        gpu=int(rounds.cols.gpu[i]),
        evidence=evidence,
        clear=clear,
    )


def opt(x: Any) -> float | None:
    """A matrix cell as the sample had it: None where not reported."""
    v = float(x)
    return None if math.isnan(v) else v

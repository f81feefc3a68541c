"""A job's step and collective records of one poll, as columns.

The job stream's records are a node's ranks reporting one training step (``step_batch``)
or one collective operation (``collective_batch``), or one rank's report (``step``,
``collective``). The core hands a job's records of a poll to its detectors at once, decoded
to msgspec Structs (:func:`~guard.schemas.sample_decoder.decode_structs`) or, from a file a
backtest decoded already, to the validated models; both are read by attribute. Here they
become one array per field, one row per rank-report, in arrival order, and *runs*: maximal
stretches of rows about the same step (or the same op of one communicator), in the order
they came. A detector's per-step bookkeeping (which steps are complete, which to close) is
then done once per run, and its residuals, medians and sequential tests once per closed
step over arrays.

Example
-------
>>> from guard.schemas import StepTiming
>>> rows = [
...     StepTiming(ts=10.0 + r, node="n1", job="j", rank=r, step=4, step_s=2.0, compute_s=1.5)
...     for r in range(3)
... ]
>>> cols = StepColumns.of_records([(rows[0], rows)])
>>> cols.rank.tolist(), cols.runs
([0, 1, 2], [(0, 3)])
>>> cols.stage.tolist()  # -1: no pipeline stage reported
[-1, -1, -1]

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import numpy as np

__all__ = ["CollectiveColumns", "JobRecords", "StepColumns", "runs_of"]

#: (common fields, entries) of each record: a batch and its entries, or a single record twice
JobRecords = Sequence[tuple[Any, Sequence[Any]]]


def runs_of(*keys: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of rows whose ``keys`` are all equal, in order.

    >>> runs_of(np.array([3, 3, 4, 3]))
    [(0, 2), (2, 3), (3, 4)]
    """
    n = len(keys[0])
    if n == 0:
        return []
    change = np.zeros(n - 1, dtype=bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    cuts = [0, *(np.flatnonzero(change) + 1).tolist(), n]
    return list(pairwise(cuts))


def _optional_ints(values: list[Any]) -> np.ndarray:
    """Ints where present, -1 where absent (None)."""
    floats = np.array(values, dtype=float)  # None -> nan
    return np.where(np.isnan(floats), -1, floats).astype(np.int64)


def _heads(records: JobRecords) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The records' nodes (each once), each row's node (a position in that list), each
    row's record time (an entry without its own ``ts`` has its record's)."""
    nodes: dict[str, int] = {}
    owner: list[int] = []
    head_ts: list[float] = []
    for head, entries in records:
        k = nodes.setdefault(head.node, len(nodes))
        n = len(entries)
        owner += [k] * n
        head_ts += [head.ts] * n
    return list(nodes), np.array(owner, dtype=np.intp), np.array(head_ts, dtype=float)


def _times(entries: list[Any], head_ts: np.ndarray) -> np.ndarray:
    own = np.array([e.ts for e in entries], dtype=float)
    return np.where(np.isnan(own), head_ts, own)


@dataclass
class StepColumns:
    """One job's step reports of a poll (see the module doc); absent ints are -1, an absent
    ``compute_s`` is nan."""

    nodes: list[str]
    node: np.ndarray  # position in ``nodes``
    ts: np.ndarray
    rank: np.ndarray
    gpu: np.ndarray
    stage: np.ndarray
    step: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    runs: list[tuple[int, int]]

    @classmethod
    def of_records(cls, records: JobRecords) -> StepColumns:
        nodes, node, head_ts = _heads(records)
        rows = list(chain.from_iterable(entries for _, entries in records))
        step = np.array([e.step for e in rows], dtype=np.int64)
        return cls(
            nodes,
            node,
            _times(rows, head_ts),
            np.array([e.rank for e in rows], dtype=np.int64),
            _optional_ints([e.gpu for e in rows]),
            _optional_ints([e.pp_stage for e in rows]),
            step,
            np.array([e.step_s for e in rows], dtype=float),
            np.array([e.compute_s for e in rows], dtype=float),
            runs_of(step),
        )

    def __len__(self) -> int:
        return len(self.rank)


@dataclass
class CollectiveColumns:
    """One job's collective reports of a poll; an absent ``end_ts`` is nan. ``comms`` and
    ``ops`` name each run's communicator and op; ``peers`` each row's connections (None
    where it sent none)."""

    nodes: list[str]
    node: np.ndarray
    ts: np.ndarray
    rank: np.ndarray
    seq: np.ndarray
    arrive_ts: np.ndarray
    end_ts: np.ndarray
    peers: list[Any]
    runs: list[tuple[int, int]]
    comms: list[str]
    ops: list[str]

    @classmethod
    def of_records(cls, records: JobRecords) -> CollectiveColumns:
        nodes, node, head_ts = _heads(records)
        rows = list(chain.from_iterable(entries for _, entries in records))
        names: dict[str, int] = {}
        comm = np.array([names.setdefault(e.comm, len(names)) for e in rows], dtype=np.int64)
        seq = np.array([e.seq for e in rows], dtype=np.int64)
        runs = runs_of(comm, seq)
        return cls(
            nodes,
            node,
            _times(rows, head_ts),
            np.array([e.rank for e in rows], dtype=np.int64),
            seq,
            np.array([e.arrive_ts for e in rows], dtype=float),
            np.array([e.end_ts for e in rows], dtype=float),
            [e.peers for e in rows],
            runs,
            [rows[a].comm for a, _ in runs],
            [rows[a].op for a, _ in runs],
        )

    def __len__(self) -> int:
        return len(self.rank)

"""GPU error detector: Xid errors, double-bit ECC increases and lost GPUs are critical.

These need no statistics and no persistence: one event is enough.

* an Xid reported in a sample (a new value, or the same value again after a clean sample);
  an application-caused Xid (:data:`~guard.schemas.nvml_codes.APPLICATION_XIDS`: 13, 31, 43,
  45 — a kernel's bad access, a page fault, a channel reset, the cleanup after a killed
  process) is an ``info`` observation, not a claim against the node;
* an increase of the cumulative ``ecc_dbe_total`` (a decrease is a counter reset — driver
  reload, agent restart — and only re-baselines);
* a lost GPU: Xid 79 ("fallen off the bus"), or a GPU that stops reporting for ``lost_after_s``
  while at least ``min_siblings`` other GPUs of the node keep reporting (a whole node that
  goes quiet is an agent or telemetry gap, not a GPU fault). Silence is found by
  :meth:`~GpuErrorDetector.tick`, at event time: a lost GPU sends nothing to react to.

Parameters
----------
node
    The node this detector watches (one instance per node).
lost_after_s
    Silence of one GPU, while its siblings report, that counts as lost.
min_siblings
    Siblings that must keep reporting.
ignore_xids
    Xids that give no finding at all (none by default; e.g. an Xid a site knows to be noise).
info_xids
    Xids that are ``info`` observations instead of ``critical`` claims (default: the
    application-caused ones).

References
----------
NVIDIA, "Xid Errors" (GPU deployment and management documentation).

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_errors import GpuErrorDetector
>>> det = GpuErrorDetector("n1")
>>> det.update(GpuSample(ts=1.0, node="n1", gpu=0, ecc_dbe_total=0))
[]
>>> det.update(GpuSample(ts=2.0, node="n1", gpu=0, ecc_dbe_total=0, xid=None))
[]
>>> [(f.severity, f.evidence["error"]) for f in det.update(
...     GpuSample(ts=3.0, node="n1", gpu=0, ecc_dbe_total=2, xid=48))]
[('critical', 'xid'), ('critical', 'ecc_dbe')]
>>> det.update(GpuSample(ts=4.0, node="n1", gpu=0, ecc_dbe_total=0))  # reset: no error
[]
>>> det.tick(100.0)  # silent, but no siblings report either: a telemetry gap
[]
>>> [(f.severity, f.evidence["application"]) for f in det.update(
...     GpuSample(ts=5.0, node="n1", gpu=0, xid=31))]  # a page fault of the application
[('info', True)]

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas import GpuSample
from guard.schemas.nvml_codes import APPLICATION_XIDS, XID_GPU_LOST

from .findings import Finding
from .gpu_round import GpuColumns

__all__ = ["GpuErrorDetector", "update_errors", "update_errors_at"]

#: a field the sample did not report (an Xid or the DBE total)
_MISSING = -1


class GpuErrorDetector:
    """Per-node detector of hard GPU errors; each GPU's state is a row of small arrays
    (the row of the GPU in :attr:`gpus`, which the node's other GPU rules share)."""

    name = "gpu_errors"

    def __init__(
        self,
        node: str,
        lost_after_s: float = 60.0,
        min_siblings: int = 3,
        ignore_xids: frozenset[int] | tuple[int, ...] | list[int] = frozenset(),
        info_xids: frozenset[int] | tuple[int, ...] | list[int] = frozenset(APPLICATION_XIDS),
    ) -> None:
        self.node = node
        #: The node's current job, for lost-GPU findings; the node's detectors keep it.
        self.job: str | None = None
        self.lost_after_s = lost_after_s
        self.min_siblings = min_siblings
        self.ignore_xids = frozenset(ignore_xids)
        self.info_xids = frozenset(info_xids)
        #: GPU index -> row of the arrays below
        self.gpus: dict[int, int] = {}
        self.last_ts = np.empty(0)  # newest sample time
        self.lost = np.empty(0, dtype=bool)  # claimed lost, not heard from since
        self.codes = np.empty((0, 2), dtype=np.int64)  # last DBE total reported, last Xid

    def rows(self, gpus: Sequence[int]) -> list[int]:
        """Rows of ``gpus``, new GPUs added."""
        known = self.gpus
        out = []
        for gpu in gpus:
            row = known.get(gpu)
            if row is None:
                row = known[gpu] = len(known)
                self.last_ts = np.append(self.last_ts, 0.0)
                self.lost = np.append(self.lost, False)
                self.codes = np.concatenate([self.codes, [[_MISSING, _MISSING]]])
            out.append(row)
        return out

    def update(self, message: GpuSample) -> list[Finding]:
        """Errors reported by one sample (what tests use; the core hands in columns)."""
        if message.job is not None:
            self.job = message.job
        return update_errors([self], np.zeros(1, dtype=np.intp), GpuColumns.of_samples([message]))

    def tick(self, now: float) -> list[Finding]:
        """GPUs silent for ``lost_after_s`` at event time ``now`` while siblings report."""
        silent = now - self.last_ts >= self.lost_after_s
        if not silent.any() or len(silent) - int(silent.sum()) < self.min_siblings:
            return []
        found: list[Finding] = []
        for gpu, row in self.gpus.items():
            if not silent[row] or self.lost[row]:
                continue
            self.lost[row] = True
            last = float(self.last_ts[row])
            found.append(
                Finding(
                    detector=self.name,
                    category="gpu_error",
                    severity="critical",
                    node=self.node,
                    ts=now,
                    since=last,
                    score=1.0,
                    job=self.job,
                    gpu=gpu,
                    evidence={
                        "error": "lost_gpu",
                        "silent_s": round(now - last, 3),
                        "last_seen_ts": last,
                    },
                )
            )
        return found

    def flush(self) -> list[Finding]:
        return []  # every error is found as it arrives or by tick


def update_errors(
    nodes: Sequence[GpuErrorDetector], owner: np.ndarray, cols: GpuColumns
) -> list[Finding]:
    """:func:`update_errors_at` without the positions."""
    return [f for _, f in update_errors_at(nodes, owner, cols)]


def update_errors_at(
    nodes: Sequence[GpuErrorDetector], owner: np.ndarray, cols: GpuColumns
) -> list[tuple[int, Finding]]:
    """One step's GPU samples (``cols``) of several nodes, row ``i`` of ``nodes[owner[i]]``:
    each GPU's samples in arrival order against the one before (its Xid, its DBE total);
    the findings in arrival order, each with its row. The Xid lists are the first node's.
    Each sample's GPU row in its node is left in ``cols.row``."""
    n = len(cols)
    if not n:
        return []
    local = np.empty(n, dtype=np.intp)
    base = np.zeros(len(nodes) + 1, dtype=np.intp)
    for k, det in enumerate(nodes):
        mine = np.flatnonzero(owner == k) if len(nodes) > 1 else np.arange(n)
        local[mine] = det.rows(cols.gpu[mine].tolist())
        base[k + 1] = base[k] + len(det.gpus)
    cols.row = local
    row = base[owner] + local
    codes = np.concatenate([det.codes for det in nodes])
    last_ts = np.concatenate([det.last_ts for det in nodes])
    order = np.argsort(row, kind="stable")
    r = row[order]
    start = np.r_[True, r[1:] != r[:-1]]
    xid, dbe = cols.xid[order], cols.dbe[order]
    prev_xid = np.where(start, codes[r, 1], np.r_[_MISSING, xid[:-1]])
    # the DBE total before each sample: the GPU's latest one reported, carried over gaps
    known = (dbe != _MISSING) | start
    carried = np.where(start & (dbe == _MISSING), codes[r, 0], dbe)
    before = carried[np.maximum.accumulate(np.where(known, np.arange(n), 0))]
    prev_dbe = np.where(start, codes[r, 0], np.r_[_MISSING, before[:-1]])
    new_xid = (xid != _MISSING) & (xid != prev_xid)
    rise = (dbe != _MISSING) & (prev_dbe != _MISSING) & (dbe > prev_dbe)
    last = np.r_[start[1:], True]
    codes[r[last], 1] = xid[last]
    codes[r[last], 0] = before[last]
    np.maximum.at(last_ts, row, cols.ts)
    found: list[tuple[int, int, Finding]] = []
    cfg = nodes[0]
    for j in np.flatnonzero(new_xid | rise).tolist():
        i = int(order[j])
        if new_xid[j] and int(xid[j]) not in cfg.ignore_xids:
            x = int(xid[j])
            application = x in cfg.info_xids
            detail = {"xid": x, "lost_gpu": x == XID_GPU_LOST, "application": application}
            found.append(
                (i, 0, _finding(cols, i, "xid", detail, "info" if application else "critical"))
            )
        if rise[j]:
            detail = {"ecc_dbe_total": int(dbe[j]), "increase": int(dbe[j] - prev_dbe[j])}
            found.append((i, 1, _finding(cols, i, "ecc_dbe", detail)))
    for k, det in enumerate(nodes):
        a, b = base[k], base[k + 1]
        det.codes, det.last_ts = codes[a:b].copy(), last_ts[a:b].copy()
        det.lost[np.unique(local[owner == k])] = False
    found.sort(key=lambda item: item[:2])
    return [(i, f) for i, _, f in found]


def _finding(
    cols: GpuColumns, i: int, error: str, detail: dict[str, Any], severity: str = "critical"
) -> Finding:
    ts = float(cols.ts[i])
    return Finding(
        detector=GpuErrorDetector.name,
        category="gpu_error",
        severity=severity,
        node=cols.node[i],
        ts=ts,
        since=ts,
        score=1.0,
        job=cols.job[i],
        gpu=int(cols.gpu[i]),
        evidence={"error": error, **detail},
    )

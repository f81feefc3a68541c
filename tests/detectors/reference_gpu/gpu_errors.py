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

from typing import Any

from guard.detectors.findings import Finding
from guard.schemas import GpuSample
from guard.schemas.nvml_codes import APPLICATION_XIDS, XID_GPU_LOST

__all__ = ["GpuErrorDetector"]


class _GpuErrorState:
    __slots__ = ("dbe", "last_ts", "lost", "xid")

    def __init__(self) -> None:
        self.dbe: int | None = None
        self.xid: int | None = None
        self.last_ts = 0.0
        self.lost = False


class GpuErrorDetector:
    """Per-node detector of hard GPU errors."""

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
        self.gpus: dict[int, _GpuErrorState] = {}

    def update(self, message: GpuSample) -> list[Finding]:
        """Errors reported by one sample (an Xid, a double-bit ECC increase)."""
        s = message
        if s.job is not None:
            self.job = s.job
        st = self.gpus.get(s.gpu)
        if st is None:
            st = self.gpus[s.gpu] = _GpuErrorState()
        st.last_ts = max(st.last_ts, s.ts)
        st.lost = False
        found: list[Finding] = []
        xid = s.xid
        if xid is not None and xid != st.xid and xid not in self.ignore_xids:
            application = xid in self.info_xids
            detail = {"xid": xid, "lost_gpu": xid == XID_GPU_LOST, "application": application}
            severity = "info" if application else "critical"
            found.append(self._finding(s, "xid", detail, s.ts, severity))
        st.xid = xid
        dbe = s.ecc_dbe_total
        if dbe is not None:
            if st.dbe is not None and dbe > st.dbe:
                found.append(
                    self._finding(
                        s, "ecc_dbe", {"ecc_dbe_total": dbe, "increase": dbe - st.dbe}, s.ts
                    )
                )
            st.dbe = dbe
        return found

    def tick(self, now: float) -> list[Finding]:
        """GPUs silent for ``lost_after_s`` at event time ``now`` while siblings report."""
        silent = [g for g, st in self.gpus.items() if now - st.last_ts >= self.lost_after_s]
        if not silent or len(self.gpus) - len(silent) < self.min_siblings:
            return []
        found: list[Finding] = []
        for gpu in silent:
            st = self.gpus[gpu]
            if st.lost:
                continue
            st.lost = True
            found.append(
                Finding(
                    detector=self.name,
                    category="gpu_error",
                    severity="critical",
                    node=self.node,
                    ts=now,
                    since=st.last_ts,
                    score=1.0,
                    job=self.job,
                    gpu=gpu,
                    evidence={
                        "error": "lost_gpu",
                        "silent_s": round(now - st.last_ts, 3),
                        "last_seen_ts": st.last_ts,
                    },
                )
            )
        return found

    def flush(self) -> list[Finding]:
        return []  # every error is found as it arrives or by tick

    def _finding(
        self,
        s: GpuSample,
        error: str,
        detail: dict[str, Any],
        since: float,
        severity: str = "critical",
    ) -> Finding:
        return Finding(
            detector=self.name,
            category="gpu_error",
            severity=severity,
            node=s.node,
            ts=s.ts,
            since=since,
            score=1.0,
            job=s.job,
            gpu=s.gpu,
            evidence={"error": error, **detail},
        )

"""Job step-time regression: river's Page-Hinkley test on the job's median step time.

A whole job that gets slower (a data-pipeline stall that lasts, a software regression, a
fabric that degrades for everyone) is not a node fault, but an operator wants to know. Per
job and per step, the median ``step_s`` over the ranks that reported is fed to a
:class:`river.drift.PageHinkley` detector (mode ``up``: only slowdowns); a drift gives one
job-level ``anomaly`` info flag. One detector per job, shared by all its ranks: constant
state however large the job. Short slowdowns (a checkpoint) move the cumulative sum a
little and are forgotten; a lasting change in level is what Page-Hinkley is built for.

Parameters
----------
job
    The job this detector watches.
threshold
    Page-Hinkley threshold, in units of relative step time (``step_s / baseline - 1``
    accumulates).
min_instances
    Steps before the test can fire.
delta
    Tolerated drift per step.

References
----------
Page, E. S. (1954). "Continuous Inspection Schemes". Biometrika 41 (1/2).
river ``drift.PageHinkley``.

Example
-------
>>> from guard.schemas import StepTiming
>>> from guard.detectors.step_regression import StepRegressionDetector
>>> det = StepRegressionDetector("job-a")
>>> found = []
>>> for step in range(200):
...     slow = 1.3 if step >= 120 else 1.0
...     for rank in range(4):
...         found += det.update(StepTiming(ts=2.0 * step, node=f"n{rank}", job="job-a",
...             rank=rank, step=step, step_s=2.0 * slow * (1 + 0.01 * ((step * 7) % 3))))
>>> [(f.category, f.severity, f.evidence["step"] >= 120) for f in found]
[('anomaly', 'info', True)]

"""

from __future__ import annotations

from typing import Any

from river import drift

from guard.schemas import StepTiming

from .findings import Finding
from .job_columns import StepColumns
from .robust import median

__all__ = ["StepRegressionDetector"]


class StepRegressionDetector:
    """Per-job drift test of the median step time."""

    name = "step_regression"

    def __init__(
        self, job: str, threshold: float = 2.0, min_instances: int = 30, delta: float = 0.02
    ) -> None:
        self.job = job
        self.test = drift.PageHinkley(
            min_instances=min_instances, delta=delta, threshold=threshold, mode="up"
        )
        self.pending: dict[int, list[float]] = {}
        self.pending_ts: dict[int, float] = {}
        self.baseline: float | None = None
        self.closed_through = -1
        self.steps = 0

    def update(self, message: StepTiming) -> list[Finding]:
        """Add one rank's step time (:meth:`add_steps` of one row)."""
        return self.add_steps(StepColumns.of_records([(message, [message])]))

    def add_steps(self, cols: StepColumns) -> list[Finding]:
        """Add a poll's step reports of the job; return the drift found by the steps they
        closed (a step closes when one two later is seen)."""
        pending = self.pending
        found: list[Finding] = []
        for a, b in cols.runs:
            step = int(cols.step[a])
            if step <= self.closed_through:
                continue
            values = pending.get(step)
            if values is None:
                values = pending[step] = []
            values += cols.step_s[a:b].tolist()
            newest = float(cols.ts[a:b].max())
            if newest > self.pending_ts.get(step, -1.0):
                self.pending_ts[step] = newest
            if min(pending) <= step - 2:  # a step to close: most runs close none
                for done in [s for s in pending if s <= step - 2]:
                    found += self._close(done)
        return found

    def tick(self, now: float) -> list[Finding]:
        return []  # steps close on later steps' messages, not on time

    def flush(self) -> list[Finding]:
        """Close every pending step (end of input)."""
        found: list[Finding] = []
        for step in sorted(self.pending):
            found += self._close(step)
        return found

    def _close(self, step: int) -> list[Finding]:
        values = self.pending.pop(step)
        ts = self.pending_ts.pop(step)
        self.closed_through = max(self.closed_through, step)
        value = median(values)
        if self.baseline is None:
            self.baseline = value
        if self.baseline <= 0.0:
            return []
        relative = value / self.baseline - 1.0
        self.test.update(relative)  # type: ignore[no-untyped-call]
        self.steps += 1
        if not self.test.drift_detected:
            if self.steps < 30:  # the baseline settles over the first steps
                self.baseline += (value - self.baseline) / self.steps
            return []
        evidence: dict[str, Any] = {
            "metric": "step_s",
            "step": step,
            "median_step_s": round(value, 6),
            "baseline_step_s": round(self.baseline, 6),
            "slower_pct": round(100.0 * relative, 1),
        }
        self.baseline = value
        return [
            Finding(
                detector=self.name,
                category="anomaly",
                severity="info",
                node=None,
                ts=ts,
                since=ts,
                score=round(relative, 4),
                job=self.job,
                evidence=evidence,
            )
        ]

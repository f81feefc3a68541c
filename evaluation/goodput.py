"""Goodput and step-time variation of a training job, from its step log and its crashes.

A job's *step log* is ``[(end_ts, step_s)]``, one entry per completed step. Steps done
between the last checkpoint and a crash are redone after the restart, so a crash's
``lost_steps`` are subtracted: *useful* steps are completed minus lost. Goodput is useful
steps per hour of wall time (restarts, hangs and redone work all count against it).

Variation is measured the way the Guard paper means it, window to window: the coefficient
of variation of the mean step time over consecutive windows. Steps inside a *confounder*
span (a checkpoint save, a data stall: the whole job waits, no node is at fault) are left out
of the variation and reported apart.

Example
-------
>>> log = [(10.0 + 2 * i, 2.0) for i in range(100)]  # 100 steps of 2 s, t = 10..208
>>> goodput_per_hour(log, [(100.0, 20)], 0.0, 210.0)
1371.4
>>> curve = useful_curve(log, [(100.0, 20)], 0.0, 210.0, bin_s=50.0)
>>> [(t, n) for t, n in curve]
[(50.0, 21), (100.0, 26), (150.0, 51), (200.0, 76), (210.0, 80)]
>>> window_cv(log, 50.0)
0.0
>>> ahead_after([(0.0, 0), (10.0, 5), (20.0, 20), (30.0, 31)],
...             [(0.0, 0), (10.0, 10), (20.0, 15), (30.0, 30)])
20.0
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

__all__ = [
    "ahead_after",
    "confounder_steps",
    "goodput_per_hour",
    "useful_curve",
    "window_cv",
]

StepLog = Sequence[tuple[float, float]]
Crashes = Sequence[tuple[float, int]]  # (ts, lost steps)
Spans = Sequence[tuple[float, float]]


def _in_spans(start: float, end: float, spans: Spans) -> bool:
    return any(start < s_end and end > s_start for s_start, s_end in spans)


def goodput_per_hour(log: StepLog, crashes: Crashes, start_ts: float, end_ts: float) -> float:
    """Useful steps per hour between ``start_ts`` and ``end_ts``."""
    hours = max(end_ts - start_ts, 1e-9) / 3600
    done = sum(1 for end, _ in log if start_ts <= end <= end_ts)
    lost = sum(n for ts, n in crashes if start_ts <= ts <= end_ts)
    return round((done - lost) / hours, 1)


def useful_curve(
    log: StepLog, crashes: Crashes, start_ts: float, end_ts: float, bin_s: float
) -> list[tuple[float, int]]:
    """Cumulative useful steps at every ``bin_s`` from ``start_ts`` (seconds since it)."""
    ends = sorted(end for end, _ in log)
    before = bisect.bisect_left(ends, start_ts)
    out = []
    t = start_ts + bin_s
    while True:
        t = min(t, end_ts)
        done = bisect.bisect_right(ends, t) - before
        gone = sum(n for ts, n in crashes if start_ts <= ts <= t)
        out.append((round(t - start_ts, 3), done - gone))
        if t >= end_ts:
            return out
        t += bin_s


def window_cv(log: StepLog, window_s: float, confounders: Spans = ()) -> float:
    """CV of the per-window mean step time (confounder steps left out; windows with a step)."""
    if not log:
        return 0.0
    first = min(end - s for end, s in log)
    sums: dict[int, list[float]] = {}
    for end, step_s in log:
        if not _in_spans(end - step_s, end, confounders):
            sums.setdefault(int((end - first) // window_s), []).append(step_s)
    means = [statistics.fmean(v) for v in sums.values()]
    if len(means) < 2:
        return 0.0
    return statistics.pstdev(means) / statistics.fmean(means)


def confounder_steps(log: StepLog, confounders: Spans) -> dict[str, float]:
    """Steps that overlap a confounder span: how many, and their total time (s)."""
    hit = [s for end, s in log if _in_spans(end - s, end, confounders)]
    return {"steps": len(hit), "seconds": round(sum(hit), 1)}


def ahead_after(
    with_guard: Sequence[tuple[float, int]], without: Sequence[tuple[float, int]]
) -> float | None:
    """The first time from which the first curve stays strictly above the second to the end
    (None: it is not ahead at the end). Both curves are sampled at the same times."""
    ahead: float | None = None
    for (t, w), (_, wo) in zip(with_guard, without, strict=True):
        if w > wo:
            if ahead is None:
                ahead = t
        else:
            ahead = None
    return ahead

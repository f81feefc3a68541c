"""Robust statistics over small peer groups: median and scaled median absolute deviation.

Peer groups are a job's ranks or a node's GPUs: tens to a few thousand values, compared
once per step or per sampling round. Plain ``sorted`` beats numpy below a few hundred values
(no array conversion), so both are used by size.

Example
-------
>>> from guard.detectors.robust import median, mad_sigma
>>> median([3.0, 1.0, 2.0, 100.0])
2.5
>>> round(mad_sigma([1.0, 1.1, 0.9, 1.0, 5.0]), 4)
0.1483

"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAD_TO_SIGMA", "mad_sigma", "median", "row_medians"]

#: Scale that makes the MAD a consistent estimator of a normal's standard deviation.
MAD_TO_SIGMA = 1.4826
_NUMPY_ABOVE = 512


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    n = len(values)
    if n > _NUMPY_ABOVE:
        return float(np.median(np.asarray(values, dtype=float)))
    s = sorted(values)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def mad_sigma(values: Sequence[float], center: float | None = None) -> float:
    """``1.4826 * median(|x - median(x)|)``: a standard deviation that ignores outliers."""
    c = median(values) if center is None else center
    return MAD_TO_SIGMA * median([abs(v - c) for v in values])


def row_medians(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Median of each row of a matrix over its non-NaN cells (NaN: none), and how many.

    >>> m, n = row_medians(np.array([[1.0, 5.0, np.nan], [np.nan, np.nan, np.nan]]))
    >>> m.tolist(), n.tolist()
    ([3.0, nan], [2, 0])
    """
    ordered = np.sort(values, axis=1)  # NaN last
    n = (~np.isnan(ordered)).sum(1)
    if ordered.shape[1] == 0:
        return np.full(len(ordered), np.nan), n
    rows = np.arange(len(ordered))
    hi = ordered[rows, np.maximum(n // 2, 0)]
    lo = ordered[rows, np.maximum(n // 2 - 1, 0)]
    out = np.where(n % 2 == 1, hi, 0.5 * (lo + hi))
    out[n == 0] = np.nan
    return out, n

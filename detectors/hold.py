"""Hysteresis for per-sample conditions: raise after ``raise_after`` hits, clear after calm.

Node telemetry rules (a temperature above peers, a reason bit held, an error counter rising)
are evaluated once per sampling round; a condition that holds for one round is noise, one
that holds ``raise_after`` times in the last ``within`` rounds is a finding, and it is
withdrawn after ``clear_after`` rounds in a row without it. Tiny state: four numbers.

Parameters
----------
raise_after
    Rounds with the condition needed to raise.
within
    Size of the recent-round window those hits must fall in.
clear_after
    Calm rounds in a row that clear an active finding.

Example
-------
>>> from guard.detectors.hold import Hold
>>> h = Hold()
>>> [h.update(c, ts) for ts, c in enumerate([True, False, True, True, False, False])]
[None, None, 'raise', None, None, None]
>>> h.since
2.0

"""

from __future__ import annotations

import numpy as np

__all__ = ["CLEAR", "HOLD_FIELDS", "NO_EVENT", "RAISE", "Hold", "arrival_rank", "step_holds"]


class Hold:
    """Raise/clear state of one condition on one component."""

    __slots__ = ("active", "bits", "calm", "clear_after", "raise_after", "since", "within")

    def __init__(self, raise_after: int = 2, within: int = 3, clear_after: int = 10) -> None:
        self.raise_after = raise_after
        self.within = within
        self.clear_after = clear_after
        self.bits = 0
        self.active = False
        self.calm = 0
        self.since = 0.0

    def update(self, condition: bool, ts: float) -> str | None:
        """Add one round's verdict; return ``"raise"``, ``"clear"`` or ``None``."""
        if not condition and not self.bits and not self.active:
            return None  # the common case: nothing going on
        if condition and not (self.bits & 1):
            self.since = float(ts)  # start of the current run of hits
        self.bits = ((self.bits << 1) | int(condition)) & ((1 << self.within) - 1)
        if not self.active:
            if self.bits.bit_count() >= self.raise_after:
                self.active = True
                self.calm = 0
                return "raise"
            return None
        if condition:
            self.calm = 0
            return None
        self.calm += 1
        if self.calm >= self.clear_after:
            self.active = False
            self.bits = 0
            return "clear"
        return None


#: the columns of a hold kept in an array (one row per component): see :func:`step_holds`
HOLD_FIELDS = ("bits", "active", "calm", "since")
NO_EVENT, RAISE, CLEAR = 0, 1, 2


def step_holds(
    state: np.ndarray,
    condition: np.ndarray,
    ts: np.ndarray,
    raise_after: int = 2,
    within: int = 3,
    clear_after: int = 10,
) -> np.ndarray:
    """:meth:`Hold.update` over many components at once: ``state`` is a float array of
    rows ``(bits, active, calm, since)`` (:data:`HOLD_FIELDS`, updated in place), one row
    per ``condition`` and ``ts``; returns each row's event (:data:`NO_EVENT`, :data:`RAISE`,
    :data:`CLEAR`).

    >>> import numpy as np
    >>> state = np.zeros((2, 4))
    >>> [step_holds(state, np.array([c, False]), np.array([float(t)] * 2)).tolist()
    ...  for t, c in enumerate([True, False, True, True])]
    [[0, 0], [0, 0], [1, 0], [0, 0]]
    >>> state[0].tolist()  # bits 0b011 (the last 3 rounds), active, calm 0, since 2.0
    [3.0, 1.0, 0.0, 2.0]
    """
    bits = state[:, 0].astype(np.int64)
    active = state[:, 1] > 0.0
    calm = state[:, 2]
    since = state[:, 3]
    busy = condition | (bits != 0) | active  # rows with nothing going on keep their state
    starts = busy & condition & ((bits & 1) == 0)
    since = np.where(starts, ts, since)
    bits = np.where(busy, ((bits << 1) | condition) & ((1 << within) - 1), bits)
    hits = _bit_count(bits)
    raised = busy & ~active & (hits >= raise_after)
    calm = np.where(raised | (busy & active & condition), 0.0, calm)
    calming = busy & active & ~condition
    calm = np.where(calming, calm + 1.0, calm)
    cleared = calming & (calm >= clear_after)
    active = (active | raised) & ~cleared
    bits = np.where(cleared, 0, bits)
    state[:, 0] = bits
    state[:, 1] = active
    state[:, 2] = calm
    state[:, 3] = since
    return np.where(raised, RAISE, np.where(cleared, CLEAR, NO_EVENT))


def arrival_rank(keys: np.ndarray) -> np.ndarray:
    """Each entry's rank among the entries of its key, in order (0 for the first): the
    pass in which :func:`step_holds` may take it, a component's updates one per pass.

    >>> arrival_rank(np.array([7, 3, 7, 7, 3])).tolist()
    [0, 0, 1, 2, 1]
    """
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    rank = np.arange(len(keys)) - np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    out = np.empty(len(keys), dtype=np.intp)
    out[order] = rank
    return out


def _bit_count(bits: np.ndarray) -> np.ndarray:
    """Set bits of each (small, non-negative) integer."""
    count = np.zeros_like(bits)
    rest = bits.copy()
    while rest.any():
        count += rest & 1
        rest >>= 1
    return count

"""Persistent deviation from peers: the rule that turns per-round residuals into a claim.

Every round (a training step, a collective, a sampling round) each member of a peer group
gets a *residual*: how much worse than the group's median it was (``0.05`` = 5 % slower).
One bad round is a hiccup; a random member that is slow for a round or two is moving
imbalance; neither is a fault. A member is *slow in a window* when, over its last
``window`` rounds, at least ``min_fraction`` of them were beyond the noise threshold and
its mean residual (winsorised, so one huge hiccup cannot carry the mean) is at least
``min_mean``. It is *flagged* when it was slow in ``m`` of its last ``n`` windows, and cleared
after ``clear_after`` windows in a row that were not slow. A rank that is slow only part of
the time (say every other step) still fills half its window and is caught; a gradual
slowdown is caught once it clears the thresholds.

The noise threshold adapts to the group: ``max(min_residual, z * sigma)`` where sigma is an
exponentially smoothed, MAD-based spread of the group's residuals, so jittery jobs need a
larger deviation than quiet ones.

Parameters
----------
window
    Rounds per window.
min_fraction
    Fraction of the window's rounds that must be slow.
min_residual
    Smallest residual that counts as slow in one round.
min_mean
    Smallest winsorised mean residual over the window.
z
    Multiples of the group's noise sigma a residual must exceed.
m, n
    Persistence: slow in ``m`` of the last ``n`` windows.
clear_after
    Windows in a row that are not slow before a flagged member is cleared.
cap
    Residuals are winsorised to ``[-cap, cap]`` for the mean.

References
----------
NVIDIA Resiliency Extension (NVRx) straggler detection: relative and individual
performance scores. https://github.com/NVIDIA/nvidia-resiliency-ext

Example
-------
>>> from guard.detectors.persistence import DeviationTracker, PersistenceRule
>>> rule = PersistenceRule()
>>> tracker = DeviationTracker()
>>> events = [tracker.update(0.08, sigma=0.01, rule=rule, round_ts=float(t)) for t in range(8)]
>>> events.index("raise")  # a steady 8 % slowdown is claimed after a few rounds
4
>>> hiccup = DeviationTracker()
>>> [hiccup.update(r, sigma=0.01, rule=rule, round_ts=0.0) for r in (0.0, 0.9, 0.0, 0.0, 0.0)]
[None, None, None, None, None]

"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["DeviationTracker", "PersistenceRule"]


@dataclass(frozen=True, slots=True)
class PersistenceRule:
    """Thresholds shared by all members of all groups of one detector."""

    window: int = 8
    min_fraction: float = 0.5
    min_residual: float = 0.02
    min_mean: float = 0.02
    z: float = 3.0
    m: int = 2
    n: int = 3
    clear_after: int = 8
    cap: float = 0.5


class DeviationTracker:
    """One member's recent residuals and its flagged state (a few hundred bytes pickled)."""

    __slots__ = ("active", "calm", "residuals", "since_ts", "slow", "windows")

    def __init__(self) -> None:
        self.residuals: deque[float] = deque()
        self.slow: deque[float] = deque()  # round timestamps of slow rounds, -1.0 for normal
        self.windows = 0  # bit history of window verdicts, newest in bit 0
        self.active = False
        self.calm = 0
        self.since_ts = 0.0

    def mean(self) -> float:
        return sum(self.residuals) / len(self.residuals) if self.residuals else 0.0

    def slow_mean(self) -> float:
        """Mean residual over the window's slow rounds (how slow the member is when slow)."""
        picked = [r for r, s in zip(self.residuals, self.slow, strict=True) if s >= 0.0]
        return sum(picked) / len(picked) if picked else 0.0

    def slow_rounds(self) -> int:
        return sum(1 for s in self.slow if s >= 0.0)

    def update(
        self, residual: float, sigma: float, rule: PersistenceRule, round_ts: float
    ) -> str | None:
        """Add one round; return ``"raise"``, ``"clear"`` or ``None``."""
        cap = rule.cap
        r = cap if residual > cap else (-cap if residual < -cap else residual)
        res = self.residuals
        slow = self.slow
        res.append(r)
        threshold = max(rule.min_residual, rule.z * sigma)
        slow.append(round_ts if residual > threshold else -1.0)
        if len(res) > rule.window:
            res.popleft()
            slow.popleft()
        full = len(res) >= rule.window // 2
        n_slow = sum(1 for s in slow if s >= 0.0)
        verdict = (
            full
            and n_slow >= rule.min_fraction * rule.window
            and sum(res) / len(res) >= rule.min_mean
        )
        self.windows = ((self.windows << 1) | int(verdict)) & ((1 << rule.n) - 1)
        if not self.active:
            if verdict and self.windows.bit_count() >= rule.m:
                self.active = True
                self.calm = 0
                self.since_ts = next(s for s in slow if s >= 0.0)
                return "raise"
            return None
        if verdict:
            self.calm = 0
            return None
        self.calm += 1
        if self.calm >= rule.clear_after:
            self.active = False
            self.windows = 0
            return "clear"
        return None

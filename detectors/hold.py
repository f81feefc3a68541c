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

__all__ = ["Hold"]


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

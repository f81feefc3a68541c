"""Clock detector: a loaded GPU whose SM clock sits below its siblings' without being idle.

Per sampling round of a node, a GPU is suspect when it is under load (``util_pct >=
min_util``), the idle reason bit (0x1) is clear, and its SM clock is more than ``low_ratio``
below the node's median SM clock. Thermal and power throttling also lower clocks; fusion
reports those under their cause, and this rule catches the rest (a stuck clock, an
application clock set low, a hw slowdown 0x8 without a thermal reason). The clock deficit
under load is itself the impact that a claim needs (``impact: sm_clock_deficit``).

Parameters
----------
low_ratio
    Fraction below the node's median SM clock that counts as low.
min_util
    Utilisation from which a GPU is considered loaded.
raise_after, within, clear_after
    Hysteresis, in sampling rounds.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuRound
>>> from guard.detectors.clocks import ClockDetector
>>> det = ClockDetector()
>>> found = []
>>> for t in range(4):
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=97,
...                             sm_clock_mhz=1980 - (600 if g == 6 else 0)) for g in range(8)}
...     found += det.update(GpuRound.of("n1", None, samples))
>>> [(f.gpu, f.category, f.evidence["below_peers_pct"]) for f in found]
[(6, 'clock', 30.3)]

"""

from __future__ import annotations

from typing import Any

from guard.detectors.findings import Finding
from guard.schemas.nvml_codes import IDLE

from .gpu_round import GpuRound, GpuRoundRule

__all__ = ["ClockDetector"]


class ClockDetector(GpuRoundRule):
    """Per-node SM clock rule over sibling GPUs."""

    name = "clocks"

    def __init__(
        self,
        low_ratio: float = 0.1,
        min_util: float = 50.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        super().__init__(raise_after, within, clear_after)
        self.low_ratio = low_ratio
        self.min_util = min_util

    def update(self, message: GpuRound) -> list[Finding]:
        """Findings of one sampling round (raises and clears of the GPUs' holds)."""
        clock_med = message.peer_median("sm_clock_mhz")
        if clock_med is None or clock_med <= 0.0:
            return []
        if not self.holds and self.low_ratio > 0.0:
            # the common case, no GPU with history: the slowest clock decides for the round
            slowest = min(message.peer_values("sm_clock_mhz"))
            if 1.0 - slowest / clock_med < self.low_ratio:
                return []
        found: list[Finding] = []
        low_ratio, min_util, holds = self.low_ratio, self.min_util, self.holds
        for gpu, s in message.samples.items():
            clock = s.sm_clock_mhz
            below = 1.0 - clock / clock_med if clock is not None else 0.0
            condition = (
                below >= low_ratio
                and s.util_pct is not None
                and s.util_pct >= min_util
                and not ((s.clock_event_reasons or 0) & IDLE)
            )
            # the common case, a healthy GPU without state, costs no call
            held = self.held(gpu, condition, s.ts) if condition or gpu in holds else None
            if held is None:
                continue
            evidence: dict[str, Any] = {
                "metric": "sm_clock_mhz",
                "sm_clock_mhz": clock,
                "peer_median_mhz": clock_med,
                "below_peers_pct": round(100.0 * below, 1),
                "util_pct": s.util_pct,
                "reasons": hex(s.clock_event_reasons or 0),
                "impact": "sm_clock_deficit",
            }
            score = round(below, 3)
            found.append(self.finding(message, gpu, held, "clock", "warning", score, evidence))
        return found

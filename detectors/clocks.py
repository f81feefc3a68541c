"""Clock detector: a loaded GPU whose SM clock sits below its siblings' without being idle.

Per sampling round of a node, a GPU is suspect when it is under load (``util_pct >=
min_util``), the idle reason bit (0x1) is clear, and its SM clock is more than ``low_ratio``
below the node's median SM clock. Thermal and power throttling also lower clocks; fusion
reports those
under their cause, and this rule catches the rest (a stuck clock, an application clock
set low, a hw slowdown 0x8 without a thermal reason).

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
>>> from guard.detectors.clocks import ClockDetector
>>> det = ClockDetector()
>>> found = []
>>> for t in range(4):
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=97,
...                             sm_clock_mhz=1980 - (600 if g == 6 else 0)) for g in range(8)}
...     found += det.evaluate("n1", None, samples, 10.0 * t)
>>> [(f.gpu, f.category, f.evidence["below_peers_pct"]) for f in found]
[(6, 'clock', 30.3)]

"""

from __future__ import annotations

from typing import Any

from guard.schemas import GpuSample

from .findings import Finding
from .gpu_round import peer_median
from .hold import Hold

__all__ = ["IDLE_BIT", "ClockDetector"]

IDLE_BIT = 0x1


class ClockDetector:
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
        self.low_ratio = low_ratio
        self.min_util = min_util
        self.hold_args = (raise_after, within, clear_after)
        self.holds: dict[int, Hold] = {}

    def evaluate(
        self, node: str, job: str | None, samples: dict[int, GpuSample], ts: float
    ) -> list[Finding]:
        clock_med = peer_median(samples, "sm_clock_mhz")
        if clock_med is None or clock_med <= 0.0:
            return []
        found: list[Finding] = []
        for gpu, s in samples.items():
            clock = s.sm_clock_mhz
            below = 1.0 - clock / clock_med if clock is not None else 0.0
            condition = (
                below >= self.low_ratio
                and s.util_pct is not None
                and s.util_pct >= self.min_util
                and not ((s.clock_event_reasons or 0) & IDLE_BIT)
            )
            hold = self.holds.get(gpu)
            if hold is None:
                if not condition:
                    continue
                hold = self.holds[gpu] = Hold(*self.hold_args)
            event = hold.update(condition, s.ts)
            if event is None:
                continue
            evidence: dict[str, Any] = {
                "metric": "sm_clock_mhz",
                "sm_clock_mhz": clock,
                "peer_median_mhz": clock_med,
                "below_peers_pct": round(100.0 * below, 1),
                "util_pct": s.util_pct,
                "reasons": hex(s.clock_event_reasons or 0),
                "since_ts": hold.since,
            }
            found.append(
                Finding(
                    detector=self.name,
                    category="clock",
                    severity="warning",
                    node=node,
                    ts=ts,
                    since=hold.since,
                    score=round(below, 3),
                    job=job,
                    gpu=gpu,
                    evidence=evidence,
                    clear=event == "clear",
                )
            )
        return found

"""Clock detector: a loaded GPU whose SM clock sits below its siblings' without being idle.

Per sampling round of a node, a GPU is suspect when it is under load (``util_pct >=
min_util``), the idle reason bit (0x1) is clear, and its SM clock is more than ``low_ratio``
below the node's median SM clock. Thermal and power throttling also lower clocks; fusion
reports those under their cause, and this rule catches the rest (a stuck clock, an
application clock set low, a hw slowdown 0x8 without a thermal reason). The clock deficit
under load is itself the impact that a claim needs (``impact: sm_clock_deficit``).

A smaller deficit that lasts is claimed by a CUSUM on it (:mod:`~guard.detectors.
sibling_cusum`; evidence ``raised_by: cusum``, its rounds and strength): a GPU 5 % below its
loaded siblings in three rounds. A round where the GPU touches its power limit (the sw
power-cap bit alone, which every loaded GPU does now and then, at a few per cent lower
clock) is not judged by it.

Parameters
----------
low_ratio
    Fraction below the node's median SM clock that counts as low.
min_deficit
    The CUSUM's smallest deficit worth ``k`` standard deviations (its spread's floor).
min_util
    Utilisation from which a GPU is considered loaded.
raise_after, within, clear_after
    Hysteresis, in sampling rounds.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.engine import NodeDetectors
>>> node = NodeDetectors("n1")
>>> found = []
>>> for t in range(5):
...     for g in range(8):
...         found += node.update(GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=97,
...                                        sm_clock_mhz=1980 - (600 if g == 6 else 0)))
>>> [(f.gpu, f.category, f.evidence["below_peers_pct"]) for f in found]
[(6, 'clock', 30.3)]
>>> node, found = NodeDetectors("n1"), []
>>> for t in range(5):  # GPU 3 runs 5 % below its siblings: under the rule's 10 %
...     for g in range(8):
...         found += node.update(GpuSample(ts=float(t), node="n1", gpu=g, util_pct=97,
...                                        sm_clock_mhz=1980 - (100 if g == 3 else 0)))
>>> [(f.gpu, f.ts, f.evidence["raised_by"], f.evidence["steps"]) for f in found]
[(3, 2.0, 'cusum', 3)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas.nvml_codes import IDLE, SW_POWER_CAP

from .findings import Finding
from .gpu_round import Event, GpuRoundRule, Holds, Rounds, finding, opt
from .sibling_cusum import ROUND_TEST, sibling_z

__all__ = ["ClockDetector"]


class ClockDetector(GpuRoundRule):
    """Per-node SM clock rule over sibling GPUs."""

    name = "clocks"
    slots = 3
    test = ROUND_TEST

    def __init__(
        self,
        low_ratio: float = 0.1,
        min_util: float = 50.0,
        min_deficit: float = 0.02,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        super().__init__(raise_after, within, clear_after)
        self.low_ratio = low_ratio
        self.min_util = min_util
        self.min_deficit = min_deficit

    def conditions(self, rounds: Rounds) -> tuple[Holds, dict[str, Any]]:
        """The claim's hold: well below the siblings' clock under load; a round whose GPUs
        report no clock is not judged at all."""
        clock, util = rounds.matrix("clock"), rounds.matrix("util")
        bits = rounds.matrix("reasons")
        med = rounds.median("clock")[:, None]
        judged = np.broadcast_to(med > 0.0, clock.shape)  # NaN: False
        below = np.where(~np.isnan(clock) & judged, 1.0 - clock / np.where(judged, med, 1.0), 0.0)
        loaded = (util >= self.min_util) & ((bits & IDLE) == 0)
        cond = (below >= self.low_ratio) & loaded
        siblings_loaded = rounds.median("util")[:, None] >= self.min_util
        judged_seq = judged & loaded & siblings_loaded & ~np.isnan(clock) & (bits != SW_POWER_CAP)
        z = sibling_z(below, judged_seq, self.min_deficit, self.test.k)
        seen = {"clock": clock, "util": util, "bits": bits, "med": med, "below": below}
        seen |= {"z": z, "deficit": below}
        return [(0, cond, judged)], seen

    def finding_of(
        self, seen: dict[str, Any], rounds: Rounds, nodes: Sequence[str], event: Event
    ) -> Finding:
        r, j, _, since, clear = event
        b = float(seen["below"][r, j])
        evidence: dict[str, Any] = {
            "metric": "sm_clock_mhz",
            "sm_clock_mhz": opt(seen["clock"][r, j]),
            "peer_median_mhz": float(seen["med"][r, 0]),
            "below_peers_pct": round(100.0 * b, 1),
            "util_pct": opt(seen["util"][r, j]),
            "reasons": hex(int(seen["bits"][r, j])),
            "impact": "sm_clock_deficit",
        }
        if event[2] == self.slots - 1:
            more, since = self.sequential_evidence(seen, r, j, since)
            evidence |= more
            b = evidence["excess_pct"] / 100.0
        return finding(
            self, rounds, nodes, r, j, "clock", "warning", round(b, 3), evidence, since, clear
        )

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
>>> from guard.detectors.engine import NodeDetectors
>>> node = NodeDetectors("n1")
>>> found = []
>>> for t in range(5):
...     for g in range(8):
...         found += node.update(GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=97,
...                                        sm_clock_mhz=1980 - (600 if g == 6 else 0)))
>>> [(f.gpu, f.category, f.evidence["below_peers_pct"]) for f in found]
[(6, 'clock', 30.3)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas.nvml_codes import IDLE

from .findings import Finding
from .gpu_round import GpuRoundRule, Rounds, finding, opt
from .hold import CLEAR

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

    def judge(
        self, rounds: Rounds, state: np.ndarray, rows: np.ndarray, nodes: Sequence[str]
    ) -> list[tuple[int, int, int, Finding]]:
        """Findings of a wave of rounds (raises and clears of the GPUs' holds); a round
        whose GPUs report no clock is not judged at all."""
        clock, util = rounds.matrix("clock"), rounds.matrix("util")
        bits = rounds.matrix("reasons")
        med = rounds.median("clock")[:, None]
        judged = np.broadcast_to(med > 0.0, clock.shape)  # NaN: False
        below = np.where(~np.isnan(clock) & judged, 1.0 - clock / np.where(judged, med, 1.0), 0.0)
        cond = (below >= self.low_ratio) & (util >= self.min_util) & ((bits & IDLE) == 0)
        found = []
        rs, js, events = self.held(state[:, 0], rounds, rows, cond, judged)
        for r, j, event in zip(rs.tolist(), js.tolist(), events.tolist(), strict=True):
            b = float(below[r, j])
            evidence: dict[str, Any] = {
                "metric": "sm_clock_mhz",
                "sm_clock_mhz": opt(clock[r, j]),
                "peer_median_mhz": float(med[r, 0]),
                "below_peers_pct": round(100.0 * b, 1),
                "util_pct": opt(util[r, j]),
                "reasons": hex(int(bits[r, j])),
                "impact": "sm_clock_deficit",
            }
            since = float(state[rows[r, j], 0, 3])
            f = finding(
                self,
                rounds,
                nodes,
                r,
                j,
                "clock",
                "warning",
                round(b, 3),
                evidence,
                since,
                event == CLEAR,
            )
            found.append((r, j, 0, f))
        return found

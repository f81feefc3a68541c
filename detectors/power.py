"""Power detector: a loaded GPU drawing less than its siblings, power-capped or braked.

Per sampling round of a node, a GPU is suspect when

* a hardware power brake (0x80) is asserted;
* its enforced power limit is below ``limit_ratio`` of the node's median limit (somebody
  or something capped it); or
* under load (``util_pct >= min_util``, within ``util_band`` points of the node's median
  utilisation) it draws less than ``1 - low_ratio`` of the node's median power *and* its
  clocks are held back (sw power cap 0x4, or SM clock below the node's median).

A GPU running at its limit with the sw power-cap bit set and the same power as its siblings
is normal life under heavy load and is not flagged.

Claims need impact: a brake, or a capped limit / low draw *with* its clocks held back (the
sw power-cap bit or an SM clock below its siblings'), is a ``warning`` whose evidence names
the impact signal (``impact``). A limit set below the siblings' or a low draw at full clocks
costs no speed: an ``info`` observation, never a sweep trigger.

A smaller power deficit that lasts is claimed by a CUSUM on it (:mod:`~guard.detectors.
sibling_cusum`; evidence ``raised_by: cusum``, its rounds and strength), counted only in the
rounds where it costs speed (a brake, a capped limit it runs into, or an SM clock held
``min_deficit`` below its siblings' other than by touching the limit); other loaded rounds
drain it, as healthy GPUs differ by several per cent in draw at the same clocks.

Parameters
----------
low_ratio
    Fraction below the median power that counts as low.
limit_ratio
    Fraction of the median enforced limit below which a limit counts as capped.
min_util, util_band
    Load conditions for the power comparison.
min_deficit
    The CUSUM's smallest deficit worth ``k`` standard deviations (its spread's floor), and
    the clock deficit that counts as held back.
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
...         found += node.update(GpuSample(ts=10.0 * t, node="n1", job="job", gpu=g,
...                                        util_pct=98, sm_clock_mhz=1980,
...                                        power_w=690 - (250 if g == 2 else 0), power_limit_w=700,
...                                        clock_event_reasons=0x4 if g == 2 else 0))
>>> [(f.gpu, f.severity, f.evidence["below_peers_pct"], f.evidence.get("impact")) for f in found]
[(2, 'info', 36.2, None), (2, 'warning', 36.2, 'sw_power_cap')]
>>> node, found = NodeDetectors("n1"), []
>>> for t in range(5):  # GPU 5 draws 5 % less, its clock 5 % down: under the rule's bars
...     for g in range(8):
...         low = g == 5
...         found += node.update(GpuSample(ts=float(t), node="n1", gpu=g, util_pct=98,
...                                        sm_clock_mhz=1880 if low else 1980,
...                                        power_w=617 if low else 650, power_limit_w=700))
>>> [(f.gpu, f.ts, f.evidence["raised_by"], f.evidence["steps"], f.evidence["excess_pct"])
...  for f in found if f.category == "power"]
[(5, 3.0, 'cusum', 4, 5.1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas.nvml_codes import HW_POWER_BRAKE, SW_POWER_CAP

from .findings import Finding
from .gpu_round import Event, GpuRoundRule, Holds, Rounds, finding, opt
from .sibling_cusum import ROUND_TEST, sibling_z

__all__ = ["PowerDetector"]

#: the impact a claim names, by code
_IMPACTS = (None, "hw_power_brake", "sw_power_cap", "sm_clock_deficit")


class PowerDetector(GpuRoundRule):
    """Per-node power rule over sibling GPUs (slots: claim, info)."""

    name = "power"
    slots = 4
    test = ROUND_TEST

    def __init__(
        self,
        low_ratio: float = 0.25,
        limit_ratio: float = 0.9,
        min_util: float = 50.0,
        util_band: float = 15.0,
        min_deficit: float = 0.03,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        super().__init__(raise_after, within, clear_after)
        self.low_ratio = low_ratio
        self.limit_ratio = limit_ratio
        self.min_util = min_util
        self.util_band = util_band
        self.min_deficit = min_deficit

    def conditions(self, rounds: Rounds) -> tuple[Holds, dict[str, Any]]:
        """The observation's hold (capped below the siblings' limit, or drawing well below
        them at the same load), then the claim's (that, with an impact on speed)."""
        power, limit = rounds.matrix("power"), rounds.matrix("limit")
        util, clock = rounds.matrix("util"), rounds.matrix("clock")
        bits = rounds.matrix("reasons")
        power_med = rounds.median("power")[:, None]
        limit_med = rounds.median("limit")[:, None]
        util_med = rounds.median("util")[:, None]
        clock_med = rounds.median("clock")[:, None]
        brake = (bits & HW_POWER_BRAKE) != 0
        capped = limit < self.limit_ratio * limit_med  # NaN: False
        rated = ~np.isnan(power) & ~np.isnan(power_med) & (power_med != 0)
        below = np.where(rated, 1.0 - power / np.where(rated, power_med, 1.0), 0.0)
        level = (util >= self.min_util) & (np.abs(util - util_med) <= self.util_band)
        low = (below >= self.low_ratio) & level
        odd = capped | low
        at_cap = (bits & SW_POWER_CAP) != 0
        impact = np.select([brake, odd & at_cap, odd & (clock < 0.97 * clock_med)], [1, 2, 3], 0)
        # the CUSUM: loaded like its siblings; a round counts where the deficit costs speed
        judged = rated & level & (util_med >= self.min_util)
        held_back = (clock < (1.0 - self.min_deficit) * clock_med) & (bits != SW_POWER_CAP)
        costs = np.select([brake, capped & at_cap, held_back], [1, 2, 3], 0)
        z = sibling_z(below, judged, self.min_deficit, self.test.k)
        z = np.where(costs != 0, z, np.where(judged, 0.0, np.nan))
        seen = {
            "power": power,
            "limit": limit,
            "util": util,
            "bits": bits,
            "below": below,
            "power_med": power_med,
            "limit_med": limit_med,
            "brake": brake,
            "capped": capped,
            "impact": impact,
            "costs": costs,
            "z": z,
            "deficit": below,
        }
        return [(1, odd, None), (0, impact != 0, None)], seen

    def finding_of(
        self, seen: dict[str, Any], rounds: Rounds, nodes: Sequence[str], event: Event
    ) -> Finding:
        r, j, slot, since, clear = event
        evidence = _evidence(seen, r, j)
        b = float(seen["below"][r, j])
        score = round(
            max(b, 1.0 if seen["brake"][r, j] else 0.0, 0.5 if seen["capped"][r, j] else 0.0), 3
        )
        severity = "info"
        if slot == 0:
            evidence["impact"] = _IMPACTS[int(seen["impact"][r, j])] or "hw_power_brake"
            severity = "warning"
        elif slot == self.slots - 1:  # the CUSUM's claim
            evidence["impact"] = _IMPACTS[int(seen["costs"][r, j])] or "sm_clock_deficit"
            more, since = self.sequential_evidence(seen, r, j, since)
            evidence |= more
            score = round(evidence["excess_pct"] / 100.0, 3)
            severity = "warning"
        return finding(self, rounds, nodes, r, j, "power", severity, score, evidence, since, clear)


def _evidence(seen: dict[str, np.ndarray], r: int, j: int) -> dict[str, Any]:
    """What GPU ``j`` of round ``r`` drew and was allowed, against its siblings."""
    return {
        "metric": "power_w",
        "power_w": opt(seen["power"][r, j]),
        "peer_median_w": opt(seen["power_med"][r, 0]),
        "below_peers_pct": round(100.0 * float(seen["below"][r, j]), 1),
        "power_limit_w": opt(seen["limit"][r, j]),
        "peer_median_limit_w": opt(seen["limit_med"][r, 0]),
        "util_pct": opt(seen["util"][r, j]),
        "reasons": hex(int(seen["bits"][r, j])),
    }

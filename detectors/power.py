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

Parameters
----------
low_ratio
    Fraction below the median power that counts as low.
limit_ratio
    Fraction of the median enforced limit below which a limit counts as capped.
min_util, util_band
    Load conditions for the power comparison.
raise_after, within, clear_after
    Hysteresis, in sampling rounds.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.power import PowerDetector
>>> det = PowerDetector()
>>> found = []
>>> for t in range(4):
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=98, sm_clock_mhz=1980,
...                             power_w=690 - (250 if g == 2 else 0), power_limit_w=700,
...                             clock_event_reasons=0x4 if g == 2 else 0) for g in range(8)}
...     found += det.evaluate("n1", "job", samples, 10.0 * t)
>>> [(f.gpu, f.category, f.evidence["below_peers_pct"]) for f in found]
[(2, 'power', 36.2)]

"""

from __future__ import annotations

from typing import Any

from guard.schemas import GpuSample

from .findings import Finding
from .gpu_round import peer_median
from .hold import Hold

__all__ = ["BRAKE_BIT", "POWER_CAP_BIT", "PowerDetector"]

POWER_CAP_BIT = 0x4
BRAKE_BIT = 0x80


class PowerDetector:
    """Per-node power rule over sibling GPUs."""

    name = "power"

    def __init__(
        self,
        low_ratio: float = 0.25,
        limit_ratio: float = 0.9,
        min_util: float = 50.0,
        util_band: float = 15.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        self.low_ratio = low_ratio
        self.limit_ratio = limit_ratio
        self.min_util = min_util
        self.util_band = util_band
        self.hold_args = (raise_after, within, clear_after)
        self.holds: dict[int, Hold] = {}

    def evaluate(
        self, node: str, job: str | None, samples: dict[int, GpuSample], ts: float
    ) -> list[Finding]:
        power_med = peer_median(samples, "power_w")
        limit_med = peer_median(samples, "power_limit_w")
        util_med = peer_median(samples, "util_pct")
        clock_med = peer_median(samples, "sm_clock_mhz")
        found: list[Finding] = []
        for gpu, s in samples.items():
            bits = s.clock_event_reasons or 0
            brake = bool(bits & BRAKE_BIT)
            capped = (
                s.power_limit_w is not None
                and limit_med is not None
                and s.power_limit_w < self.limit_ratio * limit_med
            )
            below = 0.0
            if s.power_w is not None and power_med:
                below = 1.0 - s.power_w / power_med
            low = (
                below >= self.low_ratio
                and (
                    bool(bits & POWER_CAP_BIT)  # held back: capped, or clocked below siblings
                    or (
                        s.sm_clock_mhz is not None
                        and clock_med is not None
                        and s.sm_clock_mhz < 0.97 * clock_med
                    )
                )
                and s.util_pct is not None
                and util_med is not None
                and s.util_pct >= self.min_util
                and abs(s.util_pct - util_med) <= self.util_band
            )
            condition = brake or capped or low
            hold = self.holds.get(gpu)
            if hold is None:
                if not condition:
                    continue
                hold = self.holds[gpu] = Hold(*self.hold_args)
            event = hold.update(condition, s.ts)
            if event is None:
                continue
            evidence: dict[str, Any] = {
                "metric": "power_w",
                "power_w": s.power_w,
                "peer_median_w": power_med,
                "below_peers_pct": round(100.0 * below, 1),
                "power_limit_w": s.power_limit_w,
                "peer_median_limit_w": limit_med,
                "util_pct": s.util_pct,
                "reasons": hex(bits),
                "since_ts": hold.since,
            }
            found.append(
                Finding(
                    detector=self.name,
                    category="power",
                    severity="warning",
                    node=node,
                    ts=ts,
                    since=hold.since,
                    score=round(max(below, 1.0 if brake else 0.0, 0.5 if capped else 0.0), 3),
                    job=job,
                    gpu=gpu,
                    evidence=evidence,
                    clear=event == "clear",
                )
            )
        return found

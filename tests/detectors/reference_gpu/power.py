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
>>> from guard.detectors.gpu_round import GpuRound
>>> from guard.detectors.power import PowerDetector
>>> det = PowerDetector()
>>> found = []
>>> for t in range(4):
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, util_pct=98, sm_clock_mhz=1980,
...                             power_w=690 - (250 if g == 2 else 0), power_limit_w=700,
...                             clock_event_reasons=0x4 if g == 2 else 0) for g in range(8)}
...     found += det.update(GpuRound.of("n1", "job", samples))
>>> [(f.gpu, f.severity, f.evidence["below_peers_pct"], f.evidence.get("impact")) for f in found]
[(2, 'info', 36.2, None), (2, 'warning', 36.2, 'sw_power_cap')]

"""

from __future__ import annotations

from typing import Any

from guard.detectors.findings import Finding
from guard.schemas.nvml_codes import HW_POWER_BRAKE, SW_POWER_CAP

from .gpu_round import GpuRound, GpuRoundRule

__all__ = ["PowerDetector"]


class PowerDetector(GpuRoundRule):
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
        super().__init__(raise_after, within, clear_after)
        self.low_ratio = low_ratio
        self.limit_ratio = limit_ratio
        self.min_util = min_util
        self.util_band = util_band

    def update(self, message: GpuRound) -> list[Finding]:
        """Findings of one sampling round (raises and clears of the GPUs' holds)."""
        power_med = message.peer_median("power_w")
        limit_med = message.peer_median("power_limit_w")
        limit_cut = None if limit_med is None else self.limit_ratio * limit_med
        if not self.watch and not self.holds and self._calm(message, power_med, limit_cut):
            return []  # the common case: a healthy round, no GPU with history
        util_med = message.peer_median("util_pct")
        clock_med = message.peer_median("sm_clock_mhz")
        found: list[Finding] = []
        low_ratio, min_util, band = self.low_ratio, self.min_util, self.util_band
        watch, holds = self.watch, self.holds
        for gpu, s in message.samples.items():
            bits = s.clock_event_reasons or 0
            brake = bool(bits & HW_POWER_BRAKE)
            limit = s.power_limit_w
            capped = limit_cut is not None and limit is not None and limit < limit_cut
            below = 0.0
            if s.power_w is not None and power_med:
                below = 1.0 - s.power_w / power_med
            low = (
                below >= low_ratio
                and s.util_pct is not None
                and util_med is not None
                and s.util_pct >= min_util
                and abs(s.util_pct - util_med) <= band
            )
            odd = capped or low
            if not (brake or odd or gpu in watch or gpu in holds):
                continue  # the common case: a healthy GPU without state
            impact = None
            if brake:
                impact = "hw_power_brake"
            elif odd:
                if bits & SW_POWER_CAP:
                    impact = "sw_power_cap"  # held back by its limit
                elif (
                    s.sm_clock_mhz is not None
                    and clock_med is not None
                    and s.sm_clock_mhz < 0.97 * clock_med
                ):
                    impact = "sm_clock_deficit"
            watched = self.watched(gpu, odd, s.ts) if odd or gpu in watch else None
            held = (
                self.held(gpu, True, s.ts)
                if impact is not None
                else (self.held(gpu, False, s.ts) if gpu in holds else None)
            )
            if held is None and watched is None:
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
            }
            score = round(max(below, 1.0 if brake else 0.0, 0.5 if capped else 0.0), 3)
            if watched is not None:
                found.append(
                    self.finding(message, gpu, watched, "power", "info", score, dict(evidence))
                )
            if held is not None:
                evidence["impact"] = impact or "hw_power_brake"
                found.append(self.finding(message, gpu, held, "power", "warning", score, evidence))
        return found

    def _calm(self, rnd: GpuRound, power_med: float | None, limit_cut: float | None) -> bool:
        """No GPU of ``rnd`` is braked, capped or low: the lowest limit and the lowest draw
        decide, as the tests fall with them (a NaN leaves it to the per-GPU tests)."""
        if rnd.reason_bits() & HW_POWER_BRAKE:
            return False
        limits = rnd.peer_values("power_limit_w")
        if limit_cut is not None and limits and not min(limits) >= limit_cut:
            return False
        if not self.low_ratio > 0.0:
            return False
        if not power_med:
            return True  # every GPU's shortfall counts as 0
        powers = rnd.peer_values("power_w")
        return power_med > 0.0 and 1.0 - min(powers) / power_med < self.low_ratio

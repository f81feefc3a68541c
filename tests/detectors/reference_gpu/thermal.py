"""Thermal detector: a GPU hotter than its siblings or near its slowdown, that it costs speed.

Per sampling round of a node (:class:`~guard.detectors.gpu_round.GpuRound`), a GPU is *hot*
when its temperature exceeds the median of the node's GPUs by ``peer_delta_c`` (a node or
rack that runs warm moves the median and is not a GPU fault) or reaches ``limit_c``.

A hot GPU is a **claim** (``warning``; ``critical`` from ``critical_c``) only with impact
(:func:`~guard.detectors.gpu_round.impact_of`): a thermal or hw-slowdown reason bit held
(0x20 sw thermal, 0x40 hw thermal, 0x8 hw slowdown), an SM-clock or power deficit against
its loaded siblings, or a temperature within ``margin_c`` of its own slowdown threshold
(NVML ``temp_slowdown_c``; ``limit_c`` where unknown). A thermal reason bit held is a claim
on its own. Within an 8-GPU chassis, temperatures spread by 5-15 deg C with airflow
position, steadily: a hot GPU at full clocks, full power, far from its slowdown threshold
is an ``info`` observation (prognostic, visible in Grafana), never a sweep trigger. The
claim's evidence names the impact signal that carried it (``impact``).

Each condition must hold in ``raise_after`` of ``within`` rounds
(:class:`~guard.detectors.hold.Hold`).

Parameters
----------
peer_delta_c
    Degrees above the node's median temperature that count as hot.
limit_c
    Absolute temperature that counts as hot (and the slowdown threshold assumed where the
    GPU reports none).
critical_c
    Temperature from which a claim is critical.
margin_c
    Degrees below the slowdown threshold that count as near it.
raise_after, within, clear_after
    Hysteresis, in sampling rounds.

References
----------
NVIDIA NVML ``nvmlDeviceGetCurrentClocksEventReasons`` (clocks-event reason bits) and
``nvmlDeviceGetTemperatureThreshold`` (``NVML_TEMPERATURE_THRESHOLD_SLOWDOWN``).

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuRound
>>> from guard.detectors.thermal import ThermalDetector
>>> det = ThermalDetector()
>>> found = []
>>> for t in range(5):
...     temps = {g: 62.0 + g % 2 + (20.0 if g == 4 else 0.0) + (12.0 if g == 7 else 0.0)
...              for g in range(8)}
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, temp_c=temps[g],
...                             temp_slowdown_c=87.0, util_pct=98, sm_clock_mhz=1980,
...                             clock_event_reasons=0x40 if g == 4 else 0) for g in range(8)}
...     found += det.update(GpuRound.of("n1", None, samples))
>>> sorted((f.gpu, f.severity, f.evidence["above_peers_c"], f.evidence.get("impact"))
...        for f in found)
[(4, 'info', 19.0, None), (4, 'warning', 19.0, 'reason_bits'), (7, 'info', 12.0, None)]

GPU 7 runs 12 deg C above its siblings at full clocks: observed, not claimed.

"""

from __future__ import annotations

from typing import Any

from guard.detectors.findings import Finding
from guard.schemas.nvml_codes import HW_SLOWDOWN, THERMAL_REASONS

from .gpu_round import GpuRound, GpuRoundRule, RoundMedians, impact_of

__all__ = ["ThermalDetector"]

_REASONS = THERMAL_REASONS | HW_SLOWDOWN  # a power brake is the power rule's claim


class ThermalDetector(GpuRoundRule):
    """Per-node thermal rule over sibling GPUs and absolute limits."""

    name = "thermal"

    def __init__(
        self,
        peer_delta_c: float = 10.0,
        limit_c: float = 90.0,
        critical_c: float = 97.0,
        margin_c: float = 2.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        super().__init__(raise_after, within, clear_after)
        self.peer_delta_c = peer_delta_c
        self.limit_c = limit_c
        self.critical_c = critical_c
        self.margin_c = margin_c

    def update(self, message: GpuRound) -> list[Finding]:
        """Findings of one sampling round (raises and clears of the GPUs' holds)."""
        center = message.peer_median("temp_c")
        if not self.watch and not self.holds and self._calm(message, center):
            return []  # the common case: a healthy round, no GPU with history
        medians: RoundMedians | None = None
        found: list[Finding] = []
        delta, limit, watch, holds = self.peer_delta_c, self.limit_c, self.watch, self.holds
        for gpu, s in message.samples.items():
            temp = s.temp_c
            bits = (s.clock_event_reasons or 0) & THERMAL_REASONS
            above = temp - center if (temp is not None and center is not None) else 0.0
            hot = above >= delta or (temp is not None and temp >= limit)
            if not (hot or bits or gpu in watch or gpu in holds):
                continue  # the common case: a healthy GPU without state
            impact = None
            if hot or bits:
                if medians is None:
                    medians = RoundMedians.of(message)
                impact = impact_of(s, medians, self.limit_c, self.margin_c, reasons=_REASONS)
            claim = bool(bits) or (hot and impact is not None)
            watched = self.watched(gpu, hot, s.ts) if hot or gpu in watch else None
            held = self.held(gpu, claim, s.ts) if claim or gpu in holds else None
            if held is None and watched is None:
                continue
            evidence: dict[str, Any] = {
                "metric": "temp_c",
                "temp_c": temp,
                "peer_median_c": center,
                "above_peers_c": round(above, 1),
                "limit_c": self.limit_c,
                "temp_slowdown_c": s.temp_slowdown_c,
                "thermal_bits": hex(bits),
            }
            score = round(max(above / self.peer_delta_c, 1.0 if bits else 0.0), 3)
            if watched is not None:
                found.append(
                    self.finding(message, gpu, watched, "thermal", "info", score, dict(evidence))
                )
            if held is not None:
                evidence["impact"] = impact or "reason_bits"
                critical = temp is not None and temp >= self.critical_c
                severity = "critical" if critical else "warning"
                found.append(self.finding(message, gpu, held, "thermal", severity, score, evidence))
        return found

    def _calm(self, rnd: GpuRound, center: float | None) -> bool:
        """No GPU of ``rnd`` is hot or reports a thermal reason bit: the hottest one decides,
        as both tests rise with the temperature (a NaN leaves it to the per-GPU tests)."""
        if not self.peer_delta_c > 0.0 or rnd.reason_bits() & THERMAL_REASONS:
            return False
        temps = rnd.peer_values("temp_c")
        if not temps:
            return True
        hottest = max(temps)
        return hottest < self.limit_c and (center is None or hottest - center < self.peer_delta_c)

"""Thermal detector: a GPU hotter than its siblings, over an absolute limit, or throttling.

Per sampling round of a node (:class:`~guard.detectors.gpu_round.GpuRound`), a GPU is suspect when

* its temperature exceeds the median of the node's GPUs by ``peer_delta_c`` — a whole node
  or rack that runs warm (hot aisle, warm inlet) moves the median and is not a GPU fault;
* its temperature is at least ``limit_c``; or
* a thermal clocks-event reason bit (0x20 sw thermal, 0x40 hw thermal) is set.

The condition must hold in ``raise_after`` of ``within`` rounds
(:class:`~guard.detectors.hold.Hold`);
it is ``critical`` at ``critical_c`` or above.

Parameters
----------
peer_delta_c
    Degrees above the node's median temperature that count as hot.
limit_c
    Absolute temperature that counts as hot.
critical_c
    Temperature from which the finding is critical.
raise_after, within, clear_after
    Hysteresis, in sampling rounds.

References
----------
NVIDIA NVML ``nvmlDeviceGetCurrentClocksEventReasons``: clocks-event reason bits.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuRound
>>> from guard.detectors.thermal import ThermalDetector
>>> det = ThermalDetector()
>>> found = []
>>> for t in range(5):
...     temps = {g: 62.0 + g % 2 + (20.0 if g == 4 else 0.0) for g in range(8)}
...     samples = {g: GpuSample(ts=10.0 * t, node="n1", gpu=g, temp_c=temps[g],
...                             clock_event_reasons=0x40 if g == 4 else 0) for g in range(8)}
...     found += det.update(GpuRound.of("n1", None, samples))
>>> [(f.gpu, f.category, f.evidence["above_peers_c"]) for f in found]
[(4, 'thermal', 19.0)]

"""

from __future__ import annotations

from typing import Any

from guard.schemas.nvml_codes import THERMAL_REASONS

from .findings import Finding
from .gpu_round import GpuRound, GpuRoundRule

__all__ = ["ThermalDetector"]


class ThermalDetector(GpuRoundRule):
    """Per-node thermal rule over sibling GPUs and absolute limits."""

    name = "thermal"

    def __init__(
        self,
        peer_delta_c: float = 10.0,
        limit_c: float = 90.0,
        critical_c: float = 97.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        super().__init__(raise_after, within, clear_after)
        self.peer_delta_c = peer_delta_c
        self.limit_c = limit_c
        self.critical_c = critical_c

    def update(self, message: GpuRound) -> list[Finding]:
        """Findings of one sampling round (raises and clears of the GPUs' holds)."""
        center = message.peer_median("temp_c")
        found: list[Finding] = []
        for gpu, s in message.samples.items():
            temp = s.temp_c
            bits = (s.clock_event_reasons or 0) & THERMAL_REASONS
            above = temp - center if (temp is not None and center is not None) else 0.0
            hot = above >= self.peer_delta_c or (temp is not None and temp >= self.limit_c)
            held = self.held(gpu, hot or bool(bits), s.ts)
            if held is None:
                continue
            evidence: dict[str, Any] = {
                "metric": "temp_c",
                "temp_c": temp,
                "peer_median_c": center,
                "above_peers_c": round(above, 1),
                "limit_c": self.limit_c,
                "thermal_bits": hex(bits),
            }
            critical = temp is not None and temp >= self.critical_c
            score = round(max(above / self.peer_delta_c, 1.0 if bits else 0.0), 3)
            severity = "critical" if critical else "warning"
            found.append(self.finding(message, gpu, held, "thermal", severity, score, evidence))
        return found

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
>>> from guard.detectors.engine import NodeDetectors
>>> node = NodeDetectors("n1")
>>> found = []
>>> for t in range(6):
...     temps = {g: 62.0 + g % 2 + (20.0 if g == 4 else 0.0) + (12.0 if g == 7 else 0.0)
...              for g in range(8)}
...     for g in range(8):
...         found += node.update(GpuSample(ts=10.0 * t, node="n1", gpu=g, temp_c=temps[g],
...                                        temp_slowdown_c=87.0, util_pct=98, sm_clock_mhz=1980,
...                                        clock_event_reasons=0x40 if g == 4 else 0))
>>> sorted((f.gpu, f.severity, f.evidence["above_peers_c"], f.evidence.get("impact"))
...        for f in found if f.detector == "thermal")
[(4, 'info', 19.0, None), (4, 'warning', 19.0, 'reason_bits'), (7, 'info', 12.0, None)]

GPU 7 runs 12 deg C above its siblings at full clocks: observed, not claimed.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas.nvml_codes import HW_SLOWDOWN, THERMAL_REASONS

from .findings import Finding
from .gpu_round import IMPACTS, Event, GpuRoundRule, Holds, Rounds, finding, impact_codes, opt

__all__ = ["ThermalDetector"]

_REASONS = THERMAL_REASONS | HW_SLOWDOWN  # a power brake is the power rule's claim


class ThermalDetector(GpuRoundRule):
    """Per-node thermal rule over sibling GPUs and absolute limits (slots: claim, info)."""

    name = "thermal"
    slots = 2

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

    def conditions(self, rounds: Rounds) -> tuple[Holds, dict[str, Any]]:
        """The observation's hold (hot against the siblings or the limit), then the claim's
        (thermal reason bits, or hot with an impact on speed)."""
        temp = rounds.matrix("temp")
        center = rounds.median("temp")[:, None]
        bits = rounds.matrix("reasons") & THERMAL_REASONS
        above = np.where(np.isnan(temp) | np.isnan(center), 0.0, temp - center)
        hot = (above >= self.peer_delta_c) | (temp >= self.limit_c)
        impact = np.zeros(temp.shape, dtype=np.int64)
        if hot.any():
            impact = impact_codes(rounds, self.limit_c, self.margin_c, reasons=_REASONS)
        claim = (bits != 0) | (hot & (impact != 0))
        seen = {"temp": temp, "center": center, "bits": bits, "above": above, "impact": impact}
        return [(1, hot, None), (0, claim, None)], seen

    def finding_of(
        self, seen: dict[str, Any], rounds: Rounds, nodes: Sequence[str], event: Event
    ) -> Finding:
        r, j, slot, since, clear = event
        above, bits = float(seen["above"][r, j]), int(seen["bits"][r, j])
        t = opt(seen["temp"][r, j])
        evidence: dict[str, Any] = {
            "metric": "temp_c",
            "temp_c": t,
            "peer_median_c": opt(seen["center"][r, 0]),
            "above_peers_c": round(above, 1),
            "limit_c": self.limit_c,
            "temp_slowdown_c": opt(rounds.cols.slowdown[rounds.at[r, j]]),
            "thermal_bits": hex(bits),
        }
        score = round(max(above / self.peer_delta_c, 1.0 if bits else 0.0), 3)
        severity = "info"
        if slot == 0:
            evidence["impact"] = IMPACTS[int(seen["impact"][r, j])] or "reason_bits"
            severity = "critical" if t is not None and t >= self.critical_c else "warning"
        return finding(
            self, rounds, nodes, r, j, "thermal", severity, score, evidence, since, clear
        )

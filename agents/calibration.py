"""Fault mix of the simulator, calibrated from the InfiniteHBD production fault trace.

The trace (stepfun-ai/InfiniteHBD-Trace, Apache-2.0; a copy of its statistics is in
``tests/data/infinitehbd/``) lists 584 faults on 400 GPU servers of an LLM-pretraining
cluster over 348 days, each with a ``Class`` and a ``Desc``. We keep the faults that have a
telemetry or performance signature Guard can see while a job runs and map each
``(Class, Desc)`` to one simulator fault kind (:data:`TRACE_TO_KIND`); the rest (unknown
errors, software, motherboard, CPU, RAID, ...) are left out. The relative counts become the
sampling weights of the fault mix (:data:`FAULT_MIX`).

How the mapping reads the trace:

- GPU DBE > threshold → ``ecc_dbe``; Xid, "device unknown error", nvidia-smi timeout, GPU
  lost / not found → ``xid``;
- GPU temperature high and fan failures (a failed fan makes its GPUs throttle) →
  ``thermal_throttle``;
- power-supply failure → ``power_brake`` (the board brakes when a PSU drops out); power
  redundancy lost → ``power_cap``;
- PCIe link width low, P2P bandwidth low, silent data corruption and stress-test failures
  (nodes that fail a performance sweep: grey, silently slow) → ``slow_gpu``;
- parameter-plane cable "Link Down" → ``link_flap``;
- NIC lost, RNIC GID errors, NIC PCIe width low, Y-cables and optical modules →
  ``degraded_nic``; NIC link speed low → ``nic_reduced_speed``.

The trace's *rate* (584 faults / 400 nodes / 348 days, about 1.7e-4 per node-hour) would
give no fault at all in an hour of 64 nodes, so the simulator keeps the mix but accelerates
the rate (``SimConfig.faults_per_node_hour``). Rare kinds get a floor weight
(:data:`MIN_WEIGHT`) so that every signature shows up across a handful of seeds.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "FAULT_KINDS",
    "FAULT_MIX",
    "MIN_WEIGHT",
    "TRACE_TO_KIND",
    "fault_weights",
]

FAULT_KINDS = (
    "thermal_throttle",
    "power_cap",
    "power_brake",
    "slow_gpu",
    "degraded_nic",
    "nic_reduced_speed",
    "link_flap",
    "xid",
    "ecc_dbe",
)

TRACE_TO_KIND: dict[tuple[str, str], str] = {
    ("GPU", "GPU DBE(Double Bit ECC) > Threshold"): "ecc_dbe",
    ("GPU", "GPU xid Error"): "xid",
    ("GPU", "GPU device unknow error"): "xid",
    ("GPU", "nvidia-smi Timeout"): "xid",
    ("GPU", "GPU Lost"): "xid",
    ("GPU", "GPU device not found"): "xid",
    ("GPU", "GPU Temperature High"): "thermal_throttle",
    ("Fan", "Speed Critical (Sensor)"): "thermal_throttle",
    ("Fan", "Redundancy Lost"): "thermal_throttle",
    ("Power Supply", "Power Supply Failure detected"): "power_brake",
    ("Power Supply", "Redundancy Lost"): "power_cap",
    ("GPU", "GPU PCI link width low"): "slow_gpu",
    ("GPU", "GPU P2P Bandwidth Low"): "slow_gpu",
    ("GPU", "Silent Data Corruption"): "slow_gpu",
    ("Stress Test Failure", "Unknown Error"): "slow_gpu",
    ("Parameter Plane Cable", "Link Down"): "link_flap",
    ("NIC", "NIC Lost"): "degraded_nic",
    ("NIC", "Rnic Gid Error"): "degraded_nic",
    ("NIC", "NIC PCI link Width low"): "degraded_nic",
    ("Change", "Y-cables Taken offline"): "degraded_nic",
    ("Change", "Remote Optical Module Failure"): "degraded_nic",
    ("NIC", "NIC Link Speed low"): "nic_reduced_speed",
}

#: Floor weight of every kind, so that rare kinds (power cap: 1 in the trace) still occur.
MIN_WEIGHT = 0.03

# Mapped counts from the trace's fault_statistics.json (tests/agents derives them again).
_TRACE_COUNTS: dict[str, int] = {
    "ecc_dbe": 60,
    "xid": 66,
    "thermal_throttle": 35,
    "power_brake": 25,
    "power_cap": 1,
    "slow_gpu": 126,
    "link_flap": 40,
    "degraded_nic": 24,
    "nic_reduced_speed": 10,
}


def fault_weights(counts: Mapping[str, int]) -> dict[str, float]:
    """Sampling weights from mapped trace counts: relative counts, floored at MIN_WEIGHT."""
    total = sum(counts.values()) or 1
    raw = {kind: max(MIN_WEIGHT, counts.get(kind, 0) / total) for kind in FAULT_KINDS}
    norm = sum(raw.values())
    return {kind: round(value / norm, 4) for kind, value in raw.items()}


#: Sampling weights of the simulator's fault kinds (sum 1).
FAULT_MIX: dict[str, float] = fault_weights(_TRACE_COUNTS)

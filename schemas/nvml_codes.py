"""NVML's numeric vocabulary that Guard's messages carry: clock-event reason bits and Xids.

One place for these numbers: collectors, the simulator, detectors and sweeps import them.

>>> hex(THERMAL_REASONS), hex(TROUBLE_REASONS)
('0x60', '0xe8')
>>> bool(0x48 & HW_SLOWDOWN), bool(IDLE & TROUBLE_REASONS)
(True, False)
"""

from __future__ import annotations

__all__ = [
    "HW_POWER_BRAKE",
    "HW_SLOWDOWN",
    "HW_THERMAL",
    "IDLE",
    "NONFATAL_XIDS",
    "SW_POWER_CAP",
    "SW_THERMAL",
    "THERMAL_REASONS",
    "TROUBLE_REASONS",
    "XID_GPU_LOST",
]

# nvmlClocksEventReasons (nvml.h): bits of GpuSample.clock_event_reasons.
IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
#: Thermal slowdown, software or hardware.
THERMAL_REASONS = SW_THERMAL | HW_THERMAL
#: Reasons that mean trouble (DCGM, aznhc); idle and the software power cap are normal.
TROUBLE_REASONS = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE

#: Xid 79: "GPU has fallen off the bus" — what a lost GPU reports.
XID_GPU_LOST = 79
#: Xids that report an application or recoverable error, not a dead GPU.
NONFATAL_XIDS = (13, 31, 43, 45, 63, 74, 94)

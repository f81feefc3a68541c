"""NVML's numeric vocabulary that Guard's messages carry: clock-event reason bits and Xids.

One place for these numbers: collectors, the simulator, detectors and sweeps import them.

>>> hex(THERMAL_REASONS), hex(TROUBLE_REASONS)
('0x60', '0xe8')
>>> bool(0x48 & HW_SLOWDOWN), bool(IDLE & TROUBLE_REASONS)
(True, False)
>>> set(APPLICATION_XIDS) & set(NONFATAL_XIDS), XID_GPU_LOST in APPLICATION_XIDS
(set(), False)
"""

from __future__ import annotations

__all__ = [
    "APPLICATION_XIDS",
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
#: Xids that application code causes (NVIDIA's Xid catalogue lists a user application error
#: as a cause and restarting the application as the immediate action): 13 graphics engine
#: exception (e.g. an out-of-range access in a kernel), 31 GPU memory page fault, 43 GPU
#: stopped processing (the channel of a faulting application was reset), 45 preemptive
#: cleanup (the driver cleaning up after an application was killed). They say nothing about
#: the node: ``info`` observations by default, never a claim.
APPLICATION_XIDS = (13, 31, 43, 45)
#: Xids of recoverable hardware errors, the GPU still on the bus: 63 and 64 ECC page
#: retirement / row remapping (recorded, or failed to record), 74 NVLink error, 92 high
#: single-bit ECC error rate, 94 contained ECC error.
NONFATAL_XIDS = (63, 64, 74, 92, 94)

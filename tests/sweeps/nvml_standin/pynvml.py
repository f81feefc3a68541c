"""Stand-in for ``pynvml`` at the hardware boundary, for ``guard sweep run`` in a subprocess
(put this folder first on PYTHONPATH). ``GUARD_TEST_NVML`` picks what the driver does:

- ``mismatch``: ``nvmlInit`` fails as it does after a driver upgrade without a reboot
  (NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch.");
- ``gpus:N``: NVML starts and answers for N H100 GPUs (0: a node whose GPUs fell off the bus).
"""

from __future__ import annotations

import os

NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18


class NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


def _mode() -> str:
    return os.environ.get("GUARD_TEST_NVML", "gpus:0")


def nvmlInit() -> None:
    if _mode() == "mismatch":
        raise NVMLError(
            NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."
        )


def nvmlDeviceGetCount() -> int:
    return int(_mode().split(":")[1])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetName(handle: int) -> bytes:
    return b"NVIDIA H100 80GB HBM3"

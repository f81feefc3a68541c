"""What an attacker with write access to Kafka plants on a changelog topic."""

from __future__ import annotations

import os
from pathlib import Path


class RunsCommand:
    """Pickles into a call of ``os.system`` that creates ``marker`` when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)

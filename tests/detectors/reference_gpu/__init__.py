"""The per-round GPU rules (thermal, power, clocks, GPU errors) and the per-node round assembly
that the columnar ones replaced (issue 25), kept as the reference of a differential test: the
same samples must give the same findings. Not used by Guard."""

from __future__ import annotations

from guard.detectors.findings import Finding
from guard.schemas import GpuSample

from .clocks import ClockDetector
from .gpu_errors import GpuErrorDetector
from .gpu_round import GpuRound
from .power import PowerDetector
from .thermal import ThermalDetector

__all__ = ["ReferenceGpuNode"]


class ReferenceGpuNode:
    """A node's GPU rules as the per-sample engine ran them: a round closes when a GPU
    reports again (or at flush), then thermal, power and clocks judge it."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.job: str | None = None
        self.open_round: dict[int, GpuSample] = {}
        self.thermal = ThermalDetector()
        self.power = PowerDetector()
        self.clocks = ClockDetector()
        self.errors = GpuErrorDetector(node)

    def update(self, s: GpuSample) -> list[Finding]:
        if s.job is not None:
            self.job = self.errors.job = s.job
        found = self.errors.update(s)
        if s.gpu in self.open_round:
            closed, self.open_round = self.open_round, {s.gpu: s}
            found += self._round(closed)
        else:
            self.open_round[s.gpu] = s
        return found

    def tick(self, now: float) -> list[Finding]:
        return self.errors.tick(now)

    def flush(self) -> list[Finding]:
        closed, self.open_round = self.open_round, {}
        return self._round(closed) if closed else []

    def _round(self, samples: dict[int, GpuSample]) -> list[Finding]:
        rnd = GpuRound.of(self.node, self.job, samples)
        return self.thermal.update(rnd) + self.power.update(rnd) + self.clocks.update(rnd)

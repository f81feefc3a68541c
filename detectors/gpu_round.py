"""Sampling rounds of one node's GPUs: the peer group for node telemetry rules.

A node agent samples all its GPUs every interval. :class:`GpuRound` collects the latest
sample of each GPU and closes the round when a GPU reports again (or on flush), so each
rule sees one consistent snapshot of the node, can compare a GPU with its siblings, and
runs once per round instead of once per message. Missing GPUs, gaps and slightly
out-of-order samples only make a round smaller.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuRound, peer_median
>>> r = GpuRound()
>>> r.add(GpuSample(ts=1.0, node="n", gpu=0, temp_c=60)) is None
True
>>> r.add(GpuSample(ts=1.1, node="n", gpu=1, temp_c=70)) is None
True
>>> closed = r.add(GpuSample(ts=2.0, node="n", gpu=0, temp_c=61))
>>> sorted(closed), peer_median(closed, "temp_c", min_peers=2)
([0, 1], 65.0)

"""

from __future__ import annotations

from guard.schemas import GpuSample

from .robust import median

__all__ = ["GpuRound", "peer_median"]


class GpuRound:
    """The open round of one node: the latest sample of each GPU."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: dict[int, GpuSample] = {}

    def add(self, sample: GpuSample) -> dict[int, GpuSample] | None:
        """Add a sample; return the closed round when this GPU already had one."""
        samples = self.samples
        if sample.gpu in samples:
            closed = samples
            self.samples = {sample.gpu: sample}
            return closed
        samples[sample.gpu] = sample
        return None

    def flush(self) -> dict[int, GpuSample] | None:
        closed, self.samples = self.samples, {}
        return closed or None


def peer_median(samples: dict[int, GpuSample], attr: str, min_peers: int = 3) -> float | None:
    """Median of ``attr`` over the round's GPUs that report it; ``None`` below ``min_peers``."""
    values = [v for s in samples.values() if (v := getattr(s, attr)) is not None]
    if len(values) < min_peers:
        return None
    return median(values)

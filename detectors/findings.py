"""A detector's raw finding, before fusion turns it into a wire :class:`Flag`.

Detectors are pure: they return :class:`Finding` objects (cheap slotted records), never
print or publish. :class:`~guard.detectors.fusion.NodeFusion` keeps one current suspicion
per node and decides which findings become flags.

Example
-------
>>> from guard.detectors.findings import Finding
>>> f = Finding(detector="thermal", category="thermal", severity="warning", node="n1",
...             ts=100.0, since=90.0, score=0.8, gpu=3, evidence={"metric": "temp_c"})
>>> f.component
'gpu3'
>>> f.rank_of_severity()
1

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SEVERITY_RANK", "Finding"]

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass(slots=True)
class Finding:
    """One detector's claim (or observation) about a node, a GPU, a NIC or a job.

    Parameters
    ----------
    detector
        Name of the detector that made it.
    category
        A wire-contract flag category (``straggler``, ``thermal``, ...).
    severity
        ``info``, ``warning`` or ``critical``.
    node
        The node at fault; ``None`` for a job-level observation.
    ts
        Event time at which the finding was made.
    since
        Event time at which its evidence began (part of the stable flag id).
    score
        Detector-specific strength (higher is stronger).
    clear
        ``True`` when the detector withdraws an earlier finding on the same component.

    """

    detector: str
    category: str
    severity: str
    node: str | None
    ts: float
    since: float
    score: float
    job: str | None = None
    gpu: int | None = None
    device: str | None = None
    rank: int | None = None
    window_s: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    clear: bool = False

    @property
    def component(self) -> str:
        """The part of the node it is about: ``gpuN``, a NIC device, ``rankN`` or ``node``."""
        if self.gpu is not None:
            return f"gpu{self.gpu}"
        if self.device is not None:
            return self.device
        if self.rank is not None:
            return f"rank{self.rank}"
        return "node"

    def rank_of_severity(self) -> int:
        return SEVERITY_RANK[self.severity]

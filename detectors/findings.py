"""A detector's raw finding, before fusion turns it into a wire :class:`Flag`, and the
one interface every detector has.

Detectors are pure: they return :class:`Finding` objects (cheap slotted records), never
print or publish. :class:`~guard.detectors.fusion.NodeFusion` keeps one current suspicion
per node and decides which findings become flags.

Every detector speaks the same three verbs (:class:`Detector`): ``update(message)`` feeds
one message in event-time order, ``tick(now)`` runs the time-driven checks at event time
``now`` (a hang, a lost GPU), ``flush()`` evaluates what is still pending at the end of the
input; each returns the findings it made (``[]`` when there are none).

Example
-------
>>> from guard.detectors.findings import Finding
>>> f = Finding(detector="thermal", category="thermal", severity="warning", node="n1",
...             ts=100.0, since=90.0, score=0.8, gpu=3, evidence={"metric": "temp_c"})
>>> f.component
'gpu3'

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = ["UNPLACED", "Detector", "Finding", "imbalance_info"]

#: the evidence key of a finding on a rank whose GPU is not known because none of its steps
#: was read yet (fusion takes it for any GPU of its node)
UNPLACED = "unplaced"

_Message_contra = TypeVar("_Message_contra", contravariant=True)


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


class Detector(Protocol[_Message_contra]):
    """What the engine asks of a detector: messages in, findings out, a clock, an end."""

    name: str

    def update(self, message: _Message_contra) -> list[Finding]:
        """Learn from one message; return the findings it made."""
        ...

    def tick(self, now: float) -> list[Finding]:
        """Time-driven checks at event time ``now``."""
        ...

    def flush(self) -> list[Finding]:
        """End of input: evaluate what is still pending."""
        ...


def imbalance_info(
    detector: str, job: str, ts: float, score: float, evidence: dict[str, Any], clear: bool
) -> Finding:
    """A job-level ``imbalance`` observation: ranks doing different work, not a node fault."""
    return Finding(
        detector=detector,
        category="imbalance",
        severity="info",
        node=None,
        ts=ts,
        since=ts,
        score=score,
        job=job,
        evidence=evidence,
        clear=clear,
    )

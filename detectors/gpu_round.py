"""Sampling rounds of one node's GPUs: the peer group, and the message, of node telemetry rules.

A node agent samples all its GPUs every interval. The node's detectors
(:class:`~guard.detectors.engine.NodeDetectors`) collect the latest sample of each GPU and
close the round when a GPU reports again (or on flush), so each rule sees one consistent
snapshot of the node as one :class:`GpuRound`, can compare a GPU with its siblings
(:meth:`GpuRound.peer_median`), and runs once per round instead of once per message.
Missing GPUs, gaps and slightly out-of-order samples only make a round smaller.

The rules over a round (thermal, power, clocks) share :class:`GpuRoundRule`: one
:class:`~guard.detectors.hold.Hold` per GPU, made on the GPU's first hit, and nothing
pending between rounds.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.gpu_round import GpuRound
>>> rnd = GpuRound.of("n", "job", {g: GpuSample(ts=1.0 + 0.1 * g, node="n", gpu=g,
...                                             temp_c=60.0 + 10 * g) for g in range(2)})
>>> rnd.ts, sorted(rnd.samples), rnd.peer_median("temp_c", min_peers=2)
(1.1, [0, 1], 65.0)
>>> rnd.peer_median("temp_c") is None  # fewer than three GPUs report it
True

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guard.schemas import GpuSample

from .findings import Finding
from .hold import Hold
from .robust import median

__all__ = ["GpuRound", "GpuRoundRule"]


@dataclass(frozen=True, slots=True)
class GpuRound:
    """One node's closed sampling round: the latest sample of each GPU, by GPU index."""

    node: str
    job: str | None
    ts: float
    samples: dict[int, GpuSample]

    @classmethod
    def of(cls, node: str, job: str | None, samples: dict[int, GpuSample]) -> GpuRound:
        """The round of ``samples``, at the event time of its latest sample."""
        return cls(node, job, max(s.ts for s in samples.values()), samples)

    def peer_median(self, attr: str, min_peers: int = 3) -> float | None:
        """Median of ``attr`` over the GPUs that report it; ``None`` below ``min_peers``."""
        values = [v for s in self.samples.values() if (v := getattr(s, attr)) is not None]
        if len(values) < min_peers:
            return None
        return median(values)


class GpuRoundRule:
    """Base of the per-round rules: a hold per GPU; ``update`` is the rule's own."""

    name = "gpu_round_rule"

    def __init__(self, raise_after: int, within: int, clear_after: int) -> None:
        self.hold_args = (raise_after, within, clear_after)
        self.holds: dict[int, Hold] = {}

    def update(self, message: GpuRound) -> list[Finding]:
        raise NotImplementedError

    def tick(self, now: float) -> list[Finding]:
        return []  # nothing is pending between rounds

    def flush(self) -> list[Finding]:
        return []

    def held(self, gpu: int, condition: bool, ts: float) -> tuple[Hold, str] | None:
        """The GPU's hold and its event when this round raises or clears it, else ``None``."""
        hold = self.holds.get(gpu)
        if hold is None:
            if not condition:
                return None  # the common case: a healthy GPU needs no state
            hold = self.holds[gpu] = Hold(*self.hold_args)
        event = hold.update(condition, ts)
        return None if event is None else (hold, event)

    def finding(
        self,
        rnd: GpuRound,
        gpu: int,
        held: tuple[Hold, str],
        category: str,
        severity: str,
        score: float,
        evidence: dict[str, Any],
    ) -> Finding:
        """The finding of ``gpu`` in ``rnd``; the evidence ends with the hold's start."""
        hold, event = held
        evidence["since_ts"] = hold.since
        return Finding(
            self.name,
            category,
            severity,
            rnd.node,
            rnd.ts,
            hold.since,
            score,
            job=rnd.job,
            gpu=gpu,
            evidence=evidence,
            clear=event == "clear",
        )

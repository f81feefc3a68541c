"""Sampling rounds of one node's GPUs: the peer group, and the message, of node telemetry rules.

A node agent samples all its GPUs every interval. The node's detectors
(:class:`~guard.detectors.engine.NodeDetectors`) collect the latest sample of each GPU and
close the round when a GPU reports again (or on flush), so each rule sees one consistent
snapshot of the node as one :class:`GpuRound`, can compare a GPU with its siblings
(:meth:`GpuRound.peer_median`), and runs once per round instead of once per message.
Missing GPUs, gaps and slightly out-of-order samples only make a round smaller.

The rules over a round (thermal, power, clocks) share :class:`GpuRoundRule`: one
:class:`~guard.detectors.hold.Hold` per GPU, made on the GPU's first hit, and nothing
pending between rounds; and a second set of holds (:meth:`GpuRoundRule.watched`) for
anomalies without impact, which are ``info`` observations, never claims.

**Claims need impact.** A GPU that is hot or draws odd power is a fault only when it is or
will soon be slower: :func:`impact_of` names the signal that shows it — a throttle or brake
reason bit held (``reason_bits``), an SM-clock deficit against its loaded siblings
(``sm_clock_deficit``), a power deficit against them (``power_deficit``), or a temperature
within ``margin_c`` of the GPU's own slowdown threshold (``near_slowdown_temp``; NVML's
``temp_slowdown_c``, or the rule's absolute limit where the GPU does not report one). A GPU
that runs 10 deg C above its siblings at full clocks (its airflow position) has none.

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

from dataclasses import dataclass, field
from functools import reduce
from operator import attrgetter, or_
from typing import Any

from guard.detectors.findings import Finding
from guard.detectors.hold import Hold
from guard.detectors.robust import median
from guard.schemas import GpuSample
from guard.schemas.nvml_codes import SW_POWER_CAP, TROUBLE_REASONS

__all__ = ["GpuRound", "GpuRoundRule", "RoundMedians", "impact_of"]

_UNKNOWN = object()
_TS = attrgetter("ts")
#: attribute readers of :meth:`GpuRound.peer_values`, by name (one C-level call per GPU)
_READERS: dict[str, attrgetter[Any]] = {}


@dataclass(frozen=True, slots=True)
class GpuRound:
    """One node's closed sampling round: the latest sample of each GPU, by GPU index."""

    node: str
    job: str | None
    ts: float
    samples: dict[int, GpuSample]
    #: peer medians already computed, by (attribute, min_peers): the rules of one round
    #: ask for the same ones (power, clocks and impact tests all want the SM clock's)
    medians: dict[tuple[str, int], float | None] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: :meth:`peer_values` already read, by attribute
    readings: dict[str, list[Any]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, node: str, job: str | None, samples: dict[int, GpuSample]) -> GpuRound:
        """The round of ``samples``, at the event time of its latest sample."""
        return cls(node, job, max(map(_TS, samples.values())), samples)

    def peer_values(self, attr: str) -> list[Any]:
        """``attr`` of the GPUs that report it (not ``None``), in GPU order; read once.

        The rules screen a whole round with their ``min`` or ``max`` (one C-level call
        instead of a test per GPU): healthy rounds, the common case, then cost no loop.
        """
        values = self.readings.get(attr)
        if values is None:
            read = _READERS.get(attr)
            if read is None:
                read = _READERS[attr] = attrgetter(attr)
            values = [v for v in map(read, self.samples.values()) if v is not None]
            self.readings[attr] = values
        return values

    def reason_bits(self) -> int:
        """The clock-event reason bits any GPU of the round reports (OR of all)."""
        return reduce(or_, self.peer_values("clock_event_reasons"), 0)

    def peer_median(self, attr: str, min_peers: int = 3) -> float | None:
        """Median of ``attr`` over the GPUs that report it; ``None`` below ``min_peers``."""
        key = (attr, min_peers)
        known = self.medians.get(key, _UNKNOWN)
        if known is not _UNKNOWN:
            return known  # type: ignore[return-value]
        values = self.peer_values(attr)
        found = median(values) if len(values) >= min_peers else None
        self.medians[key] = found
        return found


@dataclass(frozen=True, slots=True)
class RoundMedians:
    """The siblings' medians an impact test compares a GPU with (``None``: too few report)."""

    sm_clock_mhz: float | None
    power_w: float | None
    util_pct: float | None

    @classmethod
    def of(cls, rnd: GpuRound) -> RoundMedians:
        return cls(
            rnd.peer_median("sm_clock_mhz"), rnd.peer_median("power_w"), rnd.peer_median("util_pct")
        )


def impact_of(
    s: GpuSample,
    med: RoundMedians,
    slowdown_c: float,
    margin_c: float = 2.0,
    clock_deficit: float = 0.05,
    power_deficit: float = 0.2,
    min_util: float = 50.0,
    reasons: int = TROUBLE_REASONS,
) -> str | None:
    """The first signal that ``s``'s GPU is or will soon be slower, or ``None``.

    ``slowdown_c`` is the threshold used when the sample does not carry NVML's own
    (``temp_slowdown_c``). Deficits count only under load, against loaded siblings; the power
    deficit only from ``power_deficit`` (20 %): healthy GPUs at the same clocks and load differ
    by several per cent in draw (silicon, cooling), which costs no speed.
    """
    bits = s.clock_event_reasons or 0
    if bits & reasons:
        return "reason_bits"
    loaded = s.util_pct is not None and s.util_pct >= min_util
    # a GPU at its power limit (0x4 alone) is held back by its limit, which every loaded
    # GPU touches now and then: a deficit then is the power rule's business, not this one's
    capped = bool(bits & SW_POWER_CAP) and not (bits & reasons)
    if loaded and not capped and med.util_pct is not None and med.util_pct >= min_util:
        if (
            s.sm_clock_mhz is not None
            and med.sm_clock_mhz
            and s.sm_clock_mhz < (1.0 - clock_deficit) * med.sm_clock_mhz
        ):
            return "sm_clock_deficit"
        if (
            s.power_w is not None
            and med.power_w
            and s.power_w < (1.0 - power_deficit) * med.power_w
        ):
            return "power_deficit"
    threshold = s.temp_slowdown_c if s.temp_slowdown_c is not None else slowdown_c
    if s.temp_c is not None and s.temp_c >= threshold - margin_c:
        return "near_slowdown_temp"
    return None


class GpuRoundRule:
    """Base of the per-round rules: a hold per GPU; ``update`` is the rule's own."""

    name = "gpu_round_rule"

    def __init__(self, raise_after: int, within: int, clear_after: int) -> None:
        self.hold_args = (raise_after, within, clear_after)
        self.holds: dict[int, Hold] = {}
        self.watch: dict[int, Hold] = {}  # anomalies without impact: info observations

    def update(self, message: GpuRound) -> list[Finding]:
        raise NotImplementedError

    def tick(self, now: float) -> list[Finding]:
        return []  # nothing is pending between rounds

    def flush(self) -> list[Finding]:
        return []

    def held(
        self, gpu: int, condition: bool, ts: float, holds: dict[int, Hold] | None = None
    ) -> tuple[Hold, str] | None:
        """The GPU's hold and its event when this round raises or clears it, else ``None``."""
        holds = self.holds if holds is None else holds
        hold = holds.get(gpu)
        if hold is None:
            if not condition:
                return None  # the common case: a healthy GPU needs no state
            hold = holds[gpu] = Hold(*self.hold_args)
        event = hold.update(condition, ts)
        return None if event is None else (hold, event)

    def watched(self, gpu: int, condition: bool, ts: float) -> tuple[Hold, str] | None:
        """:meth:`held` for the GPU's anomaly-without-impact hold (an ``info`` finding)."""
        return self.held(gpu, condition, ts, self.watch)

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

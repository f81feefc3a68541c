"""Which flags start a sweep, and how many nodes may be out of the pool at once.

A flag is a *claim* about a node when it names a node, its severity is at least
``min_severity`` (``info`` flags are observations and never count) and its category is
one that a sweep can confirm. A claim makes a healthy node *suspect*. A suspect node is
worth a sweep (it *qualifies*) when the evidence persists:

- one ``critical`` claim, or
- ``persist_flags`` distinct claims, or
- claims whose evidence spans at least ``persistence_s`` (from the earliest window start
  to the latest flag).

A suspect node that gets no new claim for ``suspect_ttl_s`` is healthy again. A node
flagged again within ``cooldown_s`` of passing a sweep is not swept again: it goes to repair.

The jobs on a node taken out are handled by ``isolate`` (``off | notify | requeue``): left
alone, named in the node's state, or restarted elsewhere by the scheduler (Slurm requeue;
Kubernetes: their pods deleted so their controller recreates them) — C4D's isolate-and-restart.

Every node Guard holds out of the pool counts against the cap (``cordon_limit``), nodes in
repair included (``cap_counts_repair``). And while more than ``sweep_stop_failed_fraction`` of
the sweeps of the last ``sweep_stop_window_s`` failed (``SweepFailureStop``), Guard cordons
and sweeps nothing more: a broken check fails healthy nodes, and it must not drain the fleet.

Example
-------
>>> from guard.config import OrchestratorSettings
>>> policy = SweepPolicy.from_settings(OrchestratorSettings())
>>> policy.cordon_limit(32), policy.cordon_limit(200), policy.cordon_limit(10)
(1, 10, 1)
>>> stop = SweepFailureStop(fraction=0.5, window_s=3600, min_sweeps=4)
>>> for ts, passed in [(0, True), (10, False), (20, False)]:
...     stop.record(ts, passed)
>>> stop.reason(30) is None  # three sweeps: too few to judge
True
>>> stop.record(40, False)
>>> stop.reason(50)
'3 of the last 4 sweeps within 3600 s failed (over 50 %)'
>>> stop.reason(3615) is None  # the first failure left the window: 2 of 3
True
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from guard.config import OrchestratorSettings
from guard.schemas import SEVERITY_RANK, Flag

from .states import NodeRecord

__all__ = ["SweepFailureStop", "SweepPolicy"]


@dataclass(frozen=True, slots=True)
class SweepPolicy:
    min_severity: str = "warning"
    categories: frozenset[str] = frozenset()
    persist_flags: int = 1
    persistence_s: float = 120.0
    suspect_ttl_s: float = 600.0
    cooldown_s: float = 3600.0
    max_flag_age_s: float = 1800.0
    max_cordoned_fraction: float = 0.05
    cap_counts_repair: bool = True
    isolate: str = "notify"

    @classmethod
    def from_settings(cls, s: OrchestratorSettings) -> SweepPolicy:
        return cls(
            min_severity=s.min_severity,
            categories=frozenset(s.sweep_categories),
            persist_flags=s.persist_flags,
            persistence_s=s.persistence_s,
            suspect_ttl_s=s.suspect_ttl_s,
            cooldown_s=s.cooldown_s,
            max_flag_age_s=s.max_flag_age_s,
            max_cordoned_fraction=s.max_cordoned_fraction,
            cap_counts_repair=s.cap_counts_repair,
            isolate=s.isolate_policy,
        )

    def is_claim(self, flag: Flag) -> bool:
        """Whether the flag can make its node suspect."""
        return (
            flag.node is not None
            and SEVERITY_RANK[flag.severity] >= max(1, SEVERITY_RANK[self.min_severity])
            and flag.category in self.categories
        )

    def qualifies(self, rec: NodeRecord) -> bool:
        """Whether a suspect node's evidence has persisted enough to cordon and sweep it."""
        if rec.severity_rank >= SEVERITY_RANK["critical"] or rec.to_repair:
            return True
        if len(rec.claims) >= self.persist_flags:
            return True
        if not rec.claims:
            return False
        start = min(f.ts - (f.window_s or 0.0) for f in rec.claims.values())
        end = max(f.ts for f in rec.claims.values())
        return bool(end - start >= self.persistence_s)

    def cordon_limit(self, cluster_size: int) -> int:
        """Nodes that may be out of the pool on suspicion at once (never below one)."""
        return max(1, math.floor(self.max_cordoned_fraction * cluster_size + 1e-9))

    def counts_against_cap(self, state: str) -> bool:
        if state in ("cordoned", "sweeping", "failed"):
            return True
        return bool(state == "repair" and self.cap_counts_repair)


@dataclass(slots=True)
class SweepFailureStop:
    """Whether too many recent sweeps failed to go on sweeping: more than ``fraction`` of
    the sweeps that ended within ``window_s``, once there are ``min_sweeps`` of them."""

    fraction: float = 0.5
    window_s: float = 3600.0
    min_sweeps: int = 10
    #: (when a sweep ended, whether it passed), oldest first
    outcomes: collections.deque[tuple[float, bool]] = field(default_factory=collections.deque)

    @classmethod
    def from_settings(cls, s: OrchestratorSettings) -> SweepFailureStop:
        return cls(s.sweep_stop_failed_fraction, s.sweep_stop_window_s, s.sweep_stop_min_sweeps)

    def record(self, ts: float, passed: bool) -> None:
        self.outcomes.append((ts, passed))
        if len(self.outcomes) > 1 and ts < self.outcomes[-2][0]:  # recovered out of order
            self.outcomes = collections.deque(sorted(self.outcomes))

    def reason(self, now: float) -> str | None:
        """Why sweeping stops now, or ``None`` while it may go on."""
        while self.outcomes and self.outcomes[0][0] < now - self.window_s:
            self.outcomes.popleft()
        total = len(self.outcomes)
        failed = sum(not passed for _, passed in self.outcomes)
        if self.fraction >= 1 or total < self.min_sweeps or failed <= self.fraction * total:
            return None
        return (
            f"{failed} of the last {total} sweeps within {self.window_s:g} s failed "
            f"(over {self.fraction * 100:g} %)"
        )

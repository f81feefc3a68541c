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

Example
-------
>>> from guard.config import OrchestratorSettings
>>> policy = SweepPolicy.from_settings(OrchestratorSettings())
>>> policy.cordon_limit(32), policy.cordon_limit(200), policy.cordon_limit(10)
(1, 10, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from guard.config import OrchestratorSettings
from guard.schemas import SEVERITY_RANK, Flag

from .states import NodeRecord

__all__ = ["SweepPolicy"]


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
    cap_counts_repair: bool = False
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
        return end - start >= self.persistence_s

    def cordon_limit(self, cluster_size: int) -> int:
        """Nodes that may be out of the pool on suspicion at once (never below one)."""
        return max(1, math.floor(self.max_cordoned_fraction * cluster_size + 1e-9))

    def counts_against_cap(self, state: str) -> bool:
        if state in ("cordoned", "sweeping", "failed"):
            return True
        return bool(state == "repair" and self.cap_counts_repair)

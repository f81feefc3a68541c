"""Peer groups by structure: which ranks do the same work, so that only they are compared.

A job's ranks do not all do the same work. In a pipeline-parallel job the ranks of the
heaviest stage (the one that also runs the loss and the output embedding) compute longer
and arrive last, every step, at any collective that spans stages (a gradient-norm or loss
all-reduce over all ranks). The same holds for any group of ranks that is late together: a
stage, a rack behind a slower switch, a data-parallel group. Comparing such a group with
the rest claims every one of its nodes; comparing each rank with the ranks of its own group
finds the one rank that is late *within* it.

Where telemetry names the pipeline stage (``StepTiming.pp_stage``), the stage is the group.
Where it does not, :func:`structure_groups` finds the groups from each rank's smoothed level
(its persistent lateness or slowness against the whole job, :class:`LevelTracker`): sorted
levels split where two neighbours differ by more than ``gap`` and by more than four times
the levels' own noise (a noisy job's smoothed levels wander; only a separation well beyond
that is structure). A cluster of at least ``min_size`` ranks (the detectors ask for eight:
a stage or a rack, not a handful of noisy workers) on at least two nodes is a structural
group (a fault does not strike several nodes at once, at the same level) once the same
grouping has held ``settle`` rounds in a row; every other rank (a lone late rank, all the
ranks of one node) stays with the largest cluster, where it can be claimed.

Example
-------
>>> from guard.detectors.peer_groups import structure_groups
>>> levels = {r: 0.001 * (r % 3) + (0.06 if r >= 16 else 0.0) + (0.1 if r == 3 else 0.0)
...           for r in range(24)}            # ranks 16-23 (nodes n4, n5) are a heavy stage
>>> node_of = {r: f"n{r // 4}" for r in range(24)}
>>> groups = structure_groups(levels, node_of)
>>> sorted({groups[r] for r in range(16)}), sorted({groups[r] for r in range(16, 24)})
([0], [2])

Rank 3, late by itself, stays in group 0, where it is compared with its peers and claimed.

"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from .robust import mad_sigma

__all__ = ["LevelTracker", "structure_groups"]

_ALPHA = 0.1  # smoothing of a rank's level
#: standard deviation of an exponentially smoothed level, per unit of round-to-round noise
_LEVEL_NOISE = math.sqrt(_ALPHA / (2.0 - _ALPHA))


class LevelTracker:
    """Each member's smoothed residual against the whole group, and the rounds' own noise."""

    __slots__ = ("accepted", "candidate", "jitter", "levels", "settle", "streak", "version")

    def __init__(self, settle: int = 10) -> None:
        self.levels: dict[int, float] = {}
        self.jitter = -1.0  # smoothed MAD-sigma of residual minus level (round-to-round noise)
        self.settle = settle
        self.accepted: dict[int, int] = {}
        self.candidate: dict[int, int] = {}
        self.streak = 0
        self.version = 0  # counts changes of the accepted grouping (members' peers changed)

    def update(self, residuals: Mapping[int, float]) -> None:
        levels = self.levels
        innovations = [r - levels[k] for k, r in residuals.items() if k in levels]
        if len(innovations) >= 3:
            step = mad_sigma(innovations)
            self.jitter = step if self.jitter < 0 else self.jitter + _ALPHA * (step - self.jitter)
        for k, r in residuals.items():
            prev = levels.get(k)
            levels[k] = r if prev is None else prev + _ALPHA * (r - prev)

    def noise(self) -> float:
        """Standard deviation of a level from noise alone."""
        return max(0.0, self.jitter) * _LEVEL_NOISE

    def groups(
        self, members: list[int], node_of: Mapping[int, str], gap: float, min_size: int
    ) -> dict[int, int]:
        """:func:`structure_groups` of ``members``, the gap at least four level noises, once
        the same grouping has come out ``settle`` rounds in a row (persistently late
        together: clusters that form and dissolve in a noisy job are not structure)."""
        levels = self.levels
        found = structure_groups(
            {m: levels.get(m, 0.0) for m in members},
            node_of,
            max(gap, 4.0 * self.noise()),
            min_size,
        )
        found = {m: g for m, g in found.items() if g}  # only ranks outside group 0
        if found == self.candidate:
            self.streak += 1
        else:
            self.candidate, self.streak = found, 1
        if self.streak >= self.settle and found != self.accepted:
            self.accepted = found
            self.version += 1
        accepted = self.accepted
        if not accepted:
            return dict.fromkeys(members, 0)  # the common case: one group
        return {m: accepted.get(m, 0) for m in members}


def structure_groups(
    levels: Mapping[int, float],
    node_of: Mapping[int, str],
    gap: float = 0.02,
    min_size: int = 4,
) -> dict[int, int]:
    """Rank -> group id (``0``: the largest cluster and every rank outside a structural one)."""
    if not levels:
        return {}
    order = sorted(levels, key=levels.__getitem__)
    clusters: list[list[int]] = [[order[0]]]
    for a, b in itertools.pairwise(order):
        if levels[b] - levels[a] > gap:
            clusters.append([b])
        else:
            clusters[-1].append(b)
    if len(clusters) == 1:
        return dict.fromkeys(order, 0)
    main = max(range(len(clusters)), key=lambda i: len(clusters[i]))
    groups: dict[int, int] = {}
    for i, members in enumerate(clusters):
        structural = (
            i != main and len(members) >= min_size and len({node_of.get(r) for r in members}) >= 2
        )
        gid = i + 1 if structural else 0
        for r in members:
            groups[r] = gid
    return groups

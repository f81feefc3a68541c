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
(its persistent lateness or slowness against the whole job): sorted levels split where two
neighbours differ by more than ``gap``; a cluster of at least ``min_size`` ranks on at least
two nodes is a structural group (a fault does not strike several nodes at once, at the same
level); every other rank — a lone late rank, all the ranks of one node — stays with the
largest cluster, where it can be claimed.

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
from collections.abc import Mapping

__all__ = ["structure_groups"]


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

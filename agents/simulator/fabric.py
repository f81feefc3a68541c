"""A multi-path leaf-spine fabric for the simulator: ECMP collisions and degraded uplinks.

Off unless ``SimConfig.fabric`` is set (a :class:`FabricSpec`); then every job's per-rail
ring connections (the same rings :mod:`.training` times: GPU *g* of each node to GPU *g* of
the next node of its stage) are flows on a topology (a file, else
:func:`~guard.schemas.topology.infer_topology` over the node names). The switches route
each queue pair by ECMP: a hash of its 5-tuple (RoCE v2 source port from the QP) seeded per
leaf, as switches are — the simulator's own, not the one Guard's planner assumes. A flow
listed in ``routes`` (``(src, dst, rail, qp) -> spine``, e.g. a plan of
:func:`guard.planning.paths.steering_plan` over :meth:`FabricModel.connections`, applied
by source-port steering) takes that spine instead. The simulator
itself plans nothing: agents do not import the planner.

Contention, per link: the job's own flows all the time (its rings run at once), each other
job's flows weighted by how much of the time that job is in its all-reduce
(``cross_job_overlap``; None: the training model's share, 0.25 of a nominal step over its
0.97; 1.0: every all-reduce at once, the worst case of ``benchmarks/paths.py``). A link
carrying ``L`` bytes at ``C`` bytes/s is busy ``L / C``; a connection's slowdown factor is
its busiest link's busy time over its own bytes at its NIC's speed (1.0: nothing shares its
path). The factor multiplies the connection's duration in ``peers`` and so the collective's
(a ring is as slow as its slowest connection). The sending NIC of a slowed connection sees
``port_xmit_wait`` and ECN / CNP counts rise with the excess (PFC back-pressure and marks).

Degraded uplinks (``degraded``: ``(leaf, spine, capacity_factor, onset_s, end_s)``, or
``random_degraded`` of them drawn at ``degraded_factor``) are in the truth as confounders of
kind ``degraded_uplink``: the fabric's fault, not a node's. ECMP keeps hashing an equal
share onto them; the planner sees their capacity.

Draws come from a stream of their own (``[seed, 7]``): a config without a fabric draws
exactly what it drew before. ``placement="random"`` puts the jobs on random free nodes
(each job's ring in node-name order) instead of consecutive ones.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.schemas.topology import Topology, infer_topology, load_topology

__all__ = ["Connection", "FabricModel", "FabricSpec"]

#: the training model's all-reduce share of a nominal step (0.25 of 0.72 + 0.25)
COMM_DUTY = 0.25 / 0.97
#: one queue pair of a ring connection: (src node, dst node, rail, qp)
Connection = tuple[str, str, int, int]


@dataclass
class FabricSpec:
    topology: str | None = None  # a topology file; None: inferred over the node names
    nodes_per_leaf: int = 16
    spines: int = 8
    qps_per_connection: int = 1
    cross_job_overlap: float | None = None  # None: COMM_DUTY
    placement: str = "contiguous"  # contiguous | random
    degraded: list[tuple[str, str, float, float, float | None]] = field(default_factory=list)
    random_degraded: int = 0
    degraded_factor: float = 0.5
    #: steered flows: (src, dst, rail, qp) -> spine (None: its leaf); the rest hash (ECMP)
    routes: dict[Connection, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.placement not in ("contiguous", "random"):
            raise ValueError(f"fabric placement {self.placement!r}: choose contiguous or random")


class _Links:
    """The topology as capacities (bytes/s): NIC send and receive, uplink up and down."""

    def __init__(self, topology: Topology) -> None:
        self.cap: list[float] = []
        self.nic: dict[tuple[str, int], tuple[int, int, str]] = {}
        for node in topology.nodes:
            for nic in node.nics:
                self.nic[(node.name, nic.rail)] = (
                    self._add(nic.gbps),
                    self._add(nic.gbps),
                    nic.leaf,
                )
        self.up: dict[str, dict[str, tuple[int, int]]] = {}
        for u in topology.uplinks:
            if u.effective_gbps > 0:
                pair = (self._add(u.effective_gbps), self._add(u.effective_gbps))
                self.up.setdefault(u.leaf, {})[u.spine] = pair

    def _add(self, gbps: float) -> int:
        self.cap.append(gbps * 1e9 / 8)
        return len(self.cap) - 1

    def path(self, conn: Connection, steered: dict[Connection, str | None]) -> list[int]:
        src, dst, rail, qp = conn
        tx, _, a = self.nic[(src, rail)]
        _, rx, b = self.nic[(dst, rail)]
        if a == b:
            return [tx, rx]
        spines = sorted(self.up.get(a, {}).keys() & self.up.get(b, {}).keys())
        if not spines:
            raise ValueError(f"no spine joins leaves {a} and {b}: every uplink is drained")
        spine = steered.get(conn)
        if spine not in spines:  # ECMP at the source leaf: its seed, the 5-tuple
            port = 0xC000 | (zlib.crc32(f"{src}/{dst}/{rail}/{qp}".encode()) & 0x3FFF)
            five = f"{a}|{src}|{dst}|{rail}|17|{port}|4791".encode()
            spine = spines[zlib.crc32(five) % len(spines)]
        return [tx, self.up[a][spine][0], self.up[b][spine][1], rx]


class FabricModel:
    """Per-connection slowdown factors and per-NIC congestion of the current layout."""

    def __init__(
        self,
        spec: FabricSpec,
        node_names: list[str],
        gpus: int,
        rng: np.random.Generator,
        start_ts: float = 0.0,
    ) -> None:
        self.spec = spec
        self.start_ts = start_ts
        self.node_names = node_names
        self.topology: Topology = (
            load_topology(spec.topology)
            if spec.topology is not None
            else infer_topology(
                node_names, rails=gpus, nodes_per_leaf=spec.nodes_per_leaf, spines=spec.spines
            )
        )
        self.gpus = gpus
        self.degraded = list(spec.degraded)
        names = [u.name for u in self.topology.uplinks]
        if spec.random_degraded:
            picked = rng.choice(len(names), min(spec.random_degraded, len(names)), replace=False)
            for i in sorted(picked.tolist()):
                leaf, _, spine = names[i].partition("->")
                self.degraded.append((leaf, spine, spec.degraded_factor, 0.0, None))
        self._key: Any = None
        self._factors: dict[str, np.ndarray] = {}
        self._excess = np.zeros((len(node_names), gpus))
        self.overlap = COMM_DUTY if spec.cross_job_overlap is None else spec.cross_job_overlap

    def confounders(self, end_ts: float) -> list[dict[str, Any]]:
        """The degraded uplinks, as ``Scenario.add_confounder`` keyword arguments."""
        return [
            {
                "kind": "degraded_uplink",
                "start": self.start_ts + onset,
                "end": end_ts if end is None else self.start_ts + end,
                "leaf": leaf,
                "spine": spine,
                "capacity_factor": factor,
            }
            for leaf, spine, factor, onset, end in self.degraded
        ]

    def factors(self, jobs: list[Any], t: float) -> dict[str, np.ndarray]:
        """Each job's per-rank factor on its connection to its ring's next rank."""
        self._update(jobs, t)
        return self._factors

    def nic_excess(self, jobs: list[Any], t: float) -> np.ndarray:
        """(node, rail): how much slower than alone the NIC's outgoing connection runs."""
        self._update(jobs, t)
        return self._excess

    def _update(self, jobs: list[Any], t: float) -> None:
        rel = t - self.start_ts
        active = tuple(
            i
            for i, (_, _, _, onset, end) in enumerate(self.degraded)
            if rel >= onset and (end is None or rel < end)
        )
        key = (tuple((j.name, j.layout_version, int(j.active.sum())) for j in jobs), active)
        if key == self._key:
            return
        self._key = key
        self._compute(_Links(self.topology_at(t)), jobs)

    def topology_at(self, t: float) -> Topology:
        """The topology with the uplinks degraded at event time ``t``."""
        rel = t - self.start_ts
        return self.topology.with_capacity(
            {
                f"{leaf}->{spine}": factor
                for leaf, spine, factor, onset, end in self.degraded
                if rel >= onset and (end is None or rel < end)
            }
        )

    def connections(self, job: Any) -> list[tuple[Connection, int]]:
        """The job's inter-node ring connections, one per queue pair, each with its rank."""
        out = []
        nodes, gpus, stages = job.rank_node, job.rank_gpu, job.rank_stage
        for st in range(job.pp_stages):
            members = np.flatnonzero((stages == st) & job.active)
            for rail in range(self.gpus):
                ring = members[gpus[members] == rail]
                if ring.size < 2:
                    continue
                for r, nxt in zip(ring.tolist(), np.roll(ring, -1).tolist(), strict=True):
                    src, dst = self.node_names[nodes[r]], self.node_names[nodes[nxt]]
                    out += [((src, dst, rail, qp), r) for qp in range(self.spec.qps_per_connection)]
        return out

    def _compute(self, links: _Links, jobs: list[Any]) -> None:
        share = 1.0 / self.spec.qps_per_connection  # of a connection's bytes, per QP
        own = np.zeros((len(jobs), len(links.cap)))
        paths = []
        for j, job in enumerate(jobs):
            for conn, rank in self.connections(job):
                path = links.path(conn, self.spec.routes)
                own[j, path] += share
                paths.append((j, conn, rank, path))
        cap = np.array(links.cap)
        busy = (own + self.overlap * (own.sum(axis=0) - own)) / cap  # per job's view
        factors = {job.name: np.ones(len(job.rank_node)) for job in jobs}
        excess = np.zeros((len(self.node_names), self.gpus))
        for j, conn, rank, path in paths:
            job = jobs[j]
            alone = 1.0 / cap[path[0]]  # the whole connection on its own NIC
            factor = max(1.0, float(busy[j, path].max()) / alone)
            per_rank = factors[job.name]
            per_rank[rank] = max(per_rank[rank], factor)
            node = int(job.rank_node[rank])
            excess[node, conn[2]] = max(excess[node, conn[2]], factor - 1.0)
        self._factors, self._excess = factors, excess

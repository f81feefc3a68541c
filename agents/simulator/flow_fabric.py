"""An independent fabric model: per-QP ECMP on the real 5-tuple, max-min fair rates, step time.

This is the judge of Guard's path advice, so it shares nothing with the planner
(:mod:`guard.planning.paths`): no busy-seconds bottleneck, no planner hash. It models

* **Queue pairs as NICs open them.** Every ring connection (GPU *g* of a node to GPU *g* of
  the next node, NIC rail *g*) opens ``qps`` RC queue pairs. Each NIC hands out QP numbers
  in sequence from a random 24-bit base (per NIC, per run). The RoCE v2 UDP source port is
  what the Linux RDMA core derives from the two QP numbers when no flow label is set
  (:func:`rdma_udp_sport`: ``rdma_calc_flow_label`` + ``rdma_flow_label_to_udp_sport`` of
  ``include/rdma/ib_verbs.h``, used by rxe and mlx5 for RoCE v2); the destination port is
  4791, the addresses one per NIC (``10.<rail>.<node>``).
* **ECMP as switch ASICs do it** (a model): the source leaf hashes the packed 5-tuple with a
  CRC32 seeded per switch (ASICs offer CRC hash functions with a per-switch seed against
  hash polarisation) and picks ``hash mod members`` among the spines with a path to the
  destination leaf. A degraded uplink stays a member (ECMP does not see its speed); a
  drained one (capacity 0) is withdrawn. ``routing="adaptive"`` instead spreads every QP's
  bytes over all member spines in proportion to their capacity (the fluid limit of
  per-packet adaptive routing, InfiniBand AR or Spectrum-X; real AR is less ideal).
  ``steer`` pins a QP to a given spine (source-port steering: what C4P's modified library
  does, not stock NCCL).
* **Max-min fair sharing** (:func:`max_min_rates`, progressive filling): every link's
  capacity is shared equally per QP among those not limited elsewhere, the fluid model of
  per-QP congestion control. A ring is synchronous (each chunk waits for its predecessor), so
  all its QPs move at one rate: the ring is the unit of filling, each link carrying as many
  of its QPs as cross it.
* **Training steps in time** (:func:`simulate_steps`): each job alternates ``compute_s`` of
  compute with one ring all-reduce of ``message_bytes`` per rank over all rails (each
  connection sends ``2 (n-1)/n`` of its rail's share, split over ``channels`` rings per
  rail, NCCL's channels, each with its own QPs); jobs start at random phases, so their
  all-reduces overlap only when they happen to. Rates are recomputed whenever a ring starts
  or finishes; a job's all-reduce ends with its last ring.

Pure numpy, no clock, no I/O; agents do not import the planner.

Example
-------
Two rings on one leaf's only uplink share it; a third ring elsewhere runs at NIC speed.

>>> import numpy as np
>>> w = np.array([[1.0, 1.0, 0.0],   # the uplink: rings 0 and 1
...               [1.0, 0.0, 0.0],   # ring 0's NIC
...               [0.0, 1.0, 0.0],   # ring 1's NIC
...               [0.0, 0.0, 1.0]])  # ring 2's NIC
>>> max_min_rates(w, np.array([100.0, 100.0, 100.0, 100.0])).tolist()
[50.0, 50.0, 100.0]
>>> rdma_udp_sport(0x000123, 0x000456) >= 0xC000
True
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from guard.schemas.topology import Topology

__all__ = [
    "FlowFabric",
    "JobRun",
    "StepJob",
    "max_min_rates",
    "rdma_udp_sport",
    "simulate_steps",
]

ROCE_V2_DPORT = 4791
UDP = 17
#: IB_ROCE_UDP_ENCAP_VALID_PORT_MIN: RoCE v2 source ports are 0xC000..0xFFFF
SPORT_MIN = 0xC000
FLOW_LABEL_MASK = 0xFFFFF
#: a steered QP: (job, src, dst, rail, channel * qps + qp) -> spine (None: it stays on its leaf)
Steering = Mapping[tuple[str, str, str, int, int], str | None]


def rdma_udp_sport(lqpn: int, rqpn: int, flow_label: int = 0) -> int:
    """The RoCE v2 UDP source port of a QP, as the Linux RDMA core computes it.

    ``rdma_get_udp_sport``: without a flow label, one from the two QP numbers
    (``rdma_calc_flow_label``: their product folded to 20 bits), then its top 6 bits folded
    into the low 14 and the result put in 0xC000..0xFFFF.
    """
    fl = flow_label & FLOW_LABEL_MASK
    if not fl:
        v = (lqpn & 0xFFFFFF) * (rqpn & 0xFFFFFF)
        v ^= v >> 20
        v ^= v >> 40
        fl = v & FLOW_LABEL_MASK
    low = (fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14)
    return low | SPORT_MIN


def max_min_rates(weights: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair per-QP rate of each group (column) by progressive filling.

    ``weights[l, g]``: how many of group ``g``'s QPs cross link ``l`` (fractional under
    adaptive routing); ``capacity[l]``: bytes/s. All unfrozen groups' rates rise together
    until a link fills; the groups on it freeze; repeat. A group on no link stays 0.
    """
    groups = weights.shape[1]
    rate = np.zeros(groups)
    active = weights.sum(axis=0) > 0
    residual = capacity.astype(float).copy()
    while active.any():
        demand = weights[:, active].sum(axis=1)
        used = demand > 1e-12
        step = float(np.min(residual[used] / demand[used]))
        rate[active] += step
        residual -= demand * step
        full = used & (residual <= 1e-9 * capacity)
        frozen = (weights[full] > 1e-12).any(axis=0)
        if not frozen[active].any():  # rounding: freeze the tightest link's groups
            tight = np.flatnonzero(used)[np.argmin(residual[used] / demand[used])]
            frozen = weights[tight] > 1e-12
        active &= ~frozen
    return rate


class FlowFabric:
    """A topology as links (bytes/s) and the path of each queue pair over it."""

    def __init__(self, topology: Topology, routing: str = "ecmp") -> None:
        if routing not in ("ecmp", "adaptive"):
            raise ValueError(f"routing {routing!r}: choose ecmp or adaptive")
        self.topology, self.routing = topology, routing
        self.link_names: list[str] = []
        cap: list[float] = []

        def add(name: str, gbps: float) -> int:
            self.link_names.append(name)
            cap.append(gbps * 1e9 / 8)
            return len(cap) - 1

        self.nic: dict[tuple[str, int], tuple[int, int, str]] = {}
        self.ip: dict[tuple[str, int], int] = {}
        for i, node in enumerate(topology.nodes):
            for nic in node.nics:
                tx, rx = (
                    add(f"{node.name}/{nic.device}:tx", nic.gbps),
                    add(f"{node.name}/{nic.device}:rx", nic.gbps),
                )
                self.nic[(node.name, nic.rail)] = (tx, rx, nic.leaf)
                self.ip[(node.name, nic.rail)] = (
                    (10 << 24) | ((nic.rail & 0xFF) << 16) | (i & 0xFFFF)
                )
        self.up: dict[str, dict[str, tuple[int, int]]] = {}
        for u in topology.uplinks:
            if u.effective_gbps > 0:
                pair = (
                    add(u.name, u.effective_gbps),
                    add(f"{u.spine}->{u.leaf}", u.effective_gbps),
                )
                self.up.setdefault(u.leaf, {})[u.spine] = pair
        self.capacity = np.array(cap)
        self._seed = {leaf: zlib.crc32(leaf.encode()) for leaf in self.up}

    def members(self, src_leaf: str, dst_leaf: str) -> list[str]:
        spines = sorted(self.up.get(src_leaf, {}).keys() & self.up.get(dst_leaf, {}).keys())
        if not spines:
            raise ValueError(f"no spine joins leaves {src_leaf} and {dst_leaf}: all drained")
        return spines

    def spine_of(self, src: str, dst: str, rail: int, sport: int) -> str | None:
        """The spine the source leaf's ECMP hash picks for this 5-tuple (None: same leaf)."""
        a, b = self.nic[(src, rail)][2], self.nic[(dst, rail)][2]
        if a == b:
            return None
        members = self.members(a, b)
        five = struct.pack(
            ">IIBHH", self.ip[(src, rail)], self.ip[(dst, rail)], UDP, sport, ROCE_V2_DPORT
        )
        return members[zlib.crc32(five, self._seed[a]) % len(members)]

    def qp_links(
        self, src: str, dst: str, rail: int, sport: int, steer: str | bool | None = False
    ) -> list[tuple[int, float]]:
        """The links one QP loads and the share of its bytes on each (``steer``: a spine)."""
        tx, _, a = self.nic[(src, rail)]
        _, rx, b = self.nic[(dst, rail)]
        if a == b:
            return [(tx, 1.0), (rx, 1.0)]
        members = self.members(a, b)
        if steer is not False and steer in members:
            picks = [(str(steer), 1.0)]
        elif self.routing == "adaptive" and steer is False:
            room = np.array(
                [
                    min(self.capacity[self.up[a][s][0]], self.capacity[self.up[b][s][1]])
                    for s in members
                ]
            )
            picks = list(zip(members, (room / room.sum()).tolist(), strict=True))
        else:
            spine = self.spine_of(src, dst, rail, sport)
            assert spine is not None
            picks = [(spine, 1.0)]
        out = [(tx, 1.0), (rx, 1.0)]
        for spine, share in picks:
            out += [(self.up[a][spine][0], share), (self.up[b][spine][1], share)]
        return out


@dataclass(frozen=True)
class StepJob:
    """A training job: its nodes in ring (rank) order, its all-reduce and compute per step."""

    name: str
    ring: tuple[str, ...]
    message_bytes: float
    compute_s: float
    qps: int = 1
    #: NCCL channels per NIC: each its own ring over the same NICs, with its own QPs
    channels: int = 1


@dataclass
class JobRun:
    step_s: list[float] = field(default_factory=list)
    allreduce_s: list[float] = field(default_factory=list)


def _ring_weights(
    fabric: FlowFabric,
    job: StepJob,
    rail: int,
    channel: int,
    qpn: dict[tuple[str, int], int],
    steer: Steering | None,
) -> np.ndarray:
    w = np.zeros(len(fabric.capacity))
    n = len(job.ring)
    for k in range(n):
        src, dst = job.ring[k], job.ring[(k + 1) % n]
        for qp in range(job.qps):
            lq, rq = qpn[(src, rail)], qpn[(dst, rail)]
            qpn[(src, rail)], qpn[(dst, rail)] = lq + 1, rq + 1
            sport = rdma_udp_sport(lq, rq)
            spine: str | bool | None = False
            key = (job.name, src, dst, rail, channel * job.qps + qp)
            if steer is not None and key in steer:
                spine = steer[key]
            for link, share in fabric.qp_links(src, dst, rail, sport, spine):
                w[link] += share
    return w


def simulate_steps(
    fabric: FlowFabric,
    jobs: Sequence[StepJob],
    steps: int,
    rng: np.random.Generator,
    steer: Steering | None = None,
    phase: str = "random",
) -> dict[str, JobRun]:
    """Each job's step and all-reduce times over ``steps`` steps, all jobs sharing links.

    ``phase="random"``: each job starts at a random point of its nominal step (its
    all-reduces overlap others' only when they fall together); ``"aligned"``: all start
    together (every all-reduce at once, the worst case). QP numbers are drawn per NIC from
    ``rng``; ``steer`` pins listed QPs to a spine.
    """
    rails = fabric.topology.rails
    qpn = {key: int(rng.integers(0, 1 << 23)) for key in sorted(fabric.nic)}
    live = [j for j in jobs if len(j.ring) > 1]
    columns, owner, conn_bytes = [], [], []
    for j, job in enumerate(live):
        n = len(job.ring)
        for rail in range(rails):
            for channel in range(job.channels):
                columns.append(_ring_weights(fabric, job, rail, channel, qpn, steer))
                owner.append(j)
                conn_bytes.append(2 * (n - 1) / n * job.message_bytes / rails / job.channels)
    weights = np.array(columns).T if columns else np.zeros((len(fabric.capacity), 0))
    used = weights.sum(axis=1) > 0
    weights, capacity = weights[used], fabric.capacity[used]
    owner_a, qps = np.array(owner), np.array([live[j].qps for j in owner], dtype=float)
    nominal = np.array(  # compute + the all-reduce at NIC speed: the phases are drawn in it
        [
            job.compute_s
            + conn_bytes[owner.index(j)] / fabric.capacity[fabric.nic[(job.ring[0], 0)][0]]
            for j, job in enumerate(live)
        ]
    )
    runs = {job.name: JobRun() for job in live}
    t = 0.0
    compute_end = (
        rng.uniform(0, nominal) if phase == "random" else np.zeros(len(live))
    ) + np.array([job.compute_s for job in live])
    step_start = compute_end - np.array([job.compute_s for job in live])
    remaining = np.zeros(len(owner))  # bytes left per connection of each ring
    comm_start = np.full(len(live), np.nan)
    done = np.zeros(len(live), dtype=int)
    rate = np.zeros(len(owner))
    dirty = True
    while (done < steps).any():
        in_comm = remaining > 0
        if dirty:
            rate = np.zeros(len(owner))
            if in_comm.any():
                rate[in_comm] = max_min_rates(weights[:, in_comm], capacity) * qps[in_comm]
            dirty = False
        finish = np.where(in_comm, remaining / np.where(rate > 0, rate, np.inf), np.inf)
        waiting = np.where(np.isnan(comm_start) & (done < steps), compute_end - t, np.inf)
        dt = float(min(finish.min(), waiting.min()))
        if not np.isfinite(dt):
            break
        dt = max(dt, 0.0)
        t += dt
        remaining = np.where(in_comm, np.maximum(remaining - rate * dt, 0.0), remaining)
        remaining[in_comm & (finish <= dt * (1 + 1e-12) + 1e-15)] = 0.0
        for j in range(len(live)):
            mine = owner_a == j
            if np.isnan(comm_start[j]) and done[j] < steps and compute_end[j] <= t + 1e-12:
                comm_start[j] = t
                remaining[mine] = np.array(conn_bytes)[mine]
                dirty = True
            elif not np.isnan(comm_start[j]) and not (remaining[mine] > 0).any():
                run = runs[live[j].name]
                run.allreduce_s.append(t - comm_start[j])
                run.step_s.append(t - step_start[j])
                done[j] += 1
                comm_start[j] = np.nan
                step_start[j] = t
                compute_end[j] = t + live[j].compute_s
                dirty = True
    return runs

"""Path planning for collective traffic over a leaf-spine fabric, versus ECMP hashing (C4P).

A ring all-reduce on a rail-optimised fabric sends, on every rail, one flow from each node to
the next. A flow between pods climbs from its leaf to *one* spine. ECMP picks that spine by
hashing the flow's 5-tuple (RoCE v2: the UDP source port comes from the queue pair): a few
large, long-lived flows per leaf collide on some uplinks and leave others idle, and it does
not see a degraded link. The planner assigns every flow a spine so that the most loaded link
is as light as it can make it (greedy, largest flow first, then local re-routing passes),
counting each link's *effective* capacity, so a half-speed uplink gets half the traffic.

Bottleneck model (used to judge both): links share capacity in proportion to bytes, so a
link carrying ``L`` bytes at ``C`` bytes/s is busy ``L / C`` seconds, and a flow takes the
longest of its links' busy times. A ring all-reduce is synchronous: its time is its slowest
flow's. Flows of all concurrent jobs share the links.

Pure: no I/O, no clock. :func:`ring_allreduce_flows` builds the traffic, :func:`ecmp_routes`
and :func:`plan_routes` choose paths, :func:`evaluate_routes` judges a choice.

Example: 4 pods of 1 node, 1 rail, 2 spines; the ring's 4 cross-pod flows under ECMP
may share a spine uplink, the plan never does worse.

>>> from guard.schemas.topology import infer_topology
>>> fabric = Fabric(infer_topology([f"n{i}" for i in range(4)], rails=1, nodes_per_leaf=1,
...                                spines=2, nic_gbps=400, uplink_gbps=400))
>>> flows = ring_allreduce_flows("job-a", [f"n{i}" for i in range(4)], rails=1,
...                              message_bytes=1e9)
>>> planned = evaluate_routes(fabric, flows, plan_routes(fabric, flows))
>>> ecmp = evaluate_routes(fabric, flows, ecmp_routes(fabric, flows))
>>> planned.max_link_s <= ecmp.max_link_s
True
>>> round(planned.allreduce_s["job-a"], 4)  # 1.5 GB over a 50 GB/s NIC
0.03
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from guard.schemas.topology import Topology, TopologyError

__all__ = [
    "Fabric",
    "Flow",
    "RouteReport",
    "ecmp_routes",
    "evaluate_routes",
    "plan_routes",
    "ring_allreduce_flows",
    "roce_source_port",
    "steering_plan",
]

ROCE_V2_PORT = 4791  # UDP destination port of RoCE v2
UDP = 17


@dataclass(frozen=True, slots=True)
class Flow:
    """One queue pair's share of a connection from ``src`` to ``dst`` on ``rail``."""

    job: str
    src: str
    dst: str
    rail: int
    qp: int
    bytes: float


@dataclass(frozen=True, slots=True)
class Route:
    """A flow's path: link indexes, and the spine (``None`` when it stays on its leaf)."""

    links: tuple[int, ...]
    spine: str | None


def ring_allreduce_flows(
    job: str,
    nodes: Sequence[str],
    rails: int,
    message_bytes: float,
    qps_per_connection: int = 1,
) -> list[Flow]:
    """The inter-node flows of one ring all-reduce of ``message_bytes`` per rank.

    One ring per rail in node order (NCCL's rings on a rail-optimised fabric); each node
    sends ``2 (n-1)/n`` of its rail's share of the message to the next node, split evenly
    over ``qps_per_connection`` queue pairs (NCCL_IB_QPS_PER_CONNECTION with
    NCCL_IB_SPLIT_DATA_ON_QPS=1).
    """
    n = len(nodes)
    if n < 2:
        return []
    per_flow = 2 * (n - 1) / n * message_bytes / rails / qps_per_connection
    return [
        Flow(job, nodes[k], nodes[(k + 1) % n], rail, qp, per_flow)
        for rail in range(rails)
        for k in range(n)
        for qp in range(qps_per_connection)
    ]


class Fabric:
    """A topology compiled to indexed links with capacities in bytes/s.

    Each node's NIC has a send and a receive link; each leaf-spine uplink one link per
    direction. A drained uplink (capacity factor 0) is no path at all, as after the routing
    protocol withdraws it; a degraded one stays a path at its reduced capacity.
    """

    def __init__(self, topology: Topology):
        self.topology = topology
        self.link_names: list[str] = []
        self.capacity: list[float] = []
        self._nic: dict[tuple[str, int], tuple[int, int, str]] = {}
        self._node_index = {node.name: i for i, node in enumerate(topology.nodes)}
        for node in topology.nodes:
            for nic in node.nics:
                tx = self._link(f"{node.name}/{nic.device}:tx", nic.gbps)
                rx = self._link(f"{node.name}/{nic.device}:rx", nic.gbps)
                self._nic[(node.name, nic.rail)] = (tx, rx, nic.leaf)
        self._up: dict[str, dict[str, tuple[int, int]]] = {}
        for up in topology.uplinks:
            if up.effective_gbps <= 0:
                continue
            pair = (
                self._link(up.name, up.effective_gbps),
                self._link(f"{up.spine}->{up.leaf}", up.effective_gbps),
            )
            self._up.setdefault(up.leaf, {})[up.spine] = pair
        self._between: dict[tuple[str, str], list[tuple[str, int, int]]] = {}

    def _link(self, name: str, gbps: float) -> int:
        self.link_names.append(name)
        self.capacity.append(gbps * 1e9 / 8)
        return len(self.link_names) - 1

    def nic(self, node: str, rail: int) -> tuple[int, int, str]:
        try:
            return self._nic[(node, rail)]
        except KeyError:
            raise TopologyError(
                f"node {node!r} has no NIC on rail {rail} in the topology"
            ) from None

    def node_index(self, node: str) -> int:
        return self._node_index[node]

    def routes(self, flow: Flow) -> list[Route]:
        """Every path ``flow`` can take: one per spine both leaves reach, or its leaf alone."""
        tx, _, src_leaf = self.nic(flow.src, flow.rail)
        _, rx, dst_leaf = self.nic(flow.dst, flow.rail)
        if src_leaf == dst_leaf:
            return [Route((tx, rx), None)]
        return [
            Route((tx, up, down, rx), spine)
            for spine, up, down in self._spines_between(src_leaf, dst_leaf)
        ]

    def _spines_between(self, a: str, b: str) -> list[tuple[str, int, int]]:
        found = self._between.get((a, b))
        if found is None:
            ups, downs = self._up.get(a, {}), self._up.get(b, {})
            found = [(s, ups[s][0], downs[s][1]) for s in sorted(ups.keys() & downs.keys())]
            if not found:
                raise TopologyError(
                    f"no spine connects leaf {a!r} to leaf {b!r} (all uplinks drained or "
                    "missing): undrain one, or fix the topology file"
                )
            self._between[(a, b)] = found
        return found


def roce_source_port(flow: Flow) -> int:
    """A stand-in for the UDP source port of the flow's queue pair.

    The real one comes from the two QP numbers (the Linux RDMA core's
    ``rdma_get_udp_sport``), which the planner does not see: this deterministic draw only
    makes its ECMP prediction (and so ``ecmp_spine`` in a plan, and the gains the advice
    quotes) a plausible sample of random hashing, not the spine a switch will pick.
    """
    key = f"{flow.job}\x1f{flow.src}\x1f{flow.dst}\x1f{flow.rail}\x1f{flow.qp}".encode()
    qpn = int.from_bytes(hashlib.blake2b(key, digest_size=3).digest(), "big")
    return 0xC000 | ((qpn ^ (qpn >> 14)) & 0x3FFF)


def ecmp_routes(fabric: Fabric, flows: Sequence[Flow]) -> list[Route]:
    """What the switches do: a deterministic hash of the 5-tuple picks among equal paths."""
    chosen = []
    for flow in flows:
        options = fabric.routes(flow)
        src_ip = (10 << 24) | (flow.rail << 16) | fabric.node_index(flow.src)
        dst_ip = (10 << 24) | (flow.rail << 16) | fabric.node_index(flow.dst)
        five = struct.pack(">IIBHH", src_ip, dst_ip, UDP, roce_source_port(flow), ROCE_V2_PORT)
        chosen.append(options[zlib.crc32(five) % len(options)])
    return chosen


def plan_routes(fabric: Fabric, flows: Sequence[Flow], passes: int = 2) -> list[Route]:
    """Assign paths to minimise the most loaded link (busy seconds at effective capacity).

    Greedy in decreasing flow size, each flow onto the path whose worst link would be least
    busy after adding it (ties: the least total), then ``passes`` rounds of taking each flow
    off and putting it back on its best path given all the others.
    """
    cap = fabric.capacity
    busy = [0.0] * len(cap)
    options = [fabric.routes(f) for f in flows]
    chosen: list[Route | None] = [None] * len(flows)
    order = sorted(range(len(flows)), key=lambda i: (-flows[i].bytes, i))
    for rounds in range(passes + 1):
        for i in order:
            if rounds and len(options[i]) == 1:
                continue
            size = flows[i].bytes
            previous = chosen[i]
            if previous is not None:
                for link in previous.links:
                    busy[link] -= size / cap[link]
            best = min(options[i], key=lambda r: _cost_after(r, size, busy, cap))
            for link in best.links:
                busy[link] += size / cap[link]
            chosen[i] = best
    return [r for r in chosen if r is not None]


def _cost_after(
    route: Route, size: float, busy: list[float], cap: list[float]
) -> tuple[float, float]:
    after = [busy[link] + size / cap[link] for link in route.links]
    return max(after), sum(after)


@dataclass
class RouteReport:
    """How a choice of paths performs under the bottleneck model."""

    link_busy_s: list[float]
    allreduce_s: dict[str, float]
    max_link_s: float
    hottest: list[tuple[str, float]] = field(default_factory=list)


def evaluate_routes(
    fabric: Fabric, flows: Sequence[Flow], routes: Sequence[Route], top: int = 5
) -> RouteReport:
    """Busy seconds per link, each job's all-reduce time, and the ``top`` hottest links."""
    cap = fabric.capacity
    busy = [0.0] * len(cap)
    for flow, route in zip(flows, routes, strict=True):
        for link in route.links:
            busy[link] += flow.bytes / cap[link]
    allreduce: dict[str, float] = {}
    for flow, route in zip(flows, routes, strict=True):
        slowest = max(busy[link] for link in route.links)
        allreduce[flow.job] = max(allreduce.get(flow.job, 0.0), slowest)
    ranked = sorted(range(len(busy)), key=lambda i: -busy[i])[:top]
    return RouteReport(
        link_busy_s=busy,
        allreduce_s=allreduce,
        max_link_s=max(busy, default=0.0),
        hottest=[(fabric.link_names[i], busy[i]) for i in ranked if busy[i] > 0],
    )


def steering_plan(
    topology: Topology, connections: Sequence[tuple[str, tuple[str, str, int, int]]]
) -> dict[tuple[str, str, int, int], str | None]:
    """The planned spine of each ``(job, (src, dst, rail, qp))`` queue pair, as a switch
    steering table would hold it (equal bytes per queue pair; the simulator's ``routes``).

    >>> from guard.schemas.topology import infer_topology
    >>> topo = infer_topology(["a", "b", "c", "d"], rails=1, nodes_per_leaf=1, spines=2)
    >>> plan = steering_plan(topo, [("j", ("a", "c", 0, 0)), ("j", ("b", "c", 0, 0))])
    >>> sorted(plan.values())  # two flows down into leaf pod2-rail0: one per spine
    ['spine0', 'spine1']
    """
    fabric = Fabric(topology)
    flows = [Flow(job, src, dst, rail, qp, 1.0) for job, (src, dst, rail, qp) in connections]
    routes = plan_routes(fabric, flows)
    return {conn: route.spine for (_, conn), route in zip(connections, routes, strict=True)}

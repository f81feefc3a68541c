"""Traffic-engineering advice per job: what a stock stack can apply, and the path plan.

For the concurrent jobs on a fabric, :func:`advise` models every job's ring all-reduce flows
together (they share links) with the bottleneck model of :mod:`guard.planning.paths` and
writes one :class:`~guard.schemas.Advice` per job. Each action says what applies it, when
(now, or at the job's next restart) and on which fabrics it helps (its ``why``), and is kept
only when the model says it saves at least ``MIN_GAIN`` of the job's all-reduce time:

- ``nccl_env``: ``NCCL_IB_QPS_PER_CONNECTION=2`` or ``4`` (the fewest that gets within
  ``MIN_GAIN`` of the best) with ``NCCL_IB_SPLIT_DATA_ON_QPS=1``: more ECMP hashes per
  connection; next restart; RoCE or InfiniBand hashing by ECMP;
- ``place_ranks``: a host order (:func:`leaf_ring_order`) keeping ring neighbours under one
  leaf, so each rail's ring crosses the spines once per pod; next restart; any leaf-spine;
- ``drain_uplink``: a degraded uplink on a leaf the hot-spot detector saw hot
  (``hot_leaves``, fed by ``guard advise``), never from the topology file alone; now;
  RoCE with ECMP. ``inspect_leaf``: a hot leaf with no uplink known to be degraded;
- ``drain_rail``: a node's NIC running below its rail's speed, with the ``NCCL_IB_HCA``
  list that leaves it out (not part of the modelled gain); next restart; rail-optimised.

The plan (the flows it moves off their ECMP spine, at most ``ADVICE_MAX_PLAN`` listed) and
its modelled gain stay in the message; ``route_flow`` (apply it) is advised only with
``steering=True``: it needs per-QP source-port steering, which stock NCCL does not have
(C4 modified its collective library). These are the planner's own figures: judge the
actions on an independent model (``benchmarks/paths.py``).

Pure: ``ts`` is passed in.

Example: two jobs striped over four pods of a 4-spine fabric, one uplink at half speed.

>>> from guard.schemas.topology import infer_topology
>>> nodes = [f"n{i:02d}" for i in range(16)]
>>> fabric = infer_topology(nodes, rails=8, nodes_per_leaf=4, spines=4)
>>> fabric = fabric.with_capacity({"pod0-rail0->spine0": 0.5})
>>> jobs = [JobPattern("a", tuple(nodes[0::2]), 1e9), JobPattern("b", tuple(nodes[1::2]), 1e9)]
>>> advice = advise(fabric, jobs, ts=1_700_000_000.0)
>>> [(a.job, a.flows) for a in advice]
[('a', 64), ('b', 64)]
>>> all(a.planned_allreduce_s <= a.ecmp_allreduce_s for a in advice)
True
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from guard.schemas import (
    ADVICE_MAX_PLAN,
    Advice,
    AdviceAction,
    CollectiveTiming,
    GuardMessage,
    PathAssignment,
    StepTiming,
    stable_id,
)
from guard.schemas.messages import AdviceActionName
from guard.schemas.topology import Topology

from .paths import Fabric, Flow, Route, ecmp_routes, evaluate_routes, plan_routes
from .paths import ring_allreduce_flows as _ring

__all__ = ["JobPattern", "JobPatterns", "advise", "leaf_ring_order"]

#: An action is advised when the model says it saves at least this share of all-reduce time.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class JobPattern:
    """A job's collective pattern: a ring all-reduce of ``message_bytes`` over its nodes."""

    job: str
    nodes: tuple[str, ...]
    message_bytes: float
    qps_per_connection: int = 1

    def flows(self, rails: int, qps: int | None = None) -> list[Flow]:
        return _ring(
            self.job, self.nodes, rails, self.message_bytes, qps or self.qps_per_connection
        )


class JobPatterns:
    """Each job's nodes, ring order, all-reduce size and slow connections, from its messages.

    The nodes are those seen reporting for the job (step and collective messages). The ring
    order comes from the collectives' per-connection ``peers``: each rank's peers are its
    ring neighbours, so the inter-node ring is walked from the smallest node name along the
    neighbour links (name order when the links do not make one ring). The message size is
    the largest all-reduce seen (``default_bytes`` until one is). Per inter-node connection
    (a pair of nodes) an exponential average (``alpha``) of the all-reduce transfer time; a
    connection ``slow_ratio`` times the job's median connection (with at least three
    connections to compare) is *slow*: what the fabric does to the job today, which the
    advice reports beside the model. State: per job its nodes, rank → node, neighbour links
    and one number per connection.

    >>> from guard.schemas import CollectiveTiming, ConnectionStat, StepTiming
    >>> seen = JobPatterns(default_bytes=1e9)
    >>> for rank, node in enumerate(["b", "a", "b"]):
    ...     seen.update(StepTiming(ts=1.0, node=node, job="j", rank=rank, step=1, step_s=2.0))
    >>> seen.patterns()
    [JobPattern(job='j', nodes=('a', 'b'), message_bytes=1000000000.0, qps_per_connection=1)]
    >>> ring = ["n0", "n2", "n1", "n3"]  # rank r on ring[r]; the ring is not in name order
    >>> for r, node in enumerate(ring):
    ...     peers = [ConnectionStat(rank=(r + 1) % 4, bytes=1e8, duration_s=0.1 if r else 0.4),
    ...              ConnectionStat(rank=(r - 1) % 4, bytes=1e8, duration_s=0.1 if r != 1 else 0.4)]
    ...     seen.update(CollectiveTiming(ts=2.0, node=node, job="k", rank=r, comm="c",
    ...         op="allreduce", seq=0, bytes=2e8, arrive_ts=1.9, end_ts=2.0, peers=peers))
    >>> seen.patterns()[1].nodes, seen.slow_connections("k")
    (('n0', 'n2', 'n1', 'n3'), {('n0', 'n2'): 4.0})
    """

    def __init__(
        self, default_bytes: float = 256e6, alpha: float = 0.2, slow_ratio: float = 1.5
    ) -> None:
        self.default_bytes = default_bytes
        self.alpha, self.slow_ratio = alpha, slow_ratio
        self._nodes: dict[str, set[str]] = {}
        self._bytes: dict[str, float] = {}
        self._rank_node: dict[str, dict[int, str]] = {}
        self._links: dict[str, set[tuple[int, int]]] = {}
        self._conn_s: dict[str, dict[tuple[str, str], float]] = {}
        self.last_ts: dict[str, float] = {}

    def update(self, message: GuardMessage) -> None:
        if not isinstance(message, (StepTiming, CollectiveTiming)):
            return
        job = message.job
        self._nodes.setdefault(job, set()).add(message.node)
        self._rank_node.setdefault(job, {})[message.rank] = message.node
        self.last_ts[job] = max(self.last_ts.get(job, 0.0), message.ts)
        if isinstance(message, CollectiveTiming) and message.op == "allreduce":
            self._bytes[job] = max(self._bytes.get(job, 0.0), message.bytes)
            self._connections(job, message)

    def _connections(self, job: str, message: CollectiveTiming) -> None:
        links = self._links.setdefault(job, set())
        ranks = self._rank_node[job]
        conn = self._conn_s.setdefault(job, {})
        for peer in message.peers or ():
            links.add((min(message.rank, peer.rank), max(message.rank, peer.rank)))
            other = ranks.get(peer.rank)
            if other is None or other == message.node:
                continue
            pair = (min(message.node, other), max(message.node, other))
            was = conn.get(pair)
            conn[pair] = (
                peer.duration_s if was is None else was + self.alpha * (peer.duration_s - was)
            )

    def forget(self, job: str) -> None:
        """A finished job."""
        for table in (self._nodes, self._bytes, self._rank_node, self._links, self._conn_s):
            table.pop(job, None)
        self.last_ts.pop(job, None)

    def jobs(self) -> list[str]:
        return sorted(self._nodes)

    def ring(self, job: str) -> tuple[str, ...]:
        """The job's nodes in ring order (name order when the peers do not make one ring)."""
        nodes = sorted(self._nodes.get(job, ()))
        ranks = self._rank_node.get(job, {})
        near: dict[str, set[str]] = {}
        for a, b in self._links.get(job, ()):
            na, nb = ranks.get(a), ranks.get(b)
            if na is not None and nb is not None and na != nb:
                near.setdefault(na, set()).add(nb)
                near.setdefault(nb, set()).add(na)
        if len(nodes) < 3 or any(len(near.get(n, ())) != 2 for n in nodes):
            return tuple(nodes)
        order = [nodes[0]]
        while len(order) < len(nodes):
            options = sorted(near[order[-1]] - set(order))
            if not options:
                return tuple(nodes)  # several rings, or not one at all
            order.append(options[0])
        return tuple(order)

    def slow_connections(self, job: str) -> dict[tuple[str, str], float]:
        """Inter-node connections ``slow_ratio`` times the job's median, with that ratio."""
        conn = self._conn_s.get(job, {})
        if len(conn) < 3:
            return {}
        typical = sorted(conn.values())[len(conn) // 2]
        if typical <= 0:
            return {}
        return {
            pair: round(s / typical, 2)
            for pair, s in sorted(conn.items())
            if s >= self.slow_ratio * typical
        }

    def patterns(self) -> list[JobPattern]:
        return [
            JobPattern(job, self.ring(job), self._bytes.get(job, self.default_bytes))
            for job in self.jobs()
        ]


def leaf_ring_order(topology: Topology, nodes: Sequence[str]) -> tuple[str, ...]:
    """A host order for the next restart that keeps ring neighbours under the same leaves.

    Nodes whose NICs plug into the same leaves (one pod of a rail-optimised fabric) are
    consecutive, pods in leaf order, nodes by name within a pod. NCCL builds its inter-node
    rings in rank order, so each rail's ring then crosses the spines once per pod it spans
    (one flow out of and one into each pod per rail) instead of at almost every hop when
    ranks are in an order that ignores the pods — fewer flows for ECMP to collide. Applies
    to any leaf-spine fabric (RoCE with ECMP, InfiniBand with or without adaptive routing,
    rail-optimised or not).

    >>> from guard.schemas.topology import infer_topology
    >>> topo = infer_topology(["a", "b", "c", "d"], rails=1, nodes_per_leaf=2, spines=2)
    >>> leaf_ring_order(topo, ["d", "a", "c", "b"])  # a, b on pod0; c, d on pod1
    ('a', 'b', 'c', 'd')
    """

    def leaves(name: str) -> tuple[str, ...]:
        return tuple(nic.leaf for nic in sorted(topology.node(name).nics, key=lambda n: n.rail))

    return tuple(sorted(nodes, key=lambda n: (leaves(n), n)))


def cross_leaf_connections(topology: Topology, ring: Sequence[str]) -> int:
    """Ring connections (rail 0) whose two ends are under different leaves.

    >>> from guard.schemas.topology import infer_topology
    >>> topo = infer_topology(["a", "b", "c", "d"], rails=1, nodes_per_leaf=2, spines=2)
    >>> cross_leaf_connections(topo, ["a", "c", "b", "d"]), cross_leaf_connections(topo, "abcd")
    (4, 2)
    """
    n = len(ring)
    if n < 2:
        return 0
    rail = min(nic.rail for nic in topology.node(ring[0]).nics)
    return sum(
        topology.leaf_of(ring[k], rail) != topology.leaf_of(ring[(k + 1) % n], rail)
        for k in range(n)
    )


def _all_flows(jobs: Sequence[JobPattern], rails: int, qps: int | None = None) -> list[Flow]:
    return [flow for job in jobs for flow in job.flows(rails, qps)]


def _ecmp_times(fabric: Fabric, flows: list[Flow]) -> dict[str, float]:
    return evaluate_routes(fabric, flows, ecmp_routes(fabric, flows)).allreduce_s


#: how each action is applied and on which fabrics it helps (in each action's ``why``)
APPLY: dict[AdviceActionName, str] = {
    "nccl_env": "apply: next restart, in the job's environment (NCCL reads it when a "
    "communicator is created); fabrics: RoCE or InfiniBand hashing by ECMP (little to gain "
    "with adaptive routing, which already spreads packets)",
    "place_ranks": "apply: next restart, ranks in this host order (Slurm: SLURM_HOSTFILE with "
    "srun --distribution=arbitrary; torchrun/mpirun: node ranks in this order); fabrics: "
    "any leaf-spine (RoCE with ECMP, InfiniBand with adaptive routing, rail-optimised)",
    "drain_uplink": "apply: now, on the switch (shut the port or raise its routing cost; ECMP "
    "re-hashes at once; InfiniBand: disable the port in the subnet manager); fabrics: RoCE "
    "with ECMP (adaptive routing already avoids a slow link)",
    "inspect_leaf": "apply: now, the leaf's uplink port counters (utilisation, ECN marks, "
    "discards) to find the slow or overloaded uplink; fabrics: any",
    "drain_rail": "apply: next restart, in this node's environment (NCCL then carries that "
    "rail's traffic through another NIC); fabrics: rail-optimised",
    "route_flow": "apply: per-QP source-port steering, which needs a modified collective "
    "library (C4 modified Alibaba's ACCL): stock NCCL cannot; fabrics: RoCE with ECMP",
}
#: queue pairs per connection tried for ``nccl_env``, fewest first
SPLIT_OPTIONS = (2, 4)
#: the longest host order written out in a ``place_ranks`` value
MAX_HOSTFILE = 4000


def advise(
    topology: Topology,
    jobs: Sequence[JobPattern],
    ts: float,
    hot_leaves: Collection[str] = (),
    steering: bool = False,
) -> list[Advice]:
    """One advice message per job with inter-node traffic.

    The plan and its modelled gain are the planner's (min-max over the bottleneck model of
    :mod:`.paths`); the actions are what a stock stack can apply, each kept when the same
    model says it saves at least ``MIN_GAIN`` of the job's all-reduce time under ECMP:
    ``nccl_env`` (2 or 4 QPs per connection), ``place_ranks`` (a host order keeping ring
    neighbours under one leaf), ``drain_uplink`` (a degraded uplink on a leaf the hot-spot
    detector saw hot: ``hot_leaves``; never from the topology file alone), ``inspect_leaf``
    (a hot leaf of the job with no uplink known to be degraded), ``drain_rail`` (a slower
    NIC, NCCL_IB_HCA). ``route_flow`` (apply the plan by per-QP steering) only with
    ``steering``: stock NCCL cannot steer queue pairs.
    """
    fabric = Fabric(topology)
    rails = topology.rails
    hot = set(hot_leaves)
    flows = _all_flows(jobs, rails)
    ecmp = ecmp_routes(fabric, flows)
    planned = plan_routes(fabric, flows)
    ecmp_report = evaluate_routes(fabric, flows, ecmp)
    planned_s = evaluate_routes(fabric, flows, planned).allreduce_s
    split_s = {q: _ecmp_times(fabric, _all_flows(jobs, rails, q)) for q in SPLIT_OPTIONS}
    placed = [replace(job, nodes=leaf_ring_order(topology, job.nodes)) for job in jobs]
    placed_s = _ecmp_times(fabric, _all_flows(placed, rails))
    drainable = [u.name for u in topology.uplinks if 0 < u.capacity_factor < 1 and u.leaf in hot]
    drained_s = (
        _ecmp_times(Fabric(topology.with_capacity(dict.fromkeys(drainable, 0.0))), flows)
        if drainable
        else {}
    )
    out = []
    for job, moved_to in zip(jobs, placed, strict=True):
        mine = [i for i, f in enumerate(flows) if f.job == job.job]
        if not mine:
            continue
        before, after = ecmp_report.allreduce_s[job.job], planned_s[job.job]
        busy = ecmp_report.link_busy_s
        used = sorted({link for i in mine for link in ecmp[i].links}, key=lambda k: -busy[k])
        hot_links = [fabric.link_names[k] for k in used[:8] if busy[k] >= 0.9 * before]
        leaves = {nic.leaf for name in job.nodes for nic in topology.node(name).nics}
        seen = sorted(hot & leaves)
        hot_links += [f"detected hot {leaf}" for leaf in seen[:8]]
        actions = [
            *_nccl_env(job, before, split_s),
            *_placement(topology, job, moved_to, before, placed_s),
            *_hot_leaves(topology, job, seen, before, drained_s, drainable),
            *_slow_rails(topology, job),
        ]
        if steering and after < before * (1 - MIN_GAIN):
            actions.insert(0, _action("route_flow", job.job, "apply the plan", before, after))
        moved = [i for i in mine if planned[i].spine != ecmp[i].spine]
        plan = [_assignment(flows[i], planned[i], ecmp[i]) for i in moved[:ADVICE_MAX_PLAN]]
        out.append(
            Advice(
                ts=ts,
                job=job.job,
                id=stable_id("c4p", job.job, topology.name, *(p.spine for p in plan)),
                topology=topology.name,
                flows=len(mine),
                moved_flows=len(moved),
                ecmp_allreduce_s=before,
                planned_allreduce_s=after,
                expected_gain_pct=round(100 * (before / after - 1), 2) if after > 0 else 0.0,
                hot_links=hot_links,
                plan=plan,
                actions=actions,
            )
        )
    return out


def _action(
    name: AdviceActionName, target: str, value: str, before: float, after: float
) -> AdviceAction:
    why = f"modelled all-reduce {before:.4g} s under ECMP, {after:.4g} s with it; {APPLY[name]}"
    return AdviceAction(action=name, target=target, value=value, why=why)


def _nccl_env(
    job: JobPattern, before: float, split_s: dict[int, dict[str, float]]
) -> list[AdviceAction]:
    options = [q for q in SPLIT_OPTIONS if q > job.qps_per_connection]
    good = [q for q in options if split_s[q].get(job.job, before) < before * (1 - MIN_GAIN)]
    if not good:
        return []
    best = min(split_s[q][job.job] for q in good)
    q = next(q for q in good if split_s[q][job.job] <= best * (1 + MIN_GAIN))  # fewest QPs
    value = f"NCCL_IB_QPS_PER_CONNECTION={q} NCCL_IB_SPLIT_DATA_ON_QPS=1"
    return [_action("nccl_env", job.job, value, before, split_s[q][job.job])]


def _placement(
    topology: Topology,
    job: JobPattern,
    moved_to: JobPattern,
    before: float,
    placed_s: dict[str, float],
) -> list[AdviceAction]:
    now = cross_leaf_connections(topology, job.nodes)
    then = cross_leaf_connections(topology, moved_to.nodes)
    after = placed_s.get(job.job, before)
    if then >= now or after >= before * (1 - MIN_GAIN):
        return []
    order = ",".join(moved_to.nodes)
    if len(order) > MAX_HOSTFILE:
        order = "hosts sorted by their leaves, then by name (guard.planning.leaf_ring_order)"
    action = _action("place_ranks", job.job, order, before, after)
    action.why = f"{now} -> {then} ring connections across leaves per rail; {action.why}"
    return [action]


def _hot_leaves(
    topology: Topology,
    job: JobPattern,
    seen: list[str],
    before: float,
    drained_s: dict[str, float],
    drainable: list[str],
) -> list[AdviceAction]:
    actions = []
    drained = drained_s.get(job.job, before)
    for leaf in seen:
        slow = [name for name in drainable if name.startswith(f"{leaf}->")]
        if slow and drained < before * (1 - MIN_GAIN):
            for name in slow:
                action = _action("drain_uplink", name, "drain", before, drained)
                action.why = f"the hot-spot detector saw {leaf} hot; degraded; {action.why}"
                actions.append(action)
        elif not slow:
            actions.append(
                AdviceAction(
                    action="inspect_leaf",
                    target=leaf,
                    value=f"uplinks of {leaf}",
                    why=f"the hot-spot detector saw {leaf} hot and no uplink of it is known "
                    f"to be degraded; {APPLY['inspect_leaf']}",
                )
            )
    return actions


def _assignment(flow: Flow, planned: Route, ecmp: Route) -> PathAssignment:
    return PathAssignment(
        src=flow.src,
        dst=flow.dst,
        rail=flow.rail,
        qp=flow.qp,
        spine=planned.spine,
        ecmp_spine=ecmp.spine,
    )


def _slow_rails(topology: Topology, job: JobPattern) -> list[AdviceAction]:
    fastest: dict[int, float] = {}
    for node in topology.nodes:
        for nic in node.nics:
            fastest[nic.rail] = max(fastest.get(nic.rail, 0.0), nic.gbps)
    actions = []
    for name in job.nodes:
        node = topology.node(name)
        slow = [nic for nic in node.nics if nic.gbps < fastest[nic.rail]]
        if slow:
            keep = ",".join(
                n.device for n in sorted(node.nics, key=lambda n: n.rail) if n not in slow
            )
            actions.append(
                AdviceAction(
                    action="drain_rail",
                    target=f"{name}/{slow[0].device}",
                    value=f"NCCL_IB_HCA={keep}",
                    why=f"{slow[0].gbps:g} Gb/s against {fastest[slow[0].rail]:g} on its rail; "
                    "gates every ring through it (not in the modelled gain); "
                    + APPLY["drain_rail"],
                )
            )
    return actions

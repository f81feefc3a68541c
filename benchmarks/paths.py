"""Guard's C4P advice judged on an independent fabric model: ECMP with 1/2/4 QPs, the planner,
rank placement, both — all-reduce time, step time and throughput.

The judge is :mod:`guard.agents.simulator.flow_fabric`: per-QP ECMP on the real 5-tuple (the
RoCE v2 source port as the Linux RDMA core derives it from the QP numbers, a per-switch
seeded CRC32 at the source leaf), max-min fair rates per QP (progressive filling), rings
synchronous, jobs stepping in time (compute, then their all-reduce; random phases, so
all-reduces overlap only when they fall together). It shares nothing with the planner's
cost function (:mod:`guard.planning.paths`' busy seconds), which is only used to *make* the
``planner`` routes, never to judge them.

Cluster: ``--gpus`` GPUs, 8 per node, 8 rails, ``--nodes-per-leaf`` nodes to a pod, one
uplink from every leaf to each of ``--spines`` spines (non-blocking). Jobs of
``--job-nodes`` nodes on random free nodes (a fragmented cluster); ranks in the order the
scheduler gives them (``--ring-order random``: no topology awareness, as a Kubernetes
job or torchrun without a hostfile; ``name``: sorted host names). Each step is compute, then a
ring all-reduce of ``--message-mb`` MB per rank taking ``--comm-share`` of the ideal step
at NIC speed. Routings of the same jobs (same QP numbers, same seeds):

* ``ecmp q1 / q2 / q4`` — stock NCCL, ``NCCL_IB_QPS_PER_CONNECTION=1/2/4`` with
  ``NCCL_IB_SPLIT_DATA_ON_QPS=1`` (q1 is NCCL's default);
* ``placement q1 / q4`` — the ranks re-ordered by :func:`guard.planning.leaf_ring_order`
  (a hostfile for the next restart), then ECMP;
* ``planner`` — every QP pinned to the spine :func:`guard.planning.paths.plan_routes` gives
  (source-port steering: needs a modified collective library, as C4 modified ACCL);
* ``placement + planner`` — both;
* ``adaptive`` — per-packet adaptive routing's fluid limit (InfiniBand AR, Spectrum-X), q1;
* ``drain q1 / q4`` (degraded fabric only) — the degraded uplinks drained, then ECMP (the
  advice's ``drain_uplink``, once the hot-spot detector saw their leaves hot).

Figures, medians over ``--seeds`` placements (each the mean over jobs): all-reduce time and
step time over their ideal (NIC-bound), and aggregate steps/s over ``ecmp q1``'s.
``--degraded F``: a fraction F of the uplinks at half capacity (the planner sees it; ECMP
keeps hashing them an equal share). The calibration lines first: the hash against the
balls-into-bins expectation, and the QP-scaling gain against Meta's published figure.

Usage::

    nice -n 10 .venv/bin/python benchmarks/paths.py [--seeds 5] [--steps 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
from math import factorial

import numpy as np

from guard.agents.simulator.flow_fabric import (
    FlowFabric,
    StepJob,
    rdma_udp_sport,
    simulate_steps,
)
from guard.planning import leaf_ring_order
from guard.planning.paths import Fabric, plan_routes, ring_allreduce_flows
from guard.schemas.topology import Topology, infer_topology

RAILS = 8
NIC_BYTES_S = 400e9 / 8


def cluster(gpus: int, nodes_per_leaf: int, spines: int) -> Topology:
    names = [f"node-{i:05d}" for i in range(gpus // RAILS)]
    return infer_topology(names, rails=RAILS, nodes_per_leaf=nodes_per_leaf, spines=spines)


def place(topo: Topology, jobs: int, job_nodes: int, order: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    free = [n.name for n in topo.nodes]
    rng.shuffle(free)
    if jobs * job_nodes > len(free):
        raise SystemExit(f"{jobs} jobs of {job_nodes} nodes do not fit in {len(free)} nodes")
    out = []
    for j in range(jobs):
        nodes = free[j * job_nodes : (j + 1) * job_nodes]
        out.append(sorted(nodes) if order == "name" else nodes)
    return out


def planner_steering(topo: Topology, rings: list[list[str]], message: float, channels: int) -> dict:
    """The planner's spine per QP (1 QP per connection and channel), as a steering table.

    The planner sees each channel's connection as one more queue pair of the connection
    (``qp`` = channel), the order the model numbers them in.
    """
    flows = [
        f
        for j, ring in enumerate(rings)
        for f in ring_allreduce_flows(f"job-{j}", ring, RAILS, message, channels)
    ]
    routes = plan_routes(Fabric(topo), flows)
    return {
        (f.job, f.src, f.dst, f.rail, f.qp): r.spine for f, r in zip(flows, routes, strict=True)
    }


Variant = tuple[str, int, bool, bool, str]  # name, qps, placement, planner, routing
#: drain the degraded uplinks (what the advice says once the hot-spot detector saw them)
DRAINED: list[Variant] = [
    ("drain q1", 1, False, False, "ecmp"),
    ("drain q4", 4, False, False, "ecmp"),
]
VARIANTS: list[Variant] = [
    ("ecmp q1", 1, False, False, "ecmp"),
    ("ecmp q2", 2, False, False, "ecmp"),
    ("ecmp q4", 4, False, False, "ecmp"),
    ("placement q1", 1, True, False, "ecmp"),
    ("placement q4", 4, True, False, "ecmp"),
    ("planner", 1, False, True, "ecmp"),
    ("placement + planner", 1, True, True, "ecmp"),
    ("adaptive", 1, False, False, "adaptive"),
]


def run_level(args: argparse.Namespace, topo: Topology, jobs: int) -> dict[str, dict[str, float]]:
    message = args.message_mb * 1e6
    n = args.job_nodes
    ideal_ar = 2 * (n - 1) / n * message / RAILS / NIC_BYTES_S
    compute = ideal_ar * (1 - args.comm_share) / args.comm_share
    fabrics = {r: FlowFabric(topo, routing=r) for r in ("ecmp", "adaptive")}
    degraded = {u.name: 0.0 for u in topo.uplinks if 0 < u.capacity_factor < 1}
    variants = VARIANTS + (DRAINED if degraded else [])
    if degraded:
        fabrics["drained"] = FlowFabric(topo.with_capacity(degraded))
    per: dict[str, dict[str, list[float]]] = {
        v[0]: {"ar": [], "step": [], "rate": []} for v in variants
    }
    for seed in range(args.seeds):
        rings = place(topo, jobs, n, args.ring_order, seed)
        placed = [list(leaf_ring_order(topo, r)) for r in rings]
        for name, qps, placement, planner, routing in variants:
            use = placed if placement else rings
            steer = planner_steering(topo, use, message, args.channels) if planner else None
            specs = [
                StepJob(f"job-{j}", tuple(r), message, compute, qps, args.channels)
                for j, r in enumerate(use)
            ]
            runs = simulate_steps(
                fabrics["drained" if name.startswith("drain") else routing],
                specs,
                args.steps,
                np.random.default_rng(seed),
                steer,
                phase=args.phase,
            )
            per[name]["ar"].append(
                statistics.fmean(statistics.fmean(r.allreduce_s) for r in runs.values()) / ideal_ar
            )
            per[name]["step"].append(
                statistics.fmean(statistics.fmean(r.step_s) for r in runs.values())
                / (compute + ideal_ar)
            )
            per[name]["rate"].append(sum(1 / statistics.fmean(r.step_s) for r in runs.values()))
    base = per["ecmp q1"]["rate"]
    return {
        name: {
            "ar": statistics.median(v["ar"]),
            "step": statistics.median(v["step"]),
            "gain": statistics.median(r / b - 1 for r, b in zip(v["rate"], base, strict=True)),
        }
        for name, v in per.items()
    }


def print_table(args: argparse.Namespace, topo: Topology, title: str) -> None:
    print(f"\n{title}")
    print(
        "| jobs | GPUs busy | routing | all-reduce / ideal | step / ideal | throughput vs ecmp q1 |"
    )
    print("|---|---|---|---|---|---|")
    max_jobs = len(topo.nodes) // args.job_nodes
    for jobs in sorted({2, max_jobs // 2, max_jobs} - {0}):
        for name, r in run_level(args, topo, jobs).items():
            print(
                f"| {jobs} | {jobs * args.job_nodes * RAILS} | {name} | {r['ar']:.2f} "
                f"| {r['step']:.3f} | {100 * r['gain']:+.1f} % |"
            )


def expected_max_load(balls: int, bins: int) -> float:
    """E[max bin load] of ``balls`` thrown uniformly into ``bins``, exactly.

    P(max <= k) = balls! / bins^balls * [x^balls] (sum_{j<=k} x^j / j!)^bins.
    """

    def at_most(k: int) -> float:
        poly = [1.0]
        term = [1 / factorial(j) for j in range(k + 1)]
        for _ in range(bins):
            nxt = [0.0] * min(len(poly) + k, balls + 1)
            for i, a in enumerate(poly):
                for j, b in enumerate(term):
                    if i + j <= balls:
                        nxt[i + j] += a * b
            poly = nxt
        coeff = poly[balls] if len(poly) > balls else 0.0
        return coeff * factorial(balls) / bins**balls

    return sum(1 - at_most(k) for k in range(balls))


def hash_max_load(topo: Topology, flows: int, trials: int) -> float:
    """Mean busiest uplink of one leaf whose ``flows`` QPs all leave it, under the model's ECMP."""
    fabric = FlowFabric(topo)
    leaf = topo.leaf_of(topo.nodes[0].name, 0)
    here = [n.name for n in topo.nodes if topo.leaf_of(n.name, 0) == leaf][:flows]
    there = [n.name for n in topo.nodes if topo.leaf_of(n.name, 0) != leaf]
    rng = np.random.default_rng(0)
    worst = []
    for _ in range(trials):
        counts: dict[str | None, int] = {}
        for src in here:
            dst = there[int(rng.integers(len(there)))]
            lq, rq = (int(x) for x in rng.integers(0, 1 << 23, size=2))
            spine = fabric.spine_of(src, dst, 0, rdma_udp_sport(lq, rq))
            counts[spine] = counts.get(spine, 0) + 1
        worst.append(max(counts.values()))
    return statistics.fmean(worst)


def calibrate(args: argparse.Namespace, topo: Topology) -> None:
    print("\ncalibration")
    print("| check | model | published / exact |")
    print("|---|---|---|")
    per_leaf = args.nodes_per_leaf
    model = hash_max_load(topo, per_leaf, 2000)
    exact = expected_max_load(per_leaf, args.spines)
    print(
        f"| busiest of {args.spines} uplinks, {per_leaf} QPs leaving one leaf (ECMP, 2000 draws)"
        f" | {model:.2f} | {exact:.2f} (balls into bins, exact) |"
    )
    level = run_level(args, topo, len(topo.nodes) // args.job_nodes)
    gain = level["ecmp q1"]["ar"] / level["ecmp q4"]["ar"] - 1
    print(
        f"| all-reduce speed-up, q4 over q1, cluster full ({args.ring_order} rank order) "
        f"| {100 * gain:+.0f} % | up to +40 % (Meta, SIGCOMM 2024: E-ECMP + QP scaling) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--nodes-per-leaf", type=int, default=16)
    parser.add_argument("--spines", type=int, default=16)
    parser.add_argument("--job-nodes", type=int, default=16)
    parser.add_argument("--message-mb", type=float, default=256.0)
    parser.add_argument("--comm-share", type=float, default=0.3)
    parser.add_argument("--channels", type=int, default=1, help="NCCL channels (rings) per NIC")
    parser.add_argument("--ring-order", choices=("random", "name"), default="random")
    parser.add_argument("--phase", choices=("random", "aligned"), default="random")
    parser.add_argument("--degraded", type=float, default=0.125)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-calibration", action="store_true")
    args = parser.parse_args()
    topo = cluster(args.gpus, args.nodes_per_leaf, args.spines)
    print(
        f"independent model (agents/simulator/flow_fabric.py): {args.gpus} GPUs, "
        f"{len(topo.nodes)} nodes x {RAILS} rails, {args.nodes_per_leaf} nodes per leaf, "
        f"{args.spines} spines; {args.channels} channel(s) per NIC; jobs of {args.job_nodes} "
        "nodes on random free nodes, ranks in "
        f"{args.ring_order} order; {args.message_mb:g} MB all-reduce, {args.comm_share:.0%} of "
        f"the ideal step; {args.phase} phases; {args.steps} steps; medians of {args.seeds} seeds"
    )
    if not args.skip_calibration:
        calibrate(args, topo)
    print_table(args, topo, "healthy fabric")
    if args.degraded > 0:
        picked = random.Random(1).sample(
            [u.name for u in topo.uplinks], int(args.degraded * len(topo.uplinks))
        )
        print_table(
            args,
            topo.with_capacity(dict.fromkeys(picked, 0.5)),
            f"{len(picked)} of {len(topo.uplinks)} uplinks at half capacity",
        )


if __name__ == "__main__":
    main()

"""Planned paths against ECMP hashing: all-reduce time and job throughput by load level (C4P).

A rail-optimised, non-blocking two-tier fat-tree (``--gpus`` GPUs, 8 per node, 8 rails,
``--nodes-per-leaf`` nodes to a pod, one uplink from each leaf to each of ``--spines``
spines). Jobs of ``--job-nodes`` nodes are placed on random free nodes (a fragmented
scheduler); each runs ring all-reduces of ``--message-mb`` MB per rank, all at once (the
worst case: their collectives overlap). The load level is the number of concurrent jobs.
For each level and each of ``--seeds`` placements, three routings of the same flows:

* ``ecmp`` — a deterministic hash of each flow's 5-tuple (RoCE v2 source port from the QP),
  ``--base-qps`` queue pairs per connection (default 1, NCCL's default);
* ``ecmp x4`` — the same with ``NCCL_IB_QPS_PER_CONNECTION=4`` + ``NCCL_IB_SPLIT_DATA_ON_QPS=1``
  (what an operator can set today);
* ``planned`` — :func:`guard.planning.paths.plan_routes` (min-max link load).

Figures (medians over placements; the bottleneck model of ``planning/paths.py``):

* ``max link`` — the busiest link's busy time over the NIC-bound ideal (1.00 = no link
  slower than a NIC);
* ``all-reduce`` — mean over jobs of the job's all-reduce time over the ideal;
* ``throughput`` — job steps per second relative to ECMP, for a step that spends
  ``--comm-share`` of its ideal time in (non-overlapped) all-reduce.

``--degraded F`` re-runs every level with a fraction F of the uplinks at half capacity
(still hashed an equal share by ECMP). Last, the planner's run time at 1k and 10k GPUs with
the cluster full (median of ``--runs``, CPU seconds).

**Judged on the simulator** (``--sim-seeds`` runs per level, 0: skip): the same cluster in
:mod:`guard.agents.simulator` with its multi-path fabric (``agents/simulator/fabric.py``):
jobs of ``--job-nodes`` nodes on random free nodes, each training with its own step phase,
the switches hashing every queue pair (their own CRC32, not the one the planner assumes),
another job's flows counted for the share of time that job spends in its all-reduce
(``--sim-overlap``, default the simulator's ~0.26; 1.0: every all-reduce at once).
``planned`` steers every queue pair onto the spine
:func:`~guard.planning.paths.steering_plan` gives. Figures, medians over runs:

* ``all-reduce`` — median over the job's all-reduces (last rank in → last rank out, from
  the collective messages of the last ``--sim-window`` s) over the nominal 0.5 s;
* ``throughput`` — steps per second of the whole run, planned over ECMP, mean over jobs.

Usage::

    nice -n 10 .venv/bin/python benchmarks/paths.py [--seeds 5] [--runs 3] [--sim-seeds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from guard.agents.simulator import ClusterSimulator, FabricSpec, JobSpec, SimConfig
from guard.planning.paths import (
    Fabric,
    Flow,
    ecmp_routes,
    evaluate_routes,
    plan_routes,
    ring_allreduce_flows,
    steering_plan,
)
from guard.schemas import CollectiveTiming
from guard.schemas.topology import Topology, infer_topology

RAILS = 8


def cluster(gpus: int, nodes_per_leaf: int, spines: int) -> Topology:
    names = [f"node-{i:05d}" for i in range(gpus // RAILS)]
    return infer_topology(names, rails=RAILS, nodes_per_leaf=nodes_per_leaf, spines=spines)


def place_jobs(topo: Topology, jobs: int, job_nodes: int, rng: random.Random) -> list[list[str]]:
    free = [n.name for n in topo.nodes]
    rng.shuffle(free)
    if jobs * job_nodes > len(free):
        raise SystemExit(f"{jobs} jobs of {job_nodes} nodes do not fit in {len(free)} nodes")
    # ring in node-name order: neighbours in a pod stay on their leaf, as NCCL's rings do
    return [sorted(free[j * job_nodes : (j + 1) * job_nodes]) for j in range(jobs)]


def flows_of(placement: list[list[str]], message_bytes: float, qps: int) -> list[Flow]:
    return [
        flow
        for j, nodes in enumerate(placement)
        for flow in ring_allreduce_flows(f"job-{j}", nodes, RAILS, message_bytes, qps)
    ]


def judge(fabric: Fabric, flows: list[Flow], routes: list, ideal_s: float) -> tuple[float, float]:
    report = evaluate_routes(fabric, flows, routes)
    mean_ar = statistics.fmean(report.allreduce_s.values())
    return report.max_link_s / ideal_s, mean_ar / ideal_s


def level(args: argparse.Namespace, topo: Topology, jobs: int) -> dict[str, list[float]]:
    fabric = Fabric(topo)
    message = args.message_mb * 1e6
    n = args.job_nodes
    ideal_s = 2 * (n - 1) / n * message / RAILS / (400e9 / 8)
    out: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        placement = place_jobs(topo, jobs, n, random.Random(seed))
        one = flows_of(placement, message, args.base_qps)
        four = flows_of(placement, message, 4)
        results = {
            "ecmp": judge(fabric, one, ecmp_routes(fabric, one), ideal_s),
            "ecmp x4": judge(fabric, four, ecmp_routes(fabric, four), ideal_s),
            "planned": judge(fabric, one, plan_routes(fabric, one), ideal_s),
        }
        for name, (max_link, allreduce) in results.items():
            out.setdefault(f"{name} max", []).append(max_link)
            out.setdefault(f"{name} ar", []).append(allreduce)
    return out


def throughput(allreduce_rel: float, ecmp_rel: float, comm_share: float) -> float:
    """Steps/s relative to ECMP; the ideal step is 1 with ``comm_share`` of it all-reduce."""
    compute = 1 - comm_share
    return (compute + comm_share * ecmp_rel) / (compute + comm_share * allreduce_rel)


def print_levels(args: argparse.Namespace, topo: Topology, title: str) -> None:
    print(f"\n{title}")
    print(
        "| jobs | GPUs busy | max link: ecmp / x4 / planned | all-reduce: ecmp / x4 / planned"
        f" | throughput vs ecmp (comm {args.comm_share:.0%}): x4 / planned |"
    )
    print("|---|---|---|---|---|")
    max_jobs = len(topo.nodes) // args.job_nodes
    for jobs in sorted({1, 2, max_jobs // 4, max_jobs // 2, max_jobs} - {0}):
        r = {k: statistics.median(v) for k, v in level(args, topo, jobs).items()}
        t4 = throughput(r["ecmp x4 ar"], r["ecmp ar"], args.comm_share)
        tp = throughput(r["planned ar"], r["ecmp ar"], args.comm_share)
        print(
            f"| {jobs} | {jobs * args.job_nodes * RAILS} "
            f"| {r['ecmp max']:.2f} / {r['ecmp x4 max']:.2f} / {r['planned max']:.2f} "
            f"| {r['ecmp ar']:.2f} / {r['ecmp x4 ar']:.2f} / {r['planned ar']:.2f} "
            f"| {t4:.3f} / {tp:.3f} |"
        )


def planner_time(gpus: int, nodes_per_leaf: int, spines: int, runs: int, job_nodes: int) -> None:
    topo = cluster(gpus, nodes_per_leaf, spines)
    build, plan = [], []
    placement = place_jobs(topo, len(topo.nodes) // job_nodes, job_nodes, random.Random(0))
    flows = flows_of(placement, 1e9, 1)
    for _ in range(runs):
        t0 = time.process_time()
        fabric = Fabric(topo)
        t1 = time.process_time()
        plan_routes(fabric, flows)
        t2 = time.process_time()
        build.append(t1 - t0)
        plan.append(t2 - t1)
    print(
        f"| {gpus} | {len(topo.nodes)} | {len(topo.uplinks)} | {len(flows)} "
        f"| {statistics.median(build):.3f} | {statistics.median(plan):.3f} |"
    )


SIM_CONN_S = 0.25 * 2.0  # the simulator's nominal all-reduce at a 2 s step


def simulate(args: argparse.Namespace, jobs: int, seed: int, planned: bool, degraded: int) -> dict:
    """One simulated run: each job's median all-reduce (relative) and steps per second."""
    config = SimConfig(
        nodes=args.gpus // RAILS,
        duration_s=args.sim_duration,
        seed=seed,
        confounders=False,
        random_faults=0,
        jobs=[JobSpec(f"job-{j}", args.job_nodes) for j in range(jobs)],
        fabric=FabricSpec(
            nodes_per_leaf=args.nodes_per_leaf,
            spines=args.spines,
            placement="random",
            cross_job_overlap=args.sim_overlap,
            random_degraded=degraded,
        ),
    )
    sim = ClusterSimulator(config)
    model = sim.scenario.fabric
    assert model is not None and config.fabric is not None
    if planned:
        conns = [(j.name, c) for j in sim.scenario.jobs for c, _ in model.connections(j)]
        config.fabric.routes = steering_plan(model.topology_at(sim.start_ts), conns)
        sim = ClusterSimulator(config)  # the same placement and draws, steered
    spans: dict[tuple[str, int], list[float]] = {}
    for batch in sim.batches(emit_from=sim.end_ts - args.sim_window):
        for m in batch:
            if isinstance(m, CollectiveTiming) and m.end_ts is not None:
                span = spans.setdefault((m.job, m.seq), [0.0, 0.0])
                span[0] = max(span[0], m.arrive_ts)
                span[1] = max(span[1], m.end_ts)
    allreduce: dict[str, list[float]] = {}
    for (job, _), (arrive, end) in spans.items():
        allreduce.setdefault(job, []).append((end - arrive) / SIM_CONN_S)
    rate = {}
    for j in sim.scenario.jobs:
        steps = sim.step_times(j.name)
        rate[j.name] = len(steps) / sum(step_s for _, step_s in steps)
    return {"ar": {k: statistics.median(v) for k, v in allreduce.items()}, "rate": rate}


def print_simulated(args: argparse.Namespace, degraded: int, title: str) -> None:
    print(f"\n{title}")
    print(
        "| jobs | GPUs busy | all-reduce: ecmp / planned | gain over ECMP: all-reduce / "
        "throughput |"
    )
    print("|---|---|---|---|")
    max_jobs = args.gpus // RAILS // args.job_nodes
    for jobs in sorted({1, 2, max_jobs // 4, max_jobs // 2, max_jobs} - {0}):
        ar_e, ar_p, tput = [], [], []
        for seed in range(args.sim_seeds):
            e = simulate(args, jobs, seed, False, degraded)
            p = simulate(args, jobs, seed, True, degraded)
            ar_e.append(statistics.fmean(e["ar"].values()))
            ar_p.append(statistics.fmean(p["ar"].values()))
            tput.append(statistics.fmean(p["rate"][j] / e["rate"][j] for j in e["rate"]))
        me, mp = statistics.median(ar_e), statistics.median(ar_p)
        print(
            f"| {jobs} | {jobs * args.job_nodes * RAILS} | {me:.2f} / {mp:.2f} "
            f"| {100 * (me / mp - 1):+.1f} % / {100 * (statistics.median(tput) - 1):+.1f} % |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--nodes-per-leaf", type=int, default=16)
    parser.add_argument("--spines", type=int, default=16)
    parser.add_argument("--job-nodes", type=int, default=16)
    parser.add_argument("--message-mb", type=float, default=256.0)
    parser.add_argument("--comm-share", type=float, default=0.3)
    parser.add_argument(
        "--base-qps", type=int, default=1, help="QPs per connection of ecmp and planned"
    )
    parser.add_argument("--degraded", type=float, default=0.125)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-model", action="store_true", help="only the simulator's figures")
    parser.add_argument("--sim-seeds", type=int, default=3, help="simulated runs per level")
    parser.add_argument("--sim-duration", type=float, default=180.0)
    parser.add_argument("--sim-window", type=float, default=60.0)
    parser.add_argument("--sim-overlap", type=float, default=None)
    args = parser.parse_args()
    topo = cluster(args.gpus, args.nodes_per_leaf, args.spines)
    print(
        f"fabric: {args.gpus} GPUs, {len(topo.nodes)} nodes x {RAILS} rails, "
        f"{args.nodes_per_leaf} nodes per leaf, {args.spines} spines, "
        f"jobs of {args.job_nodes} nodes, {args.message_mb:g} MB all-reduce, "
        f"{args.base_qps} QP(s) per connection (x4: 4), "
        f"medians over {args.seeds} placements; times relative to the NIC-bound ideal"
    )
    if not args.skip_model:
        print_levels(args, topo, "model: healthy fabric")
    degraded = int(args.degraded * len(topo.uplinks))
    if args.degraded > 0 and not args.skip_model:
        rng = random.Random(1)
        picked = rng.sample([u.name for u in topo.uplinks], degraded)
        print_levels(
            args,
            topo.with_capacity(dict.fromkeys(picked, 0.5)),
            f"model: {len(picked)} of {len(topo.uplinks)} uplinks at half capacity",
        )
    if args.sim_seeds > 0:
        overlap = "the simulator's" if args.sim_overlap is None else f"{args.sim_overlap:g}"
        what = f"{args.sim_seeds} runs of {args.sim_duration:g} s per level, overlap {overlap}"
        print_simulated(args, 0, f"simulator: healthy fabric ({what})")
        if degraded:
            print_simulated(
                args,
                degraded,
                f"simulator: {degraded} of {len(topo.uplinks)} uplinks at half capacity ({what})",
            )
    if not args.skip_timing:
        print("\nplanner run time, cluster full (CPU s, median of runs)")
        print("| GPUs | nodes | uplinks | flows | compile fabric s | plan s |")
        print("|---|---|---|---|---|---|")
        planner_time(1024, args.nodes_per_leaf, args.spines, args.runs, args.job_nodes)
        planner_time(10240, 32, 32, args.runs, 32)


if __name__ == "__main__":
    main()

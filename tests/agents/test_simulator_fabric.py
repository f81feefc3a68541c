"""The simulator's multi-path fabric: ECMP collisions and degraded uplinks slow connections."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import numpy as np
import pytest

from guard.agents.simulator import ClusterSimulator, FabricSpec, JobSpec, SimConfig
from guard.detectors.core import MessageFeed
from guard.planning.paths import steering_plan
from guard.schemas import CollectiveTiming, GpuSample, NicSample

NOMINAL_CONN_S = 0.25 * 2.0  # the training model's connection time at a 2 s nominal step


def _run(
    fabric: FabricSpec | None, jobs: int = 4, duration: float = 60.0, planned: bool = False
) -> ClusterSimulator:
    config = SimConfig(
        nodes=64,
        duration_s=duration,
        seed=3,
        confounders=False,
        random_faults=0,
        jobs=[JobSpec(f"j{i}", 16) for i in range(jobs)],
        fabric=fabric,
    )
    sim = ClusterSimulator(config)
    if planned and fabric is not None:  # Guard's plan, steered onto the simulated switches
        model = sim.scenario.fabric
        assert model is not None
        conns = [(j.name, c) for j in sim.scenario.jobs for c, _ in model.connections(j)]
        fabric.routes = steering_plan(model.topology_at(sim.end_ts), conns)
        sim = ClusterSimulator(config)  # the same placement, the steered routes
    return sim


def _connections(sim: ClusterSimulator) -> tuple[list[float], list[CollectiveTiming]]:
    colls = [m for m in sim.messages() if isinstance(m, CollectiveTiming)]
    return [p.duration_s for m in colls for p in m.peers or ()], colls


def test_without_a_fabric_every_connection_runs_at_its_nic_speed() -> None:
    assert SimConfig().fabric is None
    durations, _ = _connections(_run(None, jobs=2, duration=30.0))
    assert max(durations) < 1.1 * NOMINAL_CONN_S


def test_ecmp_collisions_slow_some_connections_and_the_planner_removes_them() -> None:
    spec: dict[str, Any] = {"nodes_per_leaf": 8, "spines": 8, "placement": "random"}
    sims = {"ecmp": _run(FabricSpec(**spec)), "planned": _run(FabricSpec(**spec), planned=True)}
    ecmp, colls = _connections(sims["ecmp"])
    planned, _ = _connections(sims["planned"])
    # four jobs of 16 random nodes on 8 pods: ECMP puts 2-3 flows on some uplinks; another
    # job's flow counts for the share of time that job is in its all-reduce (~0.26)
    assert max(ecmp) > 1.4 * NOMINAL_CONN_S
    assert max(planned) < 1.1 * NOMINAL_CONN_S  # a non-blocking fabric: a perfect plan exists
    # a collective is as slow as its slowest connection, so the job's all-reduce slows too
    slowest = max(colls, key=lambda m: max(p.duration_s for p in m.peers or ()))
    assert slowest.end_ts is not None
    assert slowest.end_ts - slowest.arrive_ts >= max(p.duration_s for p in slowest.peers or ())
    step = {
        routing: statistics.fmean(s for j in range(4) for _, s in sim.step_times(f"j{j}"))
        for routing, sim in sims.items()
    }
    assert step["ecmp"] > 1.05 * step["planned"]


def test_a_degraded_uplink_is_a_fabric_confounder_that_slows_ecmp_not_the_plan() -> None:
    # one job on two pods of 8 nodes: on every rail two of its ring's flows cross the spines;
    # rail 1 of pod 0 has three of its four 800 Gb/s uplinks at a tenth (80 Gb/s); ECMP
    # hashes node-007 -> node-008 on rail 1 onto spine3 (the switches' fixed CRC32)
    degraded = [("pod0-rail1", f"spine{s}", 0.1, 30.0, None) for s in (0, 2, 3)]
    spec: dict[str, Any] = {"nodes_per_leaf": 8, "spines": 4, "degraded": degraded}
    sim = _run(FabricSpec(**spec), jobs=1)
    ecmp, colls = _connections(sim)
    truth = sim.truth()
    kinds = [c for c in truth.confounders if c.kind == "degraded_uplink"]
    assert [(c.detail["spine"], c.detail["capacity_factor"]) for c in kinds] == [
        ("spine0", 0.1),
        ("spine2", 0.1),
        ("spine3", 0.1),
    ]
    assert truth.faults == []  # the fabric's fault, not a node's
    before = [p.duration_s for m in colls if m.ts < sim.start_ts + 25 for p in m.peers or ()]
    assert max(before) < 1.1 * NOMINAL_CONN_S  # healthy until the onset
    assert max(ecmp) > 4.5 * NOMINAL_CONN_S  # hashed onto an 80 Gb/s uplink: 5x
    planned, _ = _connections(_run(FabricSpec(**spec), jobs=1, planned=True))
    assert max(planned) < 1.1 * NOMINAL_CONN_S  # the plan keeps to spine1


@pytest.mark.slow
def test_hot_links_raise_nic_congestion_counters_seen_as_info_hot_spots() -> None:
    spec: dict[str, Any] = {"nodes_per_leaf": 8, "spines": 8, "placement": "random"}
    sim = _run(FabricSpec(**spec), duration=240.0)
    engine = MessageFeed()
    flags = []
    waits: dict[tuple[str, str], list[int]] = {}
    for m in sim.messages():
        if isinstance(m, GpuSample):
            continue  # the fabric changes no GPU reading; the rest goes to every detector
        if isinstance(m, NicSample):
            waits.setdefault((m.node, m.device), []).append(m.counters["port_xmit_wait"])
        flags += engine.update(m)
    flags += engine.flush()
    rates = sorted(w[-1] - w[0] for w in waits.values())
    assert rates[-1] > 5 * rates[len(rates) // 2]  # the hottest NIC waits far more than most
    seen = Counter((f.detector, f.severity) for f in flags)
    assert seen[("fabric", "info")] > 0
    assert not [f for f in flags if f.is_claim]  # collisions are no node's fault


# The independent flow-level model (agents/simulator/flow_fabric.py): the judge of the advice.


def test_max_min_fair_rates_fill_progressively() -> None:
    from guard.agents.simulator.flow_fabric import max_min_rates

    # the textbook case: link 0 (cap 10) carries groups 0, 1, 2; link 1 (cap 4) groups 1, 2;
    # groups 1 and 2 fill link 1 at 2 each, group 0 then takes the rest of link 0
    w = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert max_min_rates(w, np.array([10.0, 4.0])) == pytest.approx([6.0, 2.0, 2.0])
    # a group with two QPs on a link takes two shares of it (per-QP fairness)
    w = np.array([[2.0, 1.0]])
    assert max_min_rates(w, np.array([9.0])) == pytest.approx([3.0, 3.0])


def test_roce_source_port_is_the_rdma_cores() -> None:
    from guard.agents.simulator.flow_fabric import rdma_udp_sport

    assert rdma_udp_sport(0x11, 0x22) == 0xC000 | 0x242  # the product, below 14 bits
    assert rdma_udp_sport(1 << 20, 1) == 0xC001  # bit 20 folded back by fl ^= fl >> 20
    assert rdma_udp_sport(0x5, 0x7, flow_label=0x4001) == 0xC000 | (0x0001 ^ 0x1)
    ports = {rdma_udp_sport(q, q + 1000) for q in range(4096)}
    assert min(ports) >= 0xC000 and len(ports) > 3000


def test_the_switch_hash_spreads_like_balls_into_bins() -> None:
    from guard.agents.simulator.flow_fabric import FlowFabric, rdma_udp_sport
    from guard.schemas.topology import infer_topology

    names = [f"n{i:03d}" for i in range(64)]
    topo = infer_topology(names, rails=1, nodes_per_leaf=16, spines=16)
    fabric = FlowFabric(topo)
    rng = np.random.default_rng(1)
    hashed, uniform = [], []
    for _ in range(600):
        counts = Counter(
            fabric.spine_of(
                names[i],
                names[int(rng.integers(16, 64))],
                0,
                rdma_udp_sport(*(int(x) for x in rng.integers(0, 1 << 23, size=2))),
            )
            for i in range(16)
        )
        hashed.append(max(counts.values()))
        uniform.append(np.bincount(rng.integers(0, 16, size=16)).max())
    # 16 QPs onto 16 uplinks: the busiest carries ~3.1 (exact expectation 3.08)
    assert statistics.fmean(hashed) == pytest.approx(statistics.fmean(uniform), abs=0.15)


def _two_pod(spines: int, factors: dict[str, float] | None = None) -> Any:
    from guard.schemas.topology import infer_topology

    topo = infer_topology(
        ["a", "b", "c", "d"], rails=1, nodes_per_leaf=2, spines=spines, uplink_gbps=400
    )
    return topo.with_capacity(factors or {})


def test_steps_in_time_ideal_alone_and_shared_when_hashed_together() -> None:
    from guard.agents.simulator.flow_fabric import FlowFabric, StepJob, simulate_steps

    rng = np.random.default_rng(0)
    # one job inside one pod: its ring never leaves the leaf, the all-reduce is NIC-bound
    fabric = FlowFabric(_two_pod(1))
    ideal = 2 * 1 / 2 * 1e9 / (400e9 / 8)
    runs = simulate_steps(fabric, [StepJob("j", ("a", "b"), 1e9, 0.1)], 3, rng)
    assert runs["j"].allreduce_s == pytest.approx([ideal] * 3)
    assert runs["j"].step_s == pytest.approx([0.1 + ideal] * 3)
    # two jobs across the pods on a single spine, all-reduces at once: a's ring a->c->a and
    # b's b->d->b share pod0's one uplink each way, so each runs at half the NIC
    jobs = [StepJob("x", ("a", "c"), 1e9, 0.1), StepJob("y", ("b", "d"), 1e9, 0.1)]
    runs = simulate_steps(fabric, jobs, 2, rng, phase="aligned")
    assert runs["x"].allreduce_s == pytest.approx([2 * ideal] * 2)
    # staggered phases: each all-reduce alone on the uplink, compute 10x longer than it
    runs = simulate_steps(fabric, jobs, 4, np.random.default_rng(3))
    assert min(min(r.allreduce_s) for r in runs.values()) == pytest.approx(ideal)


def test_ecmp_keeps_a_degraded_uplink_adaptive_routing_and_steering_do_not() -> None:
    from guard.agents.simulator.flow_fabric import FlowFabric, StepJob, simulate_steps

    slow = {f"pod{p}-rail0->spine{s}": 0.1 for p in (0, 1) for s in (0, 1, 2)}
    topo = _two_pod(4, slow)  # three of four spines at a tenth, in both pods
    job = [StepJob("j", ("a", "c"), 1e9, 0.1, qps=8)]
    ideal = 1e9 / (400e9 / 8)
    ecmp = simulate_steps(FlowFabric(topo), job, 1, np.random.default_rng(0), phase="aligned")
    # 8 QPs hashed over 4 spines, some on a tenth-speed one: the ring crawls
    assert ecmp["j"].allreduce_s[0] > 2 * ideal
    steer = {("j", s, d, 0, q): "spine3" for s, d in (("a", "c"), ("c", "a")) for q in range(8)}
    pinned = simulate_steps(
        FlowFabric(topo), job, 1, np.random.default_rng(0), steer=steer, phase="aligned"
    )
    assert pinned["j"].allreduce_s[0] == pytest.approx(ideal)
    # adaptive: bytes spread by capacity, 1.3 uplinks worth for 1 NIC: NIC-bound
    adaptive = simulate_steps(
        FlowFabric(topo, routing="adaptive"), job, 1, np.random.default_rng(0), phase="aligned"
    )
    assert adaptive["j"].allreduce_s[0] == pytest.approx(ideal)

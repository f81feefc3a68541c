"""The simulator's multi-path fabric: ECMP collisions and degraded uplinks slow connections."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import pytest

from guard.agents.simulator import ClusterSimulator, FabricSpec, JobSpec, SimConfig
from guard.detectors.engine import DetectionEngine
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
    engine = DetectionEngine()
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

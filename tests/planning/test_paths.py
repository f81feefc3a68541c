"""Topology, the C4P path planner against ECMP, and the advice built from them."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from guard.planning.advice import (
    JobPattern,
    advise,
    cross_leaf_connections,
    leaf_ring_order,
)
from guard.planning.paths import (
    Fabric,
    ecmp_routes,
    evaluate_routes,
    plan_routes,
    ring_allreduce_flows,
)
from guard.schemas import Advice, decode, encode
from guard.schemas.topology import Topology, TopologyError, infer_topology, load_topology

EXAMPLE = Path(__file__).parents[2] / "deploy" / "topology" / "example.yaml"
RAILS = 8


def _cluster(nodes: int = 64, per_leaf: int = 8, spines: int = 8) -> Topology:
    names = [f"node-{i:03d}" for i in range(nodes)]
    return infer_topology(names, rails=RAILS, nodes_per_leaf=per_leaf, spines=spines)


def _placed_flows(topo: Topology, jobs: int, job_nodes: int, seed: int, qps: int = 1) -> list:
    free = [n.name for n in topo.nodes]
    random.Random(seed).shuffle(free)
    return [
        flow
        for j in range(jobs)
        for flow in ring_allreduce_flows(
            f"job-{j}", sorted(free[j * job_nodes : (j + 1) * job_nodes]), RAILS, 1e9, qps
        )
    ]


def test_example_file_loads_and_json_round_trips(tmp_path: Path) -> None:
    topo = load_topology(EXAMPLE)
    assert topo.rails == 2 and topo.spines == ["spine0", "spine1"]
    assert topo.leaf_of("gpu-b02", 1) == "pod1-rail1"
    degraded = [u.name for u in topo.uplinks if u.capacity_factor < 1]
    assert degraded == ["pod1-rail0->spine1"]
    as_json = tmp_path / "fabric.json"
    as_json.write_text(json.dumps(topo.model_dump()))
    assert load_topology(as_json) == topo


def test_bad_topology_files_say_what_is_wrong(tmp_path: Path) -> None:
    unwired = {
        "nodes": [
            {"name": "a", "nics": [{"rail": 0, "device": "mlx5_0", "leaf": "l0"}]},
            {"name": "b", "nics": [{"rail": 0, "device": "mlx5_0", "leaf": "l1"}]},
        ],
        "uplinks": [{"leaf": "l0", "spine": "s0"}],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(unwired))
    with pytest.raises(TopologyError, match=r"leaf 'l1'.*has no uplink"):
        load_topology(path)
    path.write_text("{not json")
    with pytest.raises(TopologyError, match="not valid JSON"):
        load_topology(path)
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "missing.yaml")
    with pytest.raises(TopologyError, match="not in topology"):
        _cluster().node("node-999")


def test_inferred_default_is_rail_optimised() -> None:
    topo = _cluster(nodes=20, per_leaf=8, spines=4)
    # rail r of every node of a pod on that pod's rail-r leaf; the last pod is partial
    assert {topo.leaf_of(f"node-{i:03d}", 3) for i in range(8)} == {"pod0-rail3"}
    assert topo.leaf_of("node-019", 7) == "pod2-rail7"
    assert len(topo.uplinks) == 3 * RAILS * 4
    # non-blocking: a leaf's uplinks carry what its NICs can send
    assert {u.gbps for u in topo.uplinks} == {8 * 400 / 4}


def test_ring_flows_carry_the_ring_all_reduce_volume() -> None:
    flows = ring_allreduce_flows(
        "j", ["a", "b", "c", "d"], rails=2, message_bytes=8e9, qps_per_connection=2
    )
    assert len(flows) == 4 * 2 * 2
    # each rank sends 2(n-1)/n of the message, split over rails and queue pairs
    assert sum(f.bytes for f in flows if f.src == "a") == pytest.approx(2 * 3 / 4 * 8e9)
    assert {(f.src, f.dst) for f in flows} == {("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")}
    assert ring_allreduce_flows("j", ["a"], rails=2, message_bytes=1e9) == []


@pytest.mark.parametrize("seed", range(4))
def test_plan_reaches_the_nic_bound_where_ecmp_collides(seed: int) -> None:
    topo = _cluster()
    fabric = Fabric(topo)
    flows = _placed_flows(topo, jobs=8, job_nodes=8, seed=seed)
    ecmp = evaluate_routes(fabric, flows, ecmp_routes(fabric, flows))
    planned = evaluate_routes(fabric, flows, plan_routes(fabric, flows))
    nic_bound = flows[0].bytes / (400e9 / 8)
    # non-blocking fabric, at most one flow per NIC per direction: a perfect plan exists
    assert planned.max_link_s == pytest.approx(nic_bound)
    assert max(planned.allreduce_s.values()) == pytest.approx(nic_bound)
    assert ecmp.max_link_s >= planned.max_link_s
    assert ecmp_routes(fabric, flows) == ecmp_routes(fabric, flows)  # a hash, not a dice


def test_ecmp_collides_somewhere_on_a_loaded_fabric() -> None:
    topo = _cluster()
    fabric = Fabric(topo)
    worst = max(
        evaluate_routes(fabric, f, ecmp_routes(fabric, f)).max_link_s / f[0].bytes
        for f in (_placed_flows(topo, 8, 8, seed) for seed in range(4))
    )
    assert worst >= 2 / (400e9 / 8)  # two flows hashed onto one uplink at least once


def test_plan_steers_around_a_degraded_uplink_and_ecmp_does_not() -> None:
    # two pods of one node, one rail, four spines: one flow each way between the pods
    topo = infer_topology(["a", "b"], rails=1, nodes_per_leaf=1, spines=4, uplink_gbps=400)
    slow = {f"pod0-rail0->spine{s}": 0.25 for s in range(3)}  # three of four uplinks slow
    fabric = Fabric(topo.with_capacity(slow))
    flows = ring_allreduce_flows("j", ["a", "b"], rails=1, message_bytes=1e9)
    planned = plan_routes(fabric, flows)
    out = next(r for f, r in zip(flows, planned, strict=True) if f.src == "a")
    assert out.spine == "spine3"
    report = evaluate_routes(fabric, flows, planned)
    assert report.max_link_s == pytest.approx(flows[0].bytes / (400e9 / 8))


def test_drained_uplink_is_no_path_and_no_path_is_an_error() -> None:
    topo = infer_topology(["a", "b"], rails=1, nodes_per_leaf=1, spines=2, uplink_gbps=400)
    flows = ring_allreduce_flows("j", ["a", "b"], rails=1, message_bytes=1e9, qps_per_connection=8)
    fabric = Fabric(topo.with_capacity({"pod0-rail0->spine0": 0.0}))
    for routes in (ecmp_routes(fabric, flows), plan_routes(fabric, flows)):
        assert {r.spine for f, r in zip(flows, routes, strict=True) if f.src == "a"} == {"spine1"}
    cut = Fabric(topo.with_capacity({"pod0-rail0->spine0": 0.0, "pod0-rail0->spine1": 0.0}))
    with pytest.raises(TopologyError, match="no spine connects leaf 'pod0-rail0'"):
        plan_routes(cut, flows)


def test_advice_has_the_plan_the_gain_and_operator_actions() -> None:
    base = _cluster()
    free = [n.name for n in base.nodes]
    random.Random(0).shuffle(free)
    jobs = [JobPattern(f"job-{j}", tuple(sorted(free[j * 8 : (j + 1) * 8])), 1e9) for j in range(8)]
    # a slower NIC on one node, and a degraded uplink
    slow_node = jobs[0].nodes[0]
    nodes = [
        n.model_copy(update={"nics": [n.nics[0].model_copy(update={"gbps": 200.0}), *n.nics[1:]]})
        if n.name == slow_node
        else n
        for n in base.nodes
    ]
    topo = base.model_copy(update={"nodes": nodes}).with_capacity({"pod0-rail0->spine0": 0.5})
    advice = advise(topo, jobs, ts=1_700_000_000.0)
    assert len(advice) == 8
    by_job = {a.job: a for a in advice}
    gains = [a.expected_gain_pct for a in advice]
    assert max(gains) > 0 and min(gains) >= -1e-9
    improved = next(a for a in advice if a.expected_gain_pct > 3)
    assert improved.planned_allreduce_s < improved.ecmp_allreduce_s
    # stock NCCL cannot steer queue pairs: the plan is applied only where steering exists
    assert not any(a.action == "route_flow" for a in improved.actions)
    steered = advise(topo, jobs, ts=1_700_000_000.0, steering=True)
    route = next(a for a in steered if a.job == improved.job).actions[0]
    assert route.action == "route_flow" and "modified collective library" in route.why
    # nothing drains an uplink from the topology file alone: the detector must have seen it
    assert not any(a.action == "drain_uplink" for adv in advice for a in adv.actions)
    # the plan lists the flows it moves off their ECMP spine
    assert improved.moved_flows == len(improved.plan) > 0
    assert all(p.spine and p.spine != p.ecmp_spine for p in improved.plan)
    assert improved.hot_links
    rail = next(a for a in by_job["job-0"].actions if a.action == "drain_rail")
    assert rail.target == f"{slow_node}/mlx5_0"
    assert rail.value == "NCCL_IB_HCA=" + ",".join(f"mlx5_{r}" for r in range(1, 8))
    # the same plan gives the same id; the message survives the wire
    assert advise(topo, jobs, ts=1_700_000_001.0)[0].id == advice[0].id
    wire = decode(encode(improved), "advice")
    assert isinstance(wire, Advice) and wire == improved
    assert wire.kafka_key() == improved.job.encode()


def test_job_patterns_from_simulated_telemetry_feed_the_advice() -> None:
    from guard.agents.simulator import ClusterSimulator, SimConfig
    from guard.planning.advice import JobPatterns
    from guard.schemas import CollectiveTiming, StepTiming

    sim = ClusterSimulator(SimConfig(nodes=8, duration_s=60.0, seed=3, start_ts=1_700_000_000.0))
    seen = JobPatterns(default_bytes=1.0)
    nodes: dict[str, set[str]] = {}
    largest: dict[str, int] = {}
    for message in sim.messages():
        seen.update(message)
        if isinstance(message, (StepTiming, CollectiveTiming)):
            nodes.setdefault(message.job, set()).add(message.node)
        if isinstance(message, CollectiveTiming) and message.op == "allreduce":
            largest[message.job] = max(largest.get(message.job, 0), message.bytes)
    patterns = seen.patterns()
    assert patterns and {p.job: set(p.nodes) for p in patterns} == nodes
    assert {p.job: p.message_bytes for p in patterns} == {j: largest.get(j, 1.0) for j in nodes}
    everyone = sorted(set().union(*nodes.values()))
    topo = infer_topology(everyone, rails=8, nodes_per_leaf=2, spines=2)
    advice = advise(topo, patterns, ts=sim.config.start_ts)
    assert {a.job for a in advice} == {p.job for p in patterns if len(p.nodes) > 1}
    seen.forget(patterns[0].job)
    assert patterns[0].job not in {p.job for p in seen.patterns()}


def test_a_full_plan_fits_in_one_message() -> None:
    from guard.schemas import ADVICE_MAX_PLAN, MAX_MESSAGE_BYTES, PathAssignment

    long = "gpu-node-rack42-slot07.cluster.example.com"
    plan = [
        PathAssignment(src=long, dst=long, rail=7, qp=3, spine="spine-031", ecmp_spine="spine-017")
    ] * ADVICE_MAX_PLAN
    advice = Advice(
        ts=1.0,
        job="j",
        id="x",
        topology="t",
        flows=1,
        ecmp_allreduce_s=2.0,
        planned_allreduce_s=1.0,
        expected_gain_pct=100.0,
        plan=plan,
    )
    assert len(encode(advice)) < MAX_MESSAGE_BYTES


def test_stock_actions_say_what_applies_them_when_and_where() -> None:
    topo = _cluster()
    free = [n.name for n in topo.nodes]
    random.Random(0).shuffle(free)
    # ranks in the scheduler's order, ignoring the pods: most ring hops cross the spines
    jobs = [JobPattern(f"job-{j}", tuple(free[j * 8 : (j + 1) * 8]), 1e9) for j in range(8)]
    advice = advise(topo, jobs, ts=1.0)
    kinds = {a.action for adv in advice for a in adv.actions}
    assert {"nccl_env", "place_ranks"} <= kinds
    env = next(a for adv in advice for a in adv.actions if a.action == "nccl_env")
    assert env.value in {
        f"NCCL_IB_QPS_PER_CONNECTION={q} NCCL_IB_SPLIT_DATA_ON_QPS=1" for q in (2, 4)
    }
    assert "next restart" in env.why and "ECMP" in env.why
    for adv, job in zip(advice, jobs, strict=True):
        place = next((a for a in adv.actions if a.action == "place_ranks"), None)
        if place is None:
            continue
        order = place.value.split(",")
        assert sorted(order) == sorted(job.nodes)  # the same hosts, re-ordered
        assert cross_leaf_connections(topo, order) < cross_leaf_connections(topo, job.nodes)
        assert "SLURM_HOSTFILE" in place.why and "next restart" in place.why
    # a job already in leaf order is not told to move
    tidy = [JobPattern(j.job, leaf_ring_order(topo, j.nodes), 1e9) for j in jobs]
    assert not any(
        a.action == "place_ranks" for adv in advise(topo, tidy, 1.0) for a in adv.actions
    )


def test_a_hot_leaf_seen_by_the_detector_drains_its_degraded_uplink_or_asks_to_inspect() -> None:
    topo = infer_topology(["a", "b"], rails=1, nodes_per_leaf=1, spines=2, uplink_gbps=400)
    # ECMP keeps half of 8 QPs on the quarter-speed uplink
    slow = topo.with_capacity({"pod0-rail0->spine0": 0.25})
    job = [JobPattern("j", ("a", "b"), 1e9, qps_per_connection=8)]
    quiet = advise(slow, job, ts=1.0)[0]
    assert not any(a.action in ("drain_uplink", "inspect_leaf") for a in quiet.actions)
    seen = advise(slow, job, ts=1.0, hot_leaves={"pod0-rail0"})[0]
    drain = next(a for a in seen.actions if a.action == "drain_uplink")
    assert drain.target == "pod0-rail0->spine0" and "detector saw pod0-rail0 hot" in drain.why
    assert "apply: now" in drain.why
    assert "detected hot pod0-rail0" in seen.hot_links
    # hot, but no uplink of it known to be slow: look at its ports, drain nothing
    healthy = advise(topo, job, ts=1.0, hot_leaves={"pod0-rail0", "elsewhere"})[0]
    assert [(a.action, a.target) for a in healthy.actions] == [("inspect_leaf", "pod0-rail0")]


@pytest.fixture(scope="module")
def bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "paths.py"
    spec = importlib.util.spec_from_file_location("paths_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_balls_into_bins_expectation_is_exact(bench: Any) -> None:
    assert bench.expected_max_load(2, 2) == pytest.approx(1.5)
    # 3 into 3: all apart 6/27 (max 1), all together 3/27 (max 3), else max 2
    assert bench.expected_max_load(3, 3) == pytest.approx((6 + 2 * 18 + 3 * 3) / 27)
    assert bench.expected_max_load(16, 16) == pytest.approx(3.08, abs=0.01)


def test_benchmark_judges_every_routing_on_the_independent_model(bench: Any) -> None:
    args = argparse.Namespace(
        message_mb=64.0, job_nodes=8, comm_share=0.3, seeds=2, steps=3, ring_order="random",
        phase="random", channels=1,
    )  # fmt: skip
    topo = bench.cluster(256, 8, 8)
    healthy = bench.run_level(args, topo, 4)
    assert set(healthy) == {v[0] for v in bench.VARIANTS}
    assert all(r["ar"] >= 1 - 1e-9 and r["step"] >= 1 - 1e-9 for r in healthy.values())
    assert healthy["ecmp q1"]["gain"] == 0
    assert healthy["adaptive"]["ar"] == pytest.approx(1.0)  # non-blocking, spread by capacity
    assert healthy["ecmp q1"]["ar"] > healthy["placement q1"]["ar"]  # random rank order
    degraded = bench.run_level(args, topo.with_capacity({"pod0-rail0->spine0": 0.5}), 4)
    assert {"drain q1", "drain q4"} <= set(degraded)

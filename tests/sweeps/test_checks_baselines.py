"""The two baselines: the shipped per-SKU floors and the fleet median of passing sweeps, read
from real chDB and from the sweeps topic on a real broker."""

from __future__ import annotations

import time
from typing import Any

import pytest

from guard.config import Settings
from guard.kafka import make_producer, produce
from guard.schemas import NodeState, SweepCheck, SweepResult
from guard.store import insert_messages
from guard.sweeps.baselines import (
    FLOORS,
    FleetBaseline,
    judge,
    node_states_from_clickhouse,
    sku_of,
    sweeps_from_clickhouse,
)
from guard.sweeps.checks.base import CheckResult
from guard.sweeps.service import read_node_states, read_sweeps

NOW = 1_767_226_500.0


def past_sweep(
    node: str, tflops: list[float], sku: str = "H200", passed: bool = True, ts: float = NOW
) -> SweepResult:
    checks = [
        SweepCheck(name="gpu_count", value=8, unit="count", passed=True, detail=f"sku={sku}; 8"),
        *(
            SweepCheck(name=f"gemm_bf16_tflops:gpu{i}", value=v, unit="TFLOPS", passed=True)
            for i, v in enumerate(tflops)
        ),
    ]
    return SweepResult(
        id=f"s-{node}-{ts}", ts=ts, node=node, sweep="single", checks=checks, passed=passed
    )


def state(node: str, name: str, ts: float = NOW + 1, actor: str = "orchestrator") -> NodeState:
    return NodeState(ts=ts, node=node, state=name, actor=actor)


def released(*sweeps: SweepResult) -> list[NodeState]:
    """The orchestrator's release of each sweep's node right after it."""
    return [state(s.node, "healthy", s.ts + 1) for s in sweeps]


def test_every_floor_names_its_source_and_says_when_it_is_unverified() -> None:
    assert set(FLOORS) == {"H100 SXM", "H100 NVL", "H200", "H200 NVL", "GH200", "A100 80GB"}
    for sku, floors in FLOORS.items():
        for fam, floor in floors.items():
            assert floor.source and floor.unit in ("TFLOPS", "GB/s", "Gb/s"), (sku, fam)
            assert ("unverified" in floor.describe()) is not floor.verified
    assert FLOORS["H100 SXM"]["nccl_allreduce_busbw_gbps"].floor == 460
    assert FLOORS["H200"]["nccl_allreduce_busbw_gbps"].floor == 431
    assert FLOORS["A100 80GB"]["gemm_fp16_tflops"].floor == pytest.approx(247.86)  # 90 % of 275.4
    # verified: read in the source at the commit named; scaled: the Hopper GEMM/HBM floors
    assert FLOORS["A100 80GB"]["hbm_copy_gbps"].verified
    assert (
        FLOORS["H100 SXM"]["ib_write_bw_gdr_gbps"].floor == 380
    )  # Azure's threshold since 2023-10
    unverified = {(sku, f) for sku, fl in FLOORS.items() for f, x in fl.items() if not x.verified}
    assert all(f.startswith(("gemm_", "hbm_")) and sku != "A100 80GB" for sku, f in unverified)
    # single-GPU and NVLink-bridged parts are not judged on the 8-GPU all-reduce floor
    for sku in ("GH200", "H200 NVL", "H100 NVL"):
        assert "nccl_allreduce_busbw_gbps" not in FLOORS[sku] and "hbm_copy_gbps" in FLOORS[sku]


def test_the_fleet_median_is_per_sku_over_passing_sweeps_and_leaves_the_node_out() -> None:
    sweeps = [
        past_sweep("n1", [700, 702, 704]),
        past_sweep("n2", [710, 712]),
        past_sweep("n3", [690]),
        past_sweep("n4", [100], passed=False),  # a failed sweep is no baseline
        past_sweep("n5", [300], sku="A100 80GB"),
        past_sweep("me", [900]),  # the node being swept
    ]
    fleet = FleetBaseline.from_sweeps(sweeps, released(*sweeps), exclude_node="me")
    assert fleet.get("H200", "gemm_bf16_tflops") == (702.0, 3)  # medians 702, 711, 690
    assert fleet.get("A100 80GB", "gemm_bf16_tflops") == (300.0, 1)
    assert fleet.get("H100 SXM", "gemm_bf16_tflops") is None
    window = FleetBaseline.from_sweeps(sweeps, released(*sweeps), window=1, exclude_node="me")
    assert window.get("H200", "gemm_bf16_tflops") == (690.0, 1)  # the latest one only
    assert sku_of(sweeps[0]) == "H200"


def test_the_fleet_median_is_built_from_released_nodes_only_never_from_suspects() -> None:
    fast = [past_sweep(f"n{i}", [700.0 + i], ts=NOW + i) for i in range(3)]
    suspects = [
        past_sweep("s1", [400.0]),  # passed, still being swept (multi-node sweep running)
        past_sweep("s2", [410.0]),  # passed single, then failed the multi-node sweep
        past_sweep("s3", [420.0]),  # passed, no state since (the orchestrator died)
        past_sweep("s4", [430.0]),  # passed; only an operator's request to release it since
    ]
    states = [
        *released(*fast),
        state("s1", "sweeping"),
        state("s2", "sweeping"),
        state("s2", "failed", NOW + 2),
        state("s2", "healthy", NOW + 9),  # released after repair: the failing sweep decided
        state("s4", "healthy", actor="operator:alice"),
    ]
    fleet = FleetBaseline.from_sweeps([*fast, *suspects], states)
    assert fleet.get("H200", "gemm_bf16_tflops") == (701.0, 3)
    # the same suspects released after their sweeps do count
    fleet = FleetBaseline.from_sweeps([*fast, *suspects], released(*fast, *suspects))
    assert fleet.get("H200", "gemm_bf16_tflops") == (430.0, 7)


def test_judging_more_than_five_percent_below_the_fleet_or_under_the_floor() -> None:
    fleet = FleetBaseline({"H200": {"gemm_bf16_tflops": (702.0, 3)}})

    def verdict(value: float, sku: str = "H200") -> CheckResult:
        [r] = judge(
            [CheckResult("gemm_bf16_tflops:gpu0", value, "TFLOPS", judged=True)], sku, fleet
        )
        return r

    assert verdict(680).passed  # 3.1 % below
    slow = verdict(660)  # 6 % below
    assert not slow.passed and slow.baseline == 702.0
    assert "6.0% below the fleet median 702 TFLOPS of 3 passing H200 sweeps" in slow.detail
    assert "above the H200 floor of 585 TFLOPS" in slow.detail
    assert slow.against == "H200 floor 585 and fleet median 702"
    # neither a floor nor a fleet median: untested, which fails
    [alone] = judge([CheckResult("nic_gbps", 9.0, "Gb/s", judged=True)], "H200", FleetBaseline({}))
    assert not alone.passed and alone.against == ""
    assert "untested: neither a floor nor a fleet baseline" in alone.detail
    under = judge([CheckResult("h2d_gbps:gpu1", 40.0, "GB/s", judged=True)], "H100 SXM", fleet)[0]
    assert not under.passed and "under the H100 SXM floor of 48 GB/s" in under.detail
    assert "nd96isr_h100_v5.conf: check_gpu_bw 48 335 (h2d/d2h)" in under.detail
    # Unjudged results (counts, temperatures) keep their own verdict.
    [count] = judge([CheckResult("xid_events", 0.0, "count", passed=True)], "H200", fleet)
    assert count.passed and count.detail == ""


def test_past_sweeps_come_back_from_clickhouse(store: tuple[Any, Settings]) -> None:
    client, settings = store
    now = time.time()  # recent: older rows may already be past the tables' TTL
    sweeps = [past_sweep(f"n{i}", [700 + i], ts=now - 10 + i) for i in range(4)]
    sweeps.append(past_sweep("n9", [1.0], passed=False, ts=now - 1))
    insert_messages(client, settings, sweeps)
    # n3 passed but is still being swept: its sweep is no baseline
    insert_messages(client, settings, [*released(*sweeps[:3]), state("n3", "sweeping", now)])
    back = sweeps_from_clickhouse(client, settings.clickhouse.database)
    assert [s.node for s in back] == ["n0", "n1", "n2", "n3"]  # passing only, oldest first
    assert back[0].checks[1].value == 700 and sku_of(back[0]) == "H200"
    states = node_states_from_clickhouse(client, settings.clickhouse.database, back[0].ts)
    assert {(s.node, s.state) for s in states} >= {("n0", "healthy"), ("n3", "sweeping")}
    fleet = FleetBaseline.from_sweeps(back, states)
    assert fleet.get("H200", "gemm_bf16_tflops") == (701.0, 3)


@pytest.mark.kafka
def test_past_sweeps_come_back_from_the_sweeps_topic(kafka_settings: Settings) -> None:
    producer = make_producer(kafka_settings)
    sweeps = [past_sweep(f"n{i}", [720.0 + i], ts=time.time() + i) for i in range(3)]
    for message in [*sweeps, *released(*sweeps[:2]), state("n2", "failed", sweeps[2].ts + 1)]:
        produce(producer, kafka_settings, message)
    assert producer.flush(30) == 0
    views = read_node_states(kafka_settings, timeout_s=30, keep_history=True)
    states = [s for view in views.values() for s in view.history]
    fleet = FleetBaseline.from_sweeps(read_sweeps(kafka_settings, timeout_s=30), states)
    assert fleet.get("H200", "gemm_bf16_tflops") == (720.5, 2)

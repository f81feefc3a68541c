"""Fabric hot spots from NIC congestion counters, per NIC and per leaf, against rail peers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from guard.detectors.core import MessageFeed
from guard.detectors.engine import EngineConfig
from guard.detectors.fabric import FabricHotSpotDetector
from guard.detectors.findings import Finding
from guard.schemas import NicSample
from guard.schemas.topology import infer_topology

NODES = [f"node-{i}" for i in range(8)]
# 4 pods of 2 nodes, 2 rails: rail r of pod p on leaf pod{p}-rail{r}
TOPOLOGY = infer_topology(NODES, rails=2, nodes_per_leaf=2, spines=2)
HEALTHY_WAIT_PER_S = 20_000  # port_xmit_wait ticks/s of a busy but uncongested 400G port
HOT_WAIT_PER_S = 2_000_000
START = 1_699_999_980.0  # on a minute: windows are aligned to the epoch


def nic_samples(hot: set[str], seconds: int, reset_at: int | None = None) -> Iterator[NicSample]:
    """Every 10 s each node's two NICs; rail 0 of the ``hot`` nodes waits 100x more."""
    totals = {(n, r): 0 for n in NODES for r in range(2)}
    for t in range(0, seconds, 10):
        for node in NODES:
            for rail in range(2):
                rate = HOT_WAIT_PER_S if (node in hot and rail == 0) else HEALTHY_WAIT_PER_S
                totals[(node, rail)] += 10 * rate
                if reset_at is not None and t == reset_at:
                    totals[(node, rail)] = 0  # agent restart: counters cleared
                yield NicSample(
                    ts=START + t,
                    node=node,
                    job="job-a" if NODES.index(node) < 4 else "job-b",
                    device=f"mlx5_{rail}",
                    port=1,
                    counters={"port_xmit_wait": totals[(node, rail)], "rp_cnp_handled": t},
                )


def _run(
    det: FabricHotSpotDetector, hot: set[str], seconds: int, reset_at: int | None = None
) -> list[Finding]:
    out: list[Finding] = []
    for sample in nic_samples(hot, seconds, reset_at):
        out += det.update(sample)
    return out + det.flush()


def test_a_congested_leaf_is_an_info_hot_spot_attributed_to_its_jobs() -> None:
    det = FabricHotSpotDetector(TOPOLOGY, window_s=60.0, windows=3)
    found = _run(det, hot={"node-2", "node-3"}, seconds=300)
    raised = [f for f in found if not f.clear]
    assert raised and all(f.severity == "info" for f in found)
    leaf = [f for f in raised if f.evidence["level"] == "leaf"]
    assert [(f.node, f.device, f.category) for f in leaf] == [(None, "pod1-rail0", "link")]
    assert leaf[0].evidence["jobs"] == ["job-a"] and leaf[0].job == "job-a"
    assert leaf[0].evidence["windows"] == 3
    assert leaf[0].evidence["xmit_wait_per_s"] > 3 * leaf[0].evidence["rail_median_xmit_wait_per_s"]
    nics = sorted((f.node, f.device) for f in raised if f.evidence["level"] == "nic")
    assert nics == [("node-2", "mlx5_0"), ("node-3", "mlx5_0")]
    assert all(f.category == "nic" for f in raised if f.evidence["level"] == "nic")


def test_a_short_burst_or_a_quiet_fabric_is_not_a_hot_spot() -> None:
    assert _run(FabricHotSpotDetector(TOPOLOGY, windows=3), hot=set(), seconds=600) == []
    # hot for two windows only, when three are needed: nothing
    det = FabricHotSpotDetector(TOPOLOGY, window_s=60.0, windows=3)
    assert _run(det, hot={"node-5"}, seconds=120) == []


def test_counter_reset_is_rebaselined_not_a_spike() -> None:
    det = FabricHotSpotDetector(TOPOLOGY, window_s=60.0, windows=1)
    assert _run(det, hot=set(), seconds=400, reset_at=200) == []


def test_a_hot_spot_that_cools_down_is_withdrawn() -> None:
    det = FabricHotSpotDetector(window_s=60.0, windows=2)  # no topology: rails by device
    first = _run(det, hot={"node-6"}, seconds=240)
    assert [(f.node, f.clear) for f in first] == [("node-6", False)]
    assert first[0].evidence["rail"] == "mlx5_0"
    det._last.clear()  # a new run of counters from the same ports
    cooled = _run(det, hot=set(), seconds=180)
    assert [(f.node, f.clear) for f in cooled] == [("node-6", True)]


@pytest.mark.parametrize("topology", [TOPOLOGY, None], ids=["file", "inferred"])
def test_the_engine_flags_hot_spots_as_info_only(topology: object) -> None:
    """Through the engine and fusion: the hot leaf and its two NICs, as info flags; with no
    topology file the leaves are inferred (nodes by name, two to a pod) and named alike."""
    engine = MessageFeed(EngineConfig(topology=topology, nodes_per_leaf=2))  # type: ignore[arg-type]
    flags = []
    for sample in nic_samples({"node-2", "node-3"}, 300):
        flags += engine.update(sample)
    flags += engine.flush()
    hot = [f for f in flags if f.detector == "fabric"]
    assert hot and all(not f.is_claim for f in flags)
    leaf = [(f.node, f.device, f.category) for f in hot if f.evidence["level"] == "leaf"]
    assert leaf == [(None, "pod1-rail0", "link")]
    assert sorted(f.node for f in hot if f.evidence["level"] == "nic") == ["node-2", "node-3"]
    assert EngineConfig().fabric and engine.state_bytes()["fabric"] > 0


def test_the_engine_can_leave_the_fabric_out() -> None:
    engine = MessageFeed(EngineConfig.from_mapping({"fabric": False}))
    flags = [f for s in nic_samples({"node-2", "node-3"}, 300) for f in engine.update(s)]
    assert engine.fabric is None and flags + engine.flush() == []
    with pytest.raises(ValueError, match=r"detectors\.args\.fabric: no setting 'topology'"):
        EngineConfig.from_mapping({"args": {"fabric": {"topology": "x"}}})


def test_a_window_that_closes_before_any_nic_counted_is_empty_not_a_crash() -> None:
    # Found by the chaos suite's hostile input: one NIC sample per window (each a first
    # sample, so nothing counted) closed a window with no node to infer a fabric from, and
    # the inferred topology's validation stopped the worker.
    det = FabricHotSpotDetector(nodes_per_leaf=2)
    found: list[Finding] = []
    for i, ts in enumerate((START, START + 3600, START + 7200)):
        found += det.update(NicSample(ts=ts, node=f"odd-{i}", device="mlx5_0", port=1, counters={}))
    assert found == [] and det.flush() == []
    # and it still finds hot spots afterwards
    assert any(f.severity == "info" for f in _run(det, {"node-0", "node-1"}, 600))

"""The node stream keeps a fabric hot-spot detector per input partition, checkpointed like a key."""

from __future__ import annotations

from guard.detectors.core import DetectionCore
from guard.detectors.engine import EngineConfig, fabric_key
from guard.schemas import encode
from guard.schemas.batches import batch_messages
from guard.schemas.topology import infer_topology
from guard.streams.checkpoints import seal, unseal

from ..detectors.test_fabric import NODES, nic_samples

SECRET = b"s" * 32


def _hot_spots(node: DetectionCore, messages: list[object], batched: bool) -> list[str]:
    found = []
    per_tick: dict[float, list[object]] = {}
    for m in messages:
        per_tick.setdefault(m.ts, []).append(m)  # type: ignore[attr-defined]
    for tick in per_tick.values():
        records = batch_messages(tick) if batched else tick  # type: ignore[arg-type]
        found += node.step([(0, "nic", encode(r)) for r in records]).findings  # type: ignore[arg-type]
    return sorted(
        f"{f.evidence['level']}:{f.node}/{f.device}:{f.clear}"
        for f in found
        if f.detector == "fabric"
    )


def test_single_and_batched_nic_records_reach_the_partition_s_fabric_detector() -> None:
    cfg = EngineConfig(topology=infer_topology(NODES, rails=2, nodes_per_leaf=2, spines=2))
    messages = list(nic_samples({"node-2", "node-3"}, 300))
    expected = ["leaf:None/pod1-rail0:False", "nic:node-2/mlx5_0:False", "nic:node-3/mlx5_0:False"]
    for batched in (False, True):
        node = DetectionCore(cfg)
        assert _hot_spots(node, messages, batched) == expected
        assert fabric_key(0) in node.nodes.live


def test_a_restored_fabric_detector_gets_its_topology_back_and_goes_on_alike() -> None:
    cfg = EngineConfig(topology=infer_topology(NODES, rails=2, nodes_per_leaf=2, spines=2))
    first = list(nic_samples({"node-5"}, 150))
    rest = [m for m in nic_samples({"node-5"}, 400) if m.ts > first[-1].ts]
    original = DetectionCore(cfg)
    _hot_spots(original, first, batched=False)
    restored = DetectionCore(cfg)
    for key, (obj, partition) in original.nodes.live.items():
        blob = seal(SECRET, key, obj)
        back = unseal(SECRET, key, blob)
        if key == fabric_key(0):
            assert back.topology is None and len(blob) < 20_000  # the topology stays out
        restored.nodes.live[key] = (back, partition)
    after = _hot_spots(restored, rest, batched=False)
    assert after == _hot_spots(original, rest, batched=False)
    assert "leaf:None/pod2-rail0:False" in after and "nic:node-5/mlx5_0:False" in after

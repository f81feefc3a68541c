"""NIC collector on a fake sysfs tree: discovery, cumulative counters, resets, bad files."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.agents.nic import NicCollector
from guard.schemas import NicSample, encode, parse_message

from .fake_sysfs import HW_COUNTERS, IB_COUNTERS, NET_STATISTICS, make_fake_sysfs, write

TS = 1767225600.0


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return make_fake_sysfs(tmp_path / "sys")


@pytest.fixture
def collector(sysfs: Path) -> Iterator[NicCollector]:
    c = NicCollector("node-3", sysfs, rescan_s=0.0)
    yield c
    c.close()


def _by_device(samples: list[NicSample]) -> dict[str, NicSample]:
    return {s.device: s for s in samples}


def _port(sysfs: Path, i: int) -> Path:
    return sysfs / "class" / "infiniband" / f"mlx5_{i}" / "ports" / "1"


def test_finds_every_rail_and_physical_nic_with_all_counters(collector: NicCollector) -> None:
    samples = _by_device(collector.sample(TS, "job-9"))
    assert sorted(samples) == ["eth0"] + [f"mlx5_{i}" for i in range(8)]  # lo is virtual
    s = samples["mlx5_3"]
    assert (s.port, s.netdev, s.link_up, s.speed_gbps, s.job) == (1, "ib3", True, 400.0, "job-9")
    assert set(s.counters) == set(IB_COUNTERS) | set(HW_COUNTERS) | set(NET_STATISTICS)
    assert s.counters["port_xmit_data"] == 10**12 + 3
    eth = samples["eth0"]
    assert (eth.port, eth.netdev, eth.link_up, eth.speed_gbps) == (0, "eth0", True, 25.0)
    for sample in samples.values():
        assert parse_message(encode(sample)) == sample


def test_counters_are_published_cumulative_and_resets_as_they_are(
    collector: NicCollector, sysfs: Path
) -> None:
    counters = _port(sysfs, 2) / "counters"
    collector.sample(TS, None)
    write(counters / "symbol_error", 5000)
    write(counters / "link_downed", 4000)
    grown = _by_device(collector.sample(TS + 1, None))["mlx5_2"].counters
    assert (grown["symbol_error"], grown["link_downed"]) == (5000, 4000)
    write(counters / "symbol_error", 0)  # perfquery -R, driver reload: back to zero
    write(counters / "port_xmit_data", 17)
    reset = _by_device(collector.sample(TS + 2, None))["mlx5_2"].counters
    assert reset["symbol_error"] == 0 and reset["port_xmit_data"] == 17


def test_link_state_and_rate(collector: NicCollector, sysfs: Path) -> None:
    write(_port(sysfs, 5) / "state", "1: DOWN")
    write(_port(sysfs, 6) / "rate", "200 Gb/sec (2X NDR)")
    write(_port(sysfs, 7) / "rate", "garbage")
    samples = _by_device(collector.sample(TS, None))
    assert samples["mlx5_5"].link_up is False
    assert samples["mlx5_6"].speed_gbps == 200.0
    assert samples["mlx5_7"].speed_gbps is None and samples["mlx5_7"].link_up is True


def test_an_unreadable_counter_is_dropped_not_fatal(collector: NicCollector, sysfs: Path) -> None:
    write(_port(sysfs, 1) / "hw_counters" / "out_of_buffer", "N/A")
    for second in range(2):
        s = _by_device(collector.sample(TS + second, None))["mlx5_1"]
        assert "out_of_buffer" not in s.counters and "out_of_sequence" in s.counters
    assert collector.errors >= 1


def test_a_hot_removed_device_leaves_the_samples(collector: NicCollector, sysfs: Path) -> None:
    assert len(collector.sample(TS, None)) == 9
    shutil.rmtree(sysfs / "class" / "infiniband" / "mlx5_7")  # unplug: device and netdev go
    shutil.rmtree(sysfs / "class" / "net" / "ib7")
    assert "mlx5_7" not in _by_device(collector.sample(TS + 1, None))
    assert len(collector.sample(TS + 2, None)) == 8


def test_a_host_without_rdma_or_sysfs_gives_no_samples(tmp_path: Path) -> None:
    collector = NicCollector("node-0", tmp_path / "nothing")
    assert collector.sample(TS, None) == []
    collector.close()

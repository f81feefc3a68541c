"""The CPU sweep checks for real (numpy on this host), the NIC check on a fake sysfs tree, and
``guard sweep run`` as the executors run it: one JSON line, exit 0 / 1 / 2."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from guard.agents.nic import NicCollector
from guard.config import Settings
from guard.kafka import make_producer, produce
from guard.schemas import NodeState, SweepResult, decode
from guard.sweeps.baselines import FleetBaseline
from guard.sweeps.checks import CPU_NOTE, CheckContext, run_sweep, select_checks
from guard.sweeps.checks.cpu import (
    CpuCountCheck,
    CpuMatmulCheck,
    CpuMemoryBandwidthCheck,
    CpuSoakCheck,
)
from guard.sweeps.checks.network import NicCheck
from guard.sweeps.service import read_sweeps

from ..agents.fake_sysfs import make_fake_sysfs, write

GUARD = [sys.executable, "-m", "guard.cli"]


def test_cpu_checks_measure_this_host() -> None:
    ctx = CheckContext(node="n1", cpu_soak_s=0.6)
    [matmul] = CpuMatmulCheck(size=512, runs=3).run(ctx)
    [memory] = CpuMemoryBandwidthCheck(mib=32, runs=3).run(ctx)
    [soak] = CpuSoakCheck(size=256, window_s=0.1).run(ctx)
    assert matmul.value > 0 and matmul.unit == "GFLOPS" and matmul.judged
    assert memory.value > 0 and memory.unit == "GB/s"
    assert soak.value > 0 and "windows of 0.10 s over 0.6 s" in soak.detail, soak.detail
    assert "median of 3 after a warm-up" in matmul.detail


def test_a_soak_that_slows_down_fails_by_itself() -> None:
    # A host that loses its pace under load: halfway through the soak, competing processes
    # take most of the CPUs (real load, as a throttled or oversubscribed host would see).
    hogs: list[subprocess.Popen[bytes]] = []

    def take_the_cpus() -> None:
        for _ in range(8 * (os.cpu_count() or 1)):  # outnumber whatever else runs here
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    timer = threading.Timer(1.5, take_the_cpus)
    timer.start()
    try:
        [soak] = CpuSoakCheck(size=256, window_s=0.25).run(CheckContext(node="n1", cpu_soak_s=4.5))
    finally:
        timer.cancel()
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert not soak.passed, soak.detail
    ratio = int(soak.detail.split("last third ")[1].split("%")[0])
    assert ratio < 75, soak.detail


def test_cpu_count_against_what_the_node_should_have() -> None:
    usable = len(os.sched_getaffinity(0))
    [ok] = CpuCountCheck().run(CheckContext(node="n", expected_cpus=usable))
    [bad] = CpuCountCheck().run(CheckContext(node="n", expected_cpus=usable + 64))
    [unset] = CpuCountCheck().run(CheckContext(node="n"))
    assert ok.passed and not bad.passed and unset.passed
    assert f"expected {usable + 64}" in bad.detail
    assert "no expected count configured" in unset.detail
    assert ok.detail.startswith("sku=cpu:")


def test_a_cpu_host_runs_the_cpu_checks_says_so_and_is_judged_by_the_fleet_only() -> None:
    checks = select_checks(["cpu_count", "cpu_matmul"], gpu=False, sweep="single")
    sku = f"cpu:{CpuCountCheck().run(CheckContext(node='x'))[0].detail[8:].split(';')[0]}"
    fleet = FleetBaseline({sku: {"cpu_matmul_gflops": (1e6, 10)}})  # a fleet far faster
    result = run_sweep(CheckContext(node="n1", expected_gpus=0), checks, fleet)
    assert [c.name for c in result.checks] == ["cpu_count", "cpu_matmul_gflops", "sweep_coverage"]
    assert all(c.detail.startswith(CPU_NOTE) for c in result.checks[:2])
    matmul, covered = result.checks[1], result.checks[2]
    assert not matmul.passed and not result.passed
    assert "CPU host: no floor, fleet baseline only" in matmul.detail
    assert "below the fleet median 1e+06 GFLOPS of 10 passing" in matmul.detail
    # what the verdict covered: a node declared GPU-less, judged by the fleet median
    assert covered.passed and covered.detail.startswith("kind=cpu (declared GPU-less)")
    assert "judged: cpu_matmul_gflops vs fleet median 1e+06" in covered.detail
    with pytest.raises(ValueError, match="unknown CPU check"):
        select_checks(["gemm_bf16"], gpu=False, sweep="single")


def test_the_nic_check_fails_a_slow_port_and_errors_that_grew_during_the_sweep(
    tmp_path: Path,
) -> None:
    root = make_fake_sysfs(tmp_path, rails=4)
    port = root / "class" / "infiniband" / "mlx5_2" / "ports" / "1"
    write(root / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "rate", "200 Gb/sec (4X HDR)")
    ctx = CheckContext(node="n1", nic=NicCollector("n1", root), expected_nic_gbps=400)
    check = NicCheck()
    check.start(ctx)
    before = int((port / "counters" / "symbol_error").read_text())
    write(port / "counters" / "symbol_error", before + 17)
    write(port / "counters" / "port_xmit_data", 10**12 + 5000)
    results = {r.name: r for r in check.run(ctx)}
    bad = sorted(n for n, r in results.items() if not r.passed)
    assert bad == ["nic_errors:mlx5_2/1", "nic_link_gbps:mlx5_1/1"]
    assert results["nic_errors:mlx5_2/1"].value == 17
    assert "symbol_error +17" in results["nic_errors:mlx5_2/1"].detail
    assert "200 Gb/s, expected 400" in results["nic_link_gbps:mlx5_1/1"].detail
    # eth0 is a plain NIC: up is enough, the RDMA rate does not apply to it.
    assert results["nic_link_gbps:eth0/0"].passed


#: A node declared GPU-less, with the site floors a CPU host needs to be judged at all.
CPU_NODE = {
    "GUARD_SWEEP_EXPECTED_GPUS": "0",
    "GUARD_SWEEP_FLOORS": '{"cpu_memory_bandwidth_gbps": 0.5, "cpu_matmul_gflops": 1}',
}


def run_guard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "GUARD_SWEEP_FLEET_SOURCE": "none", **CPU_NODE, **(env or {})}
    return subprocess.run(
        [*GUARD, "sweep", "run", *args],
        check=False,
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def test_guard_sweep_run_json_prints_one_sweep_line_and_exits_by_the_verdict() -> None:
    done = run_guard("--json", "--node", "cpu-node-1", "--checks", "cpu_count,cpu_memory")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    result = decode(line, "sweep")
    assert isinstance(result, SweepResult) and result.passed and result.node == "cpu-node-1"
    names = ["cpu_count", "cpu_memory_bandwidth_gbps", "sweep_coverage"]
    assert [c.name for c in result.checks] == names
    assert "CPU (no GPU on this host) path" in done.stderr
    assert "sweep.fleet_source is none" in result.checks[1].detail
    assert "above the site floor of 0.5 GB/s" in result.checks[1].detail
    failed = run_guard("--json", "--checks", "cpu_count", env={"GUARD_SWEEP_EXPECTED_CPUS": "4096"})
    assert failed.returncode == 1
    assert not decode(failed.stdout.strip(), "sweep").passed  # type: ignore[attr-defined]


def test_guard_sweep_run_table_and_usage_errors() -> None:
    done = run_guard("--checks", "cpu_count", "--node", "n9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CPU path: no GPU on this host, so the CPU checks ran")
    assert "single-node sweep of n9: PASSED" in done.stdout
    unknown = run_guard("--checks", "gemm_bf16")
    assert unknown.returncode == 2 and "unknown CPU check(s) gemm_bf16" in unknown.stderr
    multi = run_guard("--sweep", "multi")
    assert multi.returncode == 2 and "--sweep multi needs --peers" in multi.stderr


@pytest.mark.kafka
def test_published_sweeps_become_the_next_sweeps_fleet_baseline(kafka_settings: Settings) -> None:
    env = {
        "GUARD_KAFKA_BOOTSTRAP": kafka_settings.kafka.bootstrap,
        "GUARD_KAFKA_TOPIC_PREFIX": kafka_settings.kafka.topic_prefix,
        "GUARD_SWEEP_FLEET_SOURCE": "topic",
        "GUARD_SWEEP_FLEET_MIN_SWEEPS": "2",
    }
    for node in ("peer-a", "peer-b"):
        done = run_guard(
            "--json", "--publish", "--node", node, "--checks", "cpu_count,cpu_memory", env=env
        )
        assert done.returncode == 0, done.stderr
        assert f"published to {kafka_settings.topic('sweeps')}" in done.stderr
    published = read_sweeps(kafka_settings, timeout_s=30)
    assert sorted(s.node for s in published) == ["peer-a", "peer-b"]
    # not yet back in the pool (the orchestrator has not released them): no baseline
    done = run_guard("--json", "--node", "me", "--checks", "cpu_count,cpu_memory", env=env)
    memory = decode(done.stdout.strip(), "sweep").checks[1]  # type: ignore[attr-defined]
    assert "no fleet baseline yet" in memory.detail, memory.detail
    producer = make_producer(kafka_settings)
    for sweep in published:  # the orchestrator releases both after their sweeps
        release = NodeState(ts=sweep.ts + 1, node=sweep.node, state="healthy", actor="guard")
        produce(producer, kafka_settings, release)
    assert producer.flush(30) == 0
    done = run_guard("--json", "--node", "me", "--checks", "cpu_count,cpu_memory", env=env)
    memory = decode(done.stdout.strip(), "sweep").checks[1]  # type: ignore[attr-defined]
    assert "passing cpu:" in memory.detail and "sweeps" in memory.detail, memory.detail
    assert memory.baseline is not None and memory.baseline > 0

"""Sweep executors: the simulated one against the simulator's faults, the local one for real."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from guard.sweeps.executors import (
    DEFAULT_LOCAL_CHECKS,
    CheckCommand,
    LocalSubprocessExecutor,
    SimulatedFault,
    SimulatedSweepExecutor,
)

NOW = 1_767_226_500.0
PY = sys.executable


def failing(
    ex: SimulatedSweepExecutor, node: str, sweep: str, peers: list[str] | None = None
) -> list[str]:
    return [c.name for c in ex.run(node, sweep, peers or [], NOW) if not c.passed]


# Fault records as the simulator writes them (kinds, detail and slowdown ranges from it).
FAULTS = [
    (
        "thermal_throttle",
        2,
        None,
        0.08,
        {"temp_c": 90.5},
        {"single": ["gemm_tflops_gpu2", "gpu_temp_max_c", "sm_clock_min_mhz"], "multi": []},
    ),
    (
        "power_cap",
        1,
        None,
        0.05,
        {"power_limit_w": 480},
        {"single": ["gemm_tflops_gpu1", "sm_clock_min_mhz", "power_limit_min_w"], "multi": []},
    ),
    (
        "power_brake",
        0,
        None,
        0.3,
        {},
        {"single": ["gemm_tflops_gpu0", "sm_clock_min_mhz"], "multi": []},
    ),
    ("slow_gpu", 6, None, 0.05, {}, {"single": ["gemm_tflops_gpu6"], "multi": []}),
    (
        "degraded_nic",
        None,
        "mlx5_4",
        0.2,
        {"symbol_errors_per_s": 5.0},
        {
            "single": ["nic_symbol_errors"],
            "multi": ["nccl_allreduce_busbw_gbps", "ib_write_bw_min_gbps"],
        },
    ),
    (
        "nic_reduced_speed",
        None,
        "mlx5_1",
        1.0,
        {"speed_gbps": 200.0},
        {
            "single": ["nic_link_speed_min_gbps"],
            "multi": ["nccl_allreduce_busbw_gbps", "ib_write_bw_min_gbps"],
        },
    ),
    (
        "link_flap",
        None,
        "mlx5_7",
        0.0,
        {"flaps": 3, "hang_s": 8.0},
        {"single": ["nic_link_downed"], "multi": []},
    ),
    ("xid", 5, None, 0.0, {"xid": 31}, {"single": ["xid_errors"], "multi": []}),
    ("ecc_dbe", 4, None, 0.0, {"xid": 48}, {"single": ["ecc_dbe_errors"], "multi": []}),
]


@pytest.mark.parametrize(
    "kind,gpu,device,slowdown,detail,expected", FAULTS, ids=[f[0] for f in FAULTS]
)
def test_each_fault_fails_the_checks_it_would_fail_on_real_hardware(
    kind: str, gpu: int | None, device: str | None, slowdown: float, detail: dict, expected: dict
) -> None:
    fault = SimulatedFault("node-003", kind, NOW - 100, None, slowdown, gpu, device, "f-1", detail)
    ex = SimulatedSweepExecutor([fault], seed=7)
    assert failing(ex, "node-003", "single") == expected["single"]
    assert failing(ex, "node-003", "multi", ["node-004", "node-005"]) == expected["multi"]
    # Its neighbours pass, whatever the noise.
    for node in ("node-004", "node-005", "node-006"):
        assert failing(ex, node, "single") == []
        assert failing(ex, node, "multi", ["node-007"]) == []


def test_a_fault_counts_only_while_it_is_active_and_degrading_faults_ramp() -> None:
    ended = SimulatedFault("n1", "slow_gpu", NOW - 1000, NOW - 10, 0.3, gpu=1)
    later = SimulatedFault("n2", "slow_gpu", NOW + 10, None, 0.3, gpu=1)
    ramp = SimulatedFault("n3", "slow_gpu", NOW - 60, None, 0.25, gpu=2, detail={"ramp_s": 1200})
    ex = SimulatedSweepExecutor([ended, later, ramp])
    assert failing(ex, "n1", "single") == []
    assert failing(ex, "n2", "single") == []
    # 60 s into a 20-minute ramp the GPU is ~1 % slower: within tolerance; at the end it is not.
    assert failing(ex, "n3", "single") == []
    assert ramp.slowdown_at(NOW + 1200) == pytest.approx(0.25)
    late = [c for c in ex.run("n3", "single", [], NOW + 1200) if not c.passed]
    assert [c.name for c in late] == ["gemm_tflops_gpu2"]
    assert late[0].value == pytest.approx(700 / 1.25, rel=0.03)


def test_a_peer_with_a_slow_nic_fails_the_multi_node_sweep() -> None:
    bad_peer = SimulatedFault("n9", "degraded_nic", NOW - 10, None, 0.4, device="mlx5_2")
    ex = SimulatedSweepExecutor([bad_peer])
    checks = ex.run("n1", "multi", ["n9"], NOW)
    assert not checks[0].passed and "slowest n9 mlx5_2" in checks[0].detail


def test_the_truth_file_is_read(tmp_path: Path) -> None:
    truth = {
        "version": 1,
        "seed": 3,
        "start_ts": NOW - 3600,
        "end_ts": NOW + 3600,
        "nodes": ["node-000", "node-001"],
        "gpus_per_node": 4,
        "jobs": [],
        "faults": [
            {
                "id": "f-0001",
                "node": "node-001",
                "gpu": 3,
                "device": None,
                "kind": "thermal_throttle",
                "category": "thermal",
                "onset": NOW - 60,
                "end": None,
                "slowdown": 0.12,
                "pattern": "steady",
                "detail": {},
            }
        ],
        "confounders": [],
    }
    path = tmp_path / "truth.json"
    path.write_text(json.dumps(truth))
    ex = SimulatedSweepExecutor.from_truth(path)
    assert ex.gpus_per_node == 4 and ex.seed == 3
    assert "gemm_tflops_gpu3" in failing(ex, "node-001", "single")
    assert len([c for c in ex.run("node-000", "single", [], NOW) if c.name.startswith("gemm")]) == 4


def test_local_checks_run_real_commands_and_judge_their_numbers() -> None:
    ex = LocalSubprocessExecutor(
        [
            {
                "name": "bw",
                "command": [PY, "-c", "print('busbw: 371.5 GB/s')"],
                "unit": "GB/s",
                "pattern": r"busbw: ([\d.]+)",
                "min": 300,
                "baseline": 360,
            },
            {"name": "temp", "command": f'{PY} -c "print(91)"', "max": 85, "unit": "C"},
            {
                "name": "node",
                "command": [PY, "-c", "import sys; print(len(sys.argv[1]))", "{node}"],
                "min": 8,
                "max": 8,
            },
            {
                "name": "peers",
                "sweep": "multi",
                "min": 2,
                "command": [PY, "-c", "import sys; print(len(sys.argv[1].split(',')))", "{peers}"],
            },
        ]
    )
    assert ex.sweep_kinds == ("single", "multi")
    bw, temp, node = ex.run("node-001", "single", [], 0.0)
    assert (bw.value, bw.passed, bw.baseline) == (371.5, True, 360)
    assert (temp.value, temp.passed) == (91.0, False)
    assert (node.value, node.passed) == (8.0, True)
    [peers] = ex.run("node-001", "multi", ["node-002", "node-003"], 0.0)
    assert (peers.value, peers.passed) == (2.0, True)


def test_local_checks_fail_on_errors_timeouts_and_missing_numbers() -> None:
    ex = LocalSubprocessExecutor(
        [
            CheckCommand(
                name="exit", command=[PY, "-c", "import sys; sys.exit('no GPU found')"], min=0
            ),
            CheckCommand(
                name="slow", command=[PY, "-c", "import time; time.sleep(30)"], min=0, timeout_s=0.5
            ),
            CheckCommand(name="words", command=[PY, "-c", "print('all good')"], min=0),
            CheckCommand(name="missing", command=["/nonexistent/dcgmi", "diag"], min=0),
        ]
    )
    results = {c.name: c for c in ex.run("n1", "single", [], 0.0)}
    assert not any(c.passed for c in results.values())
    assert "exited 1: no GPU found" in results["exit"].detail
    assert "timed out after 0.5 s" in results["slow"].detail
    assert "no number" in results["words"].detail
    assert "could not run" in results["missing"].detail


def test_a_check_needs_a_bound_and_the_default_check_runs() -> None:
    with pytest.raises(ValueError, match="needs a min or a max"):
        CheckCommand(name="x", command="true")
    [gemm] = LocalSubprocessExecutor(DEFAULT_LOCAL_CHECKS).run("localhost", "single", [], 0.0)
    assert gemm.name == "host_gemm_gflops" and gemm.passed and gemm.value > 1.0

"""The sweep fails closed: a node that should have GPUs never passes without them.

On this GPU-less host, ``guard sweep run --json`` with 8 GPUs expected is run for every way a
GPU can be missing — NVML that does not start (no library here; a driver/library mismatch
through the NVML stand-in), NVML that answers for 0 or for 7 GPUs, CPU checks only — and must
never say passed. The GPU path with fewer GPUs than expected runs in-process on the recorded
H100 values (no GPU here). The orchestrator's side, :func:`parse_sweep_output`, checks what a
verdict covered against the scheduler's count.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from guard.schemas import SweepCheck, SweepResult, decode
from guard.sweeps.baselines import FleetBaseline
from guard.sweeps.checks import CheckContext, run_sweep, select_checks
from guard.sweeps.executors import parse_sweep_output

from .test_checks_gpu import RECORDED, RecordedNvml, RecordedTorch

GUARD = [sys.executable, "-m", "guard.cli"]
STANDIN = Path(__file__).with_name("nvml_standin")
#: Floors for the CPU checks, so that only what the GPUs do decides the verdict.
FLOORS = '{"cpu_memory_bandwidth_gbps": 0.5, "cpu_matmul_gflops": 1, "cpu_soak_gflops": 1}'
CHECK_SETS = [
    None,  # the default set of this host
    "cpu_count",
    "cpu_count,cpu_matmul,cpu_memory",
    "cpu_count,cpu_matmul,cpu_memory,cpu_soak",
]


def sweep_run(
    checks: str | None, nvml: str | None, expected: str | None = "8"
) -> tuple[int, str, str]:
    env = {**os.environ, "GUARD_SWEEP_FLEET_SOURCE": "none", "GUARD_SWEEP_FLOORS": FLOORS}
    env.pop("GUARD_SWEEP_EXPECTED_GPUS", None)
    if expected is not None:
        env["GUARD_SWEEP_EXPECTED_GPUS"] = expected
    if nvml is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), env.get("PYTHONPATH", "")])
        env["GUARD_TEST_NVML"] = nvml
    argv = [*GUARD, "sweep", "run", "--json", "--node", "n1", "--soak-s", "0.6"]
    if checks:
        argv += ["--checks", checks]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    return done.returncode, done.stdout, done.stderr


def coverage_of(stdout: str) -> tuple[SweepResult, SweepCheck]:
    [line] = stdout.splitlines()
    result = decode(line, "sweep")
    assert isinstance(result, SweepResult)
    return result, result.checks[-1]


@pytest.mark.parametrize("checks", CHECK_SETS)
@pytest.mark.parametrize(
    "nvml,why",
    [
        (None, "NVML not started: NVMLError_LibraryNotFound"),  # this host: no driver at all
        ("mismatch", "NVML not started: NVMLError: RM has detected an NVML/RM version mismatch"),
        ("gpus:0", "8 GPUs expected, 0 seen"),
    ],
    ids=["no-nvml-library", "nvml-init-fails", "zero-gpus"],
)
def test_eight_expected_gpus_missing_never_pass(checks: str | None, nvml: str | None, why: str):
    code, out, err = sweep_run(checks, nvml)
    result, covered = coverage_of(out)
    assert code == 1 and not result.passed, err
    assert covered.name == "sweep_coverage" and not covered.passed
    assert covered.value == 0 and covered.baseline == 8
    assert why in covered.detail, covered.detail
    assert "failed: a GPU node is not judged on CPU checks" in covered.detail
    if checks == "cpu_count,cpu_matmul,cpu_memory":  # they measured and passed by themselves
        assert all(c.passed for c in result.checks[:-1]), result.checks


def test_nvml_answering_for_fewer_gpus_without_a_gpu_backend_never_passes() -> None:
    code, out, err = sweep_run("cpu_count", "gpus:7")
    assert code == 1 and out == "", out
    assert "7 NVIDIA GPU(s) but torch with CUDA is not importable" in err


def test_a_node_declared_gpu_less_passes_on_cpu_checks_and_an_undeclared_one_is_untested() -> None:
    code, out, err = sweep_run("cpu_count,cpu_memory", None, expected="0")
    result, covered = coverage_of(out)
    assert code == 0 and result.passed and covered.passed, err
    assert covered.detail.startswith("kind=cpu (declared GPU-less); 0 GPUs seen of 0 expected")
    assert "judged: cpu_memory_bandwidth_gbps vs site floor 0.5" in covered.detail
    code, out, _ = sweep_run("cpu_count,cpu_memory", None, expected=None)
    result, covered = coverage_of(out)
    assert code == 1 and not result.passed and covered.baseline is None
    assert "untested: no GPU count declared for this node" in covered.detail
    # NVML that starts and answers for no GPU on a node declared GPU-less: the same pass
    code, out, _ = sweep_run("cpu_count", "gpus:0", expected="0")
    assert code == 0 and coverage_of(out)[1].passed


def test_a_throughput_with_neither_floor_nor_fleet_baseline_is_untested() -> None:
    env = {**os.environ, "GUARD_SWEEP_FLEET_SOURCE": "none", "GUARD_SWEEP_EXPECTED_GPUS": "0"}
    argv = [*GUARD, "sweep", "run", "--json", "--checks", "cpu_count,cpu_memory"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    result, covered = coverage_of(done.stdout)
    assert done.returncode == 1 and not result.passed
    memory = result.checks[1]
    assert not memory.passed and "untested: neither a floor nor a fleet baseline" in memory.detail
    assert "set sweep.floors.cpu_memory_bandwidth_gbps" in memory.detail
    assert "untested: neither a floor nor a fleet baseline for cpu_memory_bandwidth_gbps" in (
        covered.detail
    )


def gpu_sweep(gpus: int, names: list[str], expected: int | None = 8) -> SweepResult:
    doc = copy.deepcopy(RECORDED)
    del doc["gpus"][gpus:]
    ctx = CheckContext(
        node="gpu-node-07",
        gpu=RecordedTorch(doc),
        nvml=RecordedNvml(doc),
        scale=0.01,
        expected_gpus=expected,
    )
    return run_sweep(ctx, select_checks(names, gpu=True, sweep="single"), FleetBaseline({}))


@pytest.mark.parametrize("names", [["gemm_bf16"], ["gemm_bf16", "gpu_health"], ["hbm"]])
def test_fewer_gpus_than_expected_fail_whatever_checks_ran(names: list[str]) -> None:
    result = gpu_sweep(7, names)
    covered = result.checks[-1]
    assert not result.passed and not covered.passed
    assert (covered.value, covered.baseline) == (7, 8)
    assert "failed: 8 GPUs expected, 7 seen" in covered.detail
    whole = gpu_sweep(8, ["gemm_bf16", "gpu_health"])
    assert whole.passed and whole.checks[-1].passed, whole.checks[-1].detail
    assert "judged: gemm_bf16_tflops vs H100 SXM floor 585" in whole.checks[-1].detail


def test_gpus_on_a_node_declared_gpu_less_fail_it() -> None:
    result = gpu_sweep(8, ["gemm_bf16"], expected=0)
    assert not result.passed
    assert "failed: declared GPU-less (expected 0) but 8 GPUs seen" in result.checks[-1].detail


def test_a_gpu_check_without_a_floor_or_fleet_is_untested_on_a_gpu_node() -> None:
    doc = copy.deepcopy(RECORDED)
    for gpu in doc["gpus"]:
        gpu["name"] = "NVIDIA L40S"  # a SKU without shipped floors, and no fleet yet
    ctx = CheckContext(
        node="n", gpu=RecordedTorch(doc), nvml=RecordedNvml(doc), scale=0.01, expected_gpus=8
    )
    checks = select_checks(["gemm_bf16", "gpu_health"], gpu=True, sweep="single")
    result = run_sweep(ctx, checks, FleetBaseline({}))
    assert not result.passed
    gemm = next(c for c in result.checks if c.name.startswith("gemm_bf16_tflops"))
    assert not gemm.passed and "untested: neither a floor nor a fleet baseline" in gemm.detail
    assert "for gemm_bf16_tflops" in result.checks[-1].detail


def line(node: str, checks: list[SweepCheck]) -> str:
    return SweepResult(
        id="s", ts=1.0, node=node, sweep="single", checks=checks, passed=True
    ).model_dump_json()


def test_the_orchestrator_checks_what_a_verdict_covered_before_it_releases() -> None:
    cpu_pass = [
        SweepCheck(name="cpu_count", value=2, unit="count", passed=True),
        SweepCheck(name="sweep_coverage", value=0, unit="gpus", baseline=0, passed=True),
    ]
    # a passing CPU verdict for a node the scheduler says has 8 GPUs
    checks = parse_sweep_output("n1", ["srun"], 0, line("n1", cpu_pass), "", expected_gpus=8)
    bad = [c for c in checks if not c.passed]
    assert [c.name for c in bad] == ["sweep_gpus_expected"]
    assert "has 8 GPUs; the sweep was judged against 0 expected GPUs, it saw 0" in bad[0].detail
    # the same line for a node declared GPU-less is a pass
    assert all(c.passed for c in parse_sweep_output("n1", ["srun"], 0, line("n1", cpu_pass), "", 0))
    # a line that does not say what it covered (an older guard on the node) is untested
    old = parse_sweep_output("n1", ["ssh"], 0, line("n1", cpu_pass[:1]), "")
    assert [(c.name, c.passed) for c in old][-1] == ("sweep_uncovered", False)
    assert "does not say what it covered" in old[-1].detail

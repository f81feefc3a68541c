"""The DCGM diagnostics check on recorded ``dcgmi diag -j`` output (see tests/data/sweeps/README).

No GPU and no nv-hostengine here: a stand-in ``dcgmi`` on PATH (tests/sweeps/dcgmi_standin)
prints a recorded document and exits as dcgmi would. Faults are injected into the recorded
documents explicitly, one per test.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from guard.sweeps.baselines import FleetBaseline
from guard.sweeps.checks import CheckContext, run_sweep, select_checks
from guard.sweeps.checks.base import run_timed
from guard.sweeps.checks.dcgm import DcgmDiagCheck, parse_diag

from .test_checks_gpu import RECORDED, RecordedNvml, RecordedTorch

DATA = Path(__file__).resolve().parent.parent / "data" / "sweeps"
STANDIN = Path(__file__).with_name("dcgmi_standin")
DCGM4 = DATA / "dcgmi_diag_r3_dcgm4_8gpu.json"
DCGM31 = DATA / "dcgmi_diag_r1_dcgm3.1_8gpu.txt"
T400 = DATA / "dcgmi_diag_r3_dcgm3_t400_skipped.json"
NVVS_ERROR = 226  # dcgmi's exit when a test failed: DCGM_ST_NVVS_ERROR (-30) as a byte


@pytest.fixture
def dcgmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Put the stand-in on PATH; ``play(doc_or_path, exit)`` sets what it replays."""
    monkeypatch.setenv("PATH", f"{STANDIN}{os.pathsep}{os.environ['PATH']}")
    calls = tmp_path / "argv"
    monkeypatch.setenv("GUARD_TEST_DCGMI_ARGV", str(calls))

    def play(doc: Path | dict[str, Any] | str, exit_code: int = 0) -> Path:
        if isinstance(doc, Path):
            path = doc
        else:
            path = tmp_path / "dcgmi.out"
            path.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
        monkeypatch.setenv("GUARD_TEST_DCGMI_OUTPUT", str(path))
        monkeypatch.setenv("GUARD_TEST_DCGMI_EXIT", str(exit_code))
        return calls

    return play


def diag(gpus: int = 8, level: int = 3, skip_ok: tuple[str, ...] = ()) -> list[Any]:
    ctx = CheckContext(node="gpu-node-07", expected_gpus=gpus, dcgm_level=level)
    ctx.dcgm_skip_ok = skip_ok
    return run_timed(DcgmDiagCheck(), ctx)


def dcgm4() -> dict[str, Any]:
    return json.loads(DCGM4.read_text())


def test_a_recorded_healthy_dcgm4_level3_run_passes_and_runs_the_asked_level(dcgmi) -> None:
    calls = dcgmi(DCGM4)
    [result] = diag(level=3)
    assert calls.read_text() == "diag -r 3 -j\n"
    assert (result.name, result.value, result.passed) == ("dcgm:diagnostic", 0.0, True)
    assert result.detail == "level 3: gpu0-7 Pass"


def test_a_failing_gpu_fails_the_node_and_says_what_dcgm_said(dcgmi) -> None:
    doc = dcgm4()
    [test] = doc["DCGM Diagnostic"]["test_categories"][0]["tests"]
    test["results"][3]["status"] = "Fail"
    test["results"][3]["warnings"] = [
        {
            "error_category": 3,
            "error_id": 50,
            "error_severity": 2,
            "warning": "GPU 3 Diagnostic: found 12 miscompares",
        }
    ]
    test["test_summary"]["status"] = "Fail"
    dcgmi(doc, NVVS_ERROR)
    [result] = diag()
    assert not result.passed and result.value == 1.0
    assert "gpu3 Fail (GPU 3 Diagnostic: found 12 miscompares [error 50])" in result.detail
    assert "gpu0-2, gpu4-7" not in result.detail and "gpu0, gpu1, gpu2" in result.detail


@pytest.mark.parametrize("status", ["Warn", "Skip"])
def test_a_warned_or_skipped_gpu_is_not_a_pass(dcgmi, status: str) -> None:
    doc = dcgm4()
    doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][6]["status"] = status
    dcgmi(doc)
    [result] = diag()
    assert not result.passed
    assert f"gpu6 {status}" in result.detail
    assert ("untested" in result.detail) == (status == "Skip")


def test_a_gpu_without_a_result_or_an_expected_gpu_dcgm_never_saw_is_untested(dcgmi) -> None:
    doc = dcgm4()
    del doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][5]  # not run: left out
    dcgmi(doc)
    [result] = diag()
    assert not result.passed and "gpu5 no result — untested" in result.detail
    dcgmi(DCGM4)
    [result] = diag(gpus=9)  # the node should have 9: dcgmi tested 8
    assert not result.passed and "gpu8 no result — untested" in result.detail


def test_a_recorded_dcgm3_level1_run_with_text_before_it_and_nulls_inside_passes(dcgmi) -> None:
    dcgmi(DCGM31)
    results = diag(level=1)
    deployment = (
        "denylist nvml_library cuda_main_library permissions_and_os_related_blocks "
        "persistence_mode environmental_variables page_retirement_row_remap graphics_processes "
        "inforom software"
    )
    assert [r.name for r in results] == [f"dcgm:{t}" for t in deployment.split()]
    assert all(r.passed for r in results), [r.detail for r in results]
    assert results[0].detail == "level 1, DCGM 3.1.0: gpu0-7 Pass"


def test_a_recorded_dcgm3_run_that_skipped_everything_is_untested_not_passed(dcgmi) -> None:
    dcgmi(T400)
    results = diag(gpus=1)
    skipped = "pcie gpu_memory diagnostic eud_test targeted_stress"
    assert [r.name for r in results] == [f"dcgm:{t}" for t in skipped.split()]
    assert not any(r.passed for r in results)
    assert results[0].detail == "level 3: gpu0 Skip — untested"
    # a site may declare a test that cannot run on its parts allowed to skip; only that one
    allowed = diag(gpus=1, skip_ok=("eud_test",))
    assert [r.name for r in allowed if r.passed] == ["dcgm:eud_test"]
    assert allowed[3].detail == "level 3: gpu0 Skip, allowed"


@pytest.mark.parametrize(
    "output,exit_code,says",
    [
        (
            '{"DCGM Diagnostic": {"runtime_error": "Couldn\'t connect to the host engine", '
            '"version": "4.2.3"}}',
            NVVS_ERROR,
            "level 3, DCGM 4.2.3: Couldn't connect to the host engine",
        ),
        ("Error: unable to establish a connection to 127.0.0.1\n", 255, "no JSON document"),
        ('{"DCGM Diagnostic": {"test_categories": []}}', 0, "untested: level 3: dcgmi reported"),
        (DCGM4.read_text(), NVVS_ERROR, "dcgmi exited 226 although every test it reported passed"),
    ],
    ids=["runtime-error", "no-json", "no-test", "exit-without-failure"],
)
def test_dcgmi_that_errs_or_reports_nothing_fails_the_node(
    dcgmi, output: str, exit_code: int, says: str
) -> None:
    dcgmi(output, exit_code)
    results = diag()
    assert not all(r.passed for r in results)
    assert any(says in r.detail for r in results), [r.detail for r in results]


def gpu_node(names: list[str] | None, dcgmi_name: str = "dcgmi") -> Any:
    ctx = CheckContext(
        node="gpu-node-07",
        gpu=RecordedTorch(copy.deepcopy(RECORDED)),
        nvml=RecordedNvml(copy.deepcopy(RECORDED)),
        scale=0.01,
        expected_gpus=8,
        dcgmi=dcgmi_name,
        dcgm_level=2,
    )
    leave = [] if names else ["nic", "ib_write_bw", "dcgm", "soak", "nccl"]
    checks = select_checks(names, gpu=True, sweep="single", leave_out=leave)
    return run_sweep(ctx, checks, FleetBaseline({}))


def test_dcgm_asked_for_on_a_gpu_node_without_dcgmi_is_untested_and_left_out_otherwise() -> None:
    result = gpu_node(["gpu_health", "dcgm"], dcgmi_name="no-dcgmi-here")
    dcgm = next(c for c in result.checks if c.name == "dcgm")
    assert not result.passed and not dcgm.passed
    assert dcgm.detail.startswith("untested: no-dcgmi-here not found on PATH")
    # not asked for and not installed: the default set leaves it out (guard sweep run does)
    assert "dcgm" not in [c.name for c in gpu_node(None).checks]


def test_dcgm_in_a_whole_gpu_sweep_decides_the_verdict(dcgmi) -> None:
    dcgmi(DCGM4)
    passed = gpu_node(["gpu_health", "dcgm"])
    assert passed.passed, [(c.name, c.detail) for c in passed.checks if not c.passed]
    doc = dcgm4()
    doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][0]["status"] = "Fail"
    dcgmi(doc, NVVS_ERROR)
    failed = gpu_node(["gpu_health", "dcgm"])
    assert not failed.passed
    assert [c.name for c in failed.checks if not c.passed] == ["dcgm:diagnostic"]


def test_the_parser_reads_both_shapes_of_the_recorded_documents() -> None:
    four, three = parse_diag(DCGM4.read_text()), parse_diag(DCGM31.read_text())
    assert [t.name for t in four.tests] == ["diagnostic"]
    assert sorted(four.tests[0].status) == list(range(8))
    assert three.version == "3.1.0" and three.tests[0].status == {g: "Pass" for g in range(8)}

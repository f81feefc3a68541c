"""The GPU sweep checks on recorded values: torch timings and NVML readings of an H100 node.

No GPU here: the two library boundaries (the torch backend's timings, the ``pynvml``
module) are stood in for by replays of tests/data/sweeps/h100_sxm_sweep.json (see its
README). Each test injects one fault into those values and checks that exactly the checks
that fault should fail, fail — and say why.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from guard.schemas.nvml_codes import HW_SLOWDOWN, SW_POWER_CAP, XID_GPU_LOST
from guard.sweeps.baselines import FleetBaseline
from guard.sweeps.checks import CheckContext, run_sweep, select_checks
from guard.sweeps.checks.base import CheckResult
from guard.sweeps.checks.network import IbWriteBwCheck, NcclAllReduceCheck, parse_ib_write_bw
from guard.sweeps.checks.nvml_health import XidCheck

DATA = Path(__file__).resolve().parent.parent / "data" / "sweeps"


def FLOORS_OF(sku: str, fam: str) -> str:
    from guard.sweeps.baselines import FLOORS

    return FLOORS[sku][fam].describe()


RECORDED = json.loads((DATA / "h100_sxm_sweep.json").read_text())


class RecordedTorch:
    """The :class:`~guard.sweeps.checks.gpu_backend.GpuBackend` methods, replaying timings."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.burned: list[int] = []

    def device_count(self) -> int:
        return len(self.doc["gpus"])

    def gemm_ms(self, gpu: int, dtype: str, n: int, samples: int) -> list[float]:
        assert n == 8192
        return list(self.doc["gpus"][gpu]["gemm_ms"][dtype][:samples])

    def copy_ms(self, gpu: int, kind: str, nbytes: int, samples: int) -> list[float]:
        return list(self.doc["gpus"][gpu]["copy_ms"][kind][:samples])

    def burn(self, gpus: list[int], stop: threading.Event) -> None:
        self.burned = list(gpus)
        stop.wait(30)

    def allreduce_ms(
        self, sizes: list[int], samples: int, rendezvous: str, node_rank: int, nodes: int
    ) -> dict[int, list[float]]:
        assert nodes == 1 and node_rank == 0
        recorded = self.doc["allreduce_ms"]["single_node_8gpu"]
        return {size: recorded[str(size)][:samples] for size in sizes}


class RecordedNvml:
    """The ``pynvml`` functions the sweep calls, with pynvml's own constants and errors.

    Soak samples advance one recorded cycle per sampling round (a read of GPU 0's
    temperature); ``push_xid`` delivers an Xid event as the driver would.
    """

    def __init__(self, doc: dict[str, Any]) -> None:
        self.gpus = doc["gpus"]
        self.rounds = -1
        self.events: list[Any] = []
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError

    def push_xid(self, gpu: int, xid: int) -> None:
        self.events.append(SimpleNamespace(device=gpu, eventData=xid, eventType=0))

    def _soak(self, h: int) -> dict[str, Any]:
        cycles = self.gpus[h]["soak"]
        return cycles[min(max(self.rounds, 0), len(cycles) - 1)]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self.gpus[h]["name"])

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.gpus[h]["bus_id"].encode())

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        return int(self.gpus[h]["ecc_volatile_uncorrected"])

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, ...]:
        return tuple(self.gpus[h]["remapped_rows"])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        value = self.gpus[h]["retired_pages_pending"]
        if value == "not_supported":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(value)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=p) for p in self.gpus[h].get("processes", [])]

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return int(self.gpus[h]["power_limit_mw"]["enforced"])

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return int(self.gpus[h]["power_limit_mw"]["default"])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return int(self.gpus[h]["pcie"]["gen"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return int(self.gpus[h]["pcie"]["max_gen"])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return int(self.gpus[h]["pcie"]["width"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return int(self.gpus[h]["pcie"]["max_width"])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        if h == 0:
            self.rounds += 1
        return int(self._soak(h)["temp_c"])

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return int(self._soak(h)["sm_clock_mhz"])

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._soak(h)["power_mw"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return int(self._soak(h)["clock_event_reasons"])

    def nvmlDeviceGetTemperatureThreshold(self, h: int, which: int) -> int:
        assert which == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return int(self.gpus[h]["slowdown_temp_c"])

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: object) -> None:
        assert types & pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        if self.events:
            return self.events.pop(0)
        threading.Event().wait(timeout_ms / 1000 / 20)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass


def node() -> dict[str, Any]:
    return copy.deepcopy(RECORDED)


def sweep(
    doc: dict[str, Any], names: list[str] | None = None, fleet: FleetBaseline | None = None
) -> dict[str, Any]:
    context = CheckContext(
        node="gpu-node-07",
        gpu=RecordedTorch(doc),
        nvml=RecordedNvml(doc),
        soak_s=30,
        scale=0.01,
        expected_gpus=8,
        expected_bus_ids=[g["bus_id"] for g in RECORDED["gpus"]],
    )
    # no NIC and no dcgmi on this recorded node: guard sweep run leaves both out
    checks = select_checks(names, gpu=True, sweep="single", leave_out=["nic", "dcgm"])
    result = run_sweep(context, checks, fleet or FleetBaseline({}))
    return {"result": result, "by": {c.name: c for c in result.checks}}


def failing(out: dict[str, Any]) -> list[str]:
    return [c.name for c in out["result"].checks if not c.passed]


def test_a_healthy_h100_node_passes_every_gpu_check_and_is_judged_by_its_floors() -> None:
    out = sweep(node())
    assert failing(out) == [] and out["result"].passed
    by = out["by"]
    gemms = {f"gemm_{d}_tflops:gpu{g}" for d in ("bf16", "fp16", "tf32") for g in range(8)}
    assert gemms <= set(by)
    bf16 = by["gemm_bf16_tflops:gpu0"]
    assert 700 < bf16.value < 740 and bf16.unit == "TFLOPS"
    assert bf16.baseline == pytest.approx(585)  # 90 % of a typical 650, marked unverified
    assert "above the H100 SXM floor of 585 TFLOPS" in bf16.detail
    assert "median of 10 after 2 warm-up" in bf16.detail
    assert 2800 < by["hbm_copy_gbps:gpu3"].value < 3000
    h2d = by["h2d_gbps:gpu0"]
    assert 52 < h2d.value < 55 and h2d.baseline == 48
    assert by["pcie_link_gen:gpu0"].detail.startswith("gen5 x16 under load, max gen5 x16")
    busbw = by["nccl_allreduce_busbw_gbps"]
    assert 470 < busbw.value < 490 and busbw.baseline == 460
    assert "judged at 8 GiB" in busbw.detail
    assert by["gpu_count"].detail.startswith("sku=H100 SXM; 8 GPUs at 00000000:18:00.0")
    # SW power cap under a full GEMM load is normal; so are corrected, remapped rows.
    assert any(c["clock_event_reasons"] == SW_POWER_CAP for c in RECORDED["gpus"][0]["soak"])
    assert RECORDED["gpus"][1]["remapped_rows"][0] == 2
    assert by["remapped_rows_pending_or_failed"].passed
    assert by["soak_temp_max_c:gpu0"].baseline == 87


def test_a_slow_gpu_fails_its_gemm_checks_under_the_floor() -> None:
    doc = node()
    for dtype in ("bf16", "fp16", "tf32"):
        doc["gpus"][3]["gemm_ms"][dtype] = [ms * 1.35 for ms in doc["gpus"][3]["gemm_ms"][dtype]]
    out = sweep(doc, ["gemm_bf16", "gemm_tf32", "gpu_health"])
    assert failing(out) == ["gemm_bf16_tflops:gpu3", "gemm_tf32_tflops:gpu3"]
    assert "under the H100 SXM floor of 585 TFLOPS" in out["by"]["gemm_bf16_tflops:gpu3"].detail
    assert "under the H100 SXM floor of 292.5 TFLOPS" in out["by"]["gemm_tf32_tflops:gpu3"].detail


def test_the_fleet_median_fails_a_gpu_more_than_5_percent_below_it() -> None:
    fleet = FleetBaseline({"H100 SXM": {"gemm_tf32_tflops": (400.0, 12)}})
    out = sweep(node(), ["gemm_tf32", "gpu_health"], fleet=fleet)
    tf32 = out["by"]["gemm_tf32_tflops:gpu0"]
    assert not tf32.passed and tf32.baseline == 400.0
    assert "below the fleet median 400 TFLOPS of 12 passing H100 SXM sweeps (> 5% fails)" in (
        tf32.detail
    )
    close = FleetBaseline({"H100 SXM": {"gemm_tf32_tflops": (390.0, 12)}})
    assert sweep(node(), ["gemm_tf32", "gpu_health"], fleet=close)["result"].passed
    too_few = FleetBaseline({"H100 SXM": {"gemm_tf32_tflops": (400.0, 2)}})
    out = sweep(node(), ["gemm_tf32"], fleet=too_few)
    assert out["result"].passed
    assert (
        "fleet baseline from 2 sweeps only (needs 3)" in out["by"]["gemm_tf32_tflops:gpu0"].detail
    )


def test_the_soak_fails_throttling_a_clock_deficit_and_the_slowdown_temperature() -> None:
    doc = node()
    for cycle in doc["gpus"][5]["soak"][1:]:
        cycle["clock_event_reasons"] = HW_SLOWDOWN | SW_POWER_CAP
        cycle["sm_clock_mhz"] = 1965
    for cycle in doc["gpus"][2]["soak"]:
        cycle["sm_clock_mhz"] = 1800
    for cycle in doc["gpus"][4]["soak"][1:]:
        cycle["temp_c"] = 87
    out = sweep(doc, ["soak", "gpu_health"])
    assert failing(out) == [
        "soak_sm_clock_mhz:gpu2",
        "soak_temp_max_c:gpu4",
        "soak_sm_clock_mhz:gpu5",
    ]
    by = out["by"]
    assert "below its siblings' median" in by["soak_sm_clock_mhz:gpu2"].detail
    assert "HW slowdown in" in by["soak_sm_clock_mhz:gpu5"].detail
    assert "slowdown temperature 87 C reached" in by["soak_temp_max_c:gpu4"].detail
    assert by["soak_sm_clock_mhz:gpu0"].detail.endswith("no trouble")


def test_a_link_trained_below_its_maximum_fails() -> None:
    doc = node()
    doc["gpus"][6]["pcie"].update(gen=4, width=8)
    out = sweep(doc, ["host_device"])
    assert failing(out) == ["pcie_link_gen:gpu6"]
    assert "gen4 x8 under load, max gen5 x16: the link trained below" in (
        out["by"]["pcie_link_gen:gpu6"].detail
    )


def test_nvml_health_fails_a_missing_gpu_uncorrectable_ecc_and_pending_remaps() -> None:
    doc = node()
    del doc["gpus"][7]  # fell off the bus
    doc["gpus"][2]["ecc_volatile_uncorrected"] = 3
    doc["gpus"][1]["remapped_rows"] = [2, 1, 1, 0]
    out = sweep(doc, ["gpu_health"])
    assert failing(out) == [
        "gpu_count",
        "ecc_uncorrectable",
        "remapped_rows_pending_or_failed",
        "sweep_coverage",  # 7 GPUs seen of 8
    ]
    by = out["by"]
    assert "expected 8; bus ids missing ['00000000:db:00.0']" in by["gpu_count"].detail
    assert by["ecc_uncorrectable"].detail.endswith("gpu2: 3")
    assert by["remapped_rows_pending_or_failed"].detail.endswith("gpu1: pending")
    assert by["retired_pages_pending"].passed  # NotSupported on a row-remapping part


def test_a_power_cap_below_the_default_limit_fails_on_one_gpu_or_node_wide() -> None:
    healthy = sweep(node(), ["gpu_health"])["by"]["power_limit_w:gpu0"]
    assert healthy.passed and (healthy.value, healthy.baseline) == (700, 700)
    assert healthy.detail == "enforced 700 W, default 700 W"
    one = node()
    one["gpus"][4]["power_limit_mw"]["enforced"] = 500_000  # nvidia-smi -i 4 -pl 500
    assert failing(sweep(one, ["gpu_health"])) == ["power_limit_w:gpu4"]
    rack = node()  # a node-wide cap (BMC, rack power budget): every GPU alike, no sibling lower
    for gpu in rack["gpus"]:
        gpu["power_limit_mw"]["enforced"] = 550_000
    out = sweep(rack, ["gpu_health"])
    assert failing(out) == [f"power_limit_w:gpu{g}" for g in range(8)]
    assert out["by"]["power_limit_w:gpu0"].detail == (
        "enforced 550 W, default 700 W: capped below its default (a power cap slows it)"
    )


def test_a_gpu_busy_with_another_process_when_the_sweep_starts_is_untested() -> None:
    idle = sweep(node(), ["gpu_health"])["by"]["gpu_processes"]
    assert idle.passed and idle.detail == "no other compute process on the GPUs"
    busy = node()
    busy["gpus"][2]["processes"] = [4711, os.getpid()]  # someone's job, and the sweep itself
    out = sweep(busy, ["gpu_health"])
    assert failing(out) == ["gpu_processes"]
    assert out["by"]["gpu_processes"].detail == (
        "untested: GPUs busy with other processes: gpu2: pid 4711"
    )


@pytest.mark.parametrize("xid,fails", [(XID_GPU_LOST, True), (74, True), (13, False)])
def test_an_xid_during_the_sweep_fails_it_unless_it_is_an_application_error(
    xid: int, fails: bool
) -> None:
    doc = node()
    nvml = RecordedNvml(doc)
    ctx = CheckContext(node="n", gpu=RecordedTorch(doc), nvml=nvml)
    check = XidCheck()
    check.start(ctx)
    nvml.push_xid(4, xid)
    threading.Event().wait(0.1)
    [result] = check.run(ctx)
    assert result.passed is not fails
    assert f"gpu4 xid {xid}" in result.detail


def test_all_reduce_busbw_under_the_floor_fails() -> None:
    doc = node()
    recorded = doc["allreduce_ms"]["single_node_8gpu"]
    recorded[str(8 << 30)] = [ms * 1.12 for ms in recorded[str(8 << 30)]]
    out = sweep(doc, ["nccl", "gpu_health"])
    busbw = out["by"]["nccl_allreduce_busbw_gbps"]
    assert failing(out) == ["nccl_allreduce_busbw_gbps"]
    assert "under the H100 SXM floor of 460 GB/s" in busbw.detail
    assert "nd96isr_h100_v5.conf: check_nccl_allreduce 460.0" in busbw.detail


def test_a_multi_node_all_reduce_needs_peers_and_a_rendezvous() -> None:
    ctx = CheckContext(node="n", gpu=RecordedTorch(node()))
    with pytest.raises(Exception, match="needs --peers and --rendezvous"):
        NcclAllReduceCheck(multi=True).run(ctx)


def test_ib_write_bw_output_is_parsed_and_judged_per_port(tmp_path: Path) -> None:
    recorded = (DATA / "ib_write_bw_ndr_mlx5_0.txt").read_text()
    assert parse_ib_write_bw(recorded) == 391.87
    assert parse_ib_write_bw("Couldn't connect to peer") is None
    # perftest at the process boundary: a stand-in that prints the recorded output.
    tool = tmp_path / "ib_write_bw"
    tool.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"print(open({str(DATA / 'ib_write_bw_ndr_mlx5_0.txt')!r}).read())\n"
        "sys.exit(0 if sys.argv[-1] == 'peer-1' else 1)\n"
    )
    tool.chmod(0o755)
    check = IbWriteBwCheck(timeout_s=10)
    # a GPU node: both ends in GPU memory (GPUDirect RDMA), judged on the GPUDirect floor
    ctx = CheckContext(
        node="n",
        gpu=RecordedTorch(node()),
        peers=["peer-1"],
        ib_write_bw=str(tool),
        rdma_devices=["mlx5_0"],
    )
    [result] = check.run(ctx)
    assert (result.name, result.value, result.passed) == (
        "ib_write_bw_gdr_gbps:mlx5_0",
        391.87,
        True,
    )
    assert "GPU memory (GPUDirect RDMA), to peer-1: " in result.detail
    assert f"{tool} -d mlx5_0 -p 18515 --report_gbits --use_cuda=0 peer-1" in result.detail
    from guard.sweeps.baselines import judge

    judge([result], "H100 SXM", FleetBaseline({}))
    assert result.passed and result.baseline == 380
    assert "check_ib_bw_gdr 380" in FLOORS_OF("H100 SXM", "ib_write_bw_gdr_gbps")
    # no GPU: host memory, judged on the host-memory floor of the port's rate, never GPUDirect's
    ports = SimpleNamespace(
        sample=lambda ts, job: [SimpleNamespace(device="mlx5_0", port=1, speed_gbps=400.0)]
    )
    host = CheckContext(
        node="n", peers=["peer-1"], nic=ports, ib_write_bw=str(tool), rdma_devices=["mlx5_0"]
    )
    [mem] = check.run(host)
    assert mem.name == "ib_write_bw_gbps:mlx5_0" and "--use_cuda" not in mem.detail
    judge([mem], "H100 SXM", FleetBaseline({}))
    assert mem.passed and mem.baseline == 390 and mem.against == "host-memory floor 390"
    assert "host memory, to peer-1" in mem.detail and "port at 400 Gb/s" in mem.detail
    slow = CheckResult("ib_write_bw_gbps:mlx5_0", 385.0, "Gb/s", judged=True, floor=mem.floor)
    [slow] = judge([slow], "H100 SXM", FleetBaseline({}))
    assert not slow.passed and "check_ib_bw_non_gdr 390" in slow.detail
    # As the peer, it serves; a server that exits non-zero fails its port.
    peer = CheckContext(
        node="p", peers=["n"], node_rank=1, ib_write_bw=str(tool), rdma_devices=["mlx5_0"]
    )
    [served] = check.run(peer)
    assert not served.passed and served.detail.startswith("host memory, server for n")

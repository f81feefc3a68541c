"""Network checks: NIC links and error counters, NCCL all-reduce busbw, RDMA write bandwidth.

- :class:`NicCheck` reads every port through ``ctx.nic`` (the agent's sysfs reader, passed in
  by the command) when the sweep starts and again when it ends: link state, rate against
  ``ctx.expected_nic_gbps``, and error-counter deltas over the sweep (the traffic phase is
  the sweep's own load: the all-reduce and ``ib_write_bw`` of a multi-node sweep).
- :class:`NcclAllReduceCheck` (multi-node): all-reduce over every GPU of the node and its
  peers at 1–8 GB messages; busbw = algbw × 2(n−1)/n, as nccl-tests reports it.
- :class:`IbWriteBwCheck` (multi-node): perftest's ``ib_write_bw`` per local RDMA port to the
  first peer (the peer runs the servers), when it is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Any

from .base import CheckContext, CheckError, CheckResult, median

__all__ = [
    "HOST_MEMORY_FLOORS",
    "NIC_ERROR_COUNTERS",
    "IbWriteBwCheck",
    "NcclAllReduceCheck",
    "NicCheck",
    "busbw",
    "parse_ib_write_bw",
]

#: Counters whose growth during a sweep means a bad link (sysfs and netdev names).
NIC_ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "rx_crc_errors",
    "rx_errors",
    "tx_errors",
)
_TRAFFIC = ("port_xmit_data", "port_rcv_data", "tx_bytes", "rx_bytes")


class NicCheck:
    """Per port: ``nic_link_gbps:<dev>/<port>`` (up; an RDMA port at ``expected_nic_gbps``)
    and ``nic_errors:<dev>/<port>`` (error counters that grew during the sweep)."""

    name = "nic"

    def __init__(self) -> None:
        self._before: dict[tuple[str, int], dict[str, int]] = {}
        self._started = 0.0

    def start(self, ctx: CheckContext) -> None:
        if ctx.nic is None:
            return
        self._started = time.monotonic()
        self._before = {(s.device, s.port): dict(s.counters) for s in ctx.nic.sample(0.0, None)}

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        if ctx.nic is None:
            raise CheckError("no NIC reader: the sweep command passes the agent's sysfs reader")
        if not self._before:
            self.start(ctx)
        window = time.monotonic() - self._started
        samples = ctx.nic.sample(time.time(), None)
        if not samples:
            raise CheckError("no NIC found under the sysfs root")
        out = []
        for s in samples:
            where = f"{s.device}/{s.port}"
            want = ctx.expected_nic_gbps if s.port > 0 else None  # the rate is the RDMA ports'

            slow = want is not None and (s.speed_gbps or 0) < want
            ok = s.link_up is not False and not slow
            rate = "unknown rate" if s.speed_gbps is None else f"{s.speed_gbps:g} Gb/s"
            out.append(
                CheckResult(
                    f"nic_link_gbps:{where}",
                    s.speed_gbps,
                    "Gb/s",
                    passed=ok,
                    baseline=want,
                    detail=f"link {'down' if s.link_up is False else 'up'}, {rate}"
                    + (f", expected {want:g}" if want is not None else ", no expected rate set")
                    + ("" if ok else ": below its rated speed or down"),
                )
            )
            out.append(self._errors(where, self._before.get((s.device, s.port), {}), s, window))
        return out

    @staticmethod
    def _errors(where: str, before: dict[str, int], sample: Any, window: float) -> CheckResult:
        grew = {}
        for name in NIC_ERROR_COUNTERS:
            if name in sample.counters and name in before:
                delta = sample.counters[name] - before[name]
                if delta > 0:
                    grew[name] = delta
        moved = sum(
            max(0, sample.counters.get(n, 0) - before.get(n, 0)) for n in _TRAFFIC if n in before
        )
        seen = ", ".join(f"{k} +{v}" for k, v in grew.items()) or "no error counter grew"
        return CheckResult(
            f"nic_errors:{where}",
            float(sum(grew.values())),
            "count",
            passed=not grew,
            baseline=0.0,
            detail=f"{seen} over {window:.0f} s of the sweep ({moved} traffic units moved)",
        )


def busbw(nbytes: int, ms: float, ranks: int) -> float:
    """Bus bandwidth in GB/s of an all-reduce of ``nbytes`` taking ``ms`` over ``ranks`` ranks.

    >>> round(busbw(8 << 30, 40.0, 16), 1)   # 8 GiB in 40 ms over 16 GPUs
    402.7
    """
    algbw = nbytes / (ms / 1e3) / 1e9
    return algbw * 2 * (ranks - 1) / ranks


class NcclAllReduceCheck:
    """Median busbw at the largest message (every size's in the detail).

    Alone (``multi=False``): the node's own GPUs over NVLink, ``nccl_allreduce_busbw_gbps``,
    judged against the per-SKU floor (Azure's 8-GPU numbers). With the peers: every GPU of
    node + peers, ``nccl_multinode_busbw_gbps``, judged against the fleet.
    """

    def __init__(
        self, multi: bool, sizes: tuple[int, ...] = (1 << 30, 2 << 30, 4 << 30, 8 << 30)
    ) -> None:
        self.multi, self.sizes = multi, sizes
        self.name = "nccl_multinode_busbw_gbps" if multi else "nccl_allreduce_busbw_gbps"

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        if ctx.gpu is None:
            raise CheckError("no GPU backend: install the [sweeps] extra (torch) on a GPU host")
        if self.multi and (not ctx.peers or not ctx.rendezvous):
            raise CheckError("a multi-node sweep needs --peers and --rendezvous HOST:PORT")
        peers = list(ctx.peers) if self.multi else []
        nodes = 1 + len(peers)
        rendezvous = (ctx.rendezvous or "") if self.multi else "127.0.0.1:29511"
        ranks = nodes * int(ctx.gpu.device_count())
        ctx.progress(f"all-reduce over {nodes} nodes, {ranks} GPUs")
        rank = ctx.node_rank if self.multi else 0
        times = ctx.gpu.allreduce_ms(self.sizes, 10, rendezvous, rank, nodes)
        per_size = {size: median([busbw(size, ms, ranks) for ms in times[size]]) for size in times}
        largest = max(per_size)  # judged where the bus saturates, as nccl-tests floors are
        sizes = ", ".join(f"{s >> 30} GiB {bw:.1f}" for s, bw in sorted(per_size.items()))
        return [
            CheckResult(
                self.name,
                per_size[largest],
                "GB/s",
                detail=f"with {', '.join(peers) or 'no peer'}: {ranks} GPUs on {nodes} "
                f"node(s); busbw by size (GB/s): {sizes}; judged at {largest >> 30} GiB",
                judged=True,
            )
        ]


#: ``ib_write_bw`` from host memory (no ``--use_cuda``) by port rate: Azure's non-GPUDirect
#: floors for its NDR 400, HDR 200 and EDR 100 hosts (azurehpc-health-checks@0e0a1ac).
HOST_MEMORY_FLOORS: dict[int, tuple[float, str]] = {
    400: (390.0, "azurehpc-health-checks@0e0a1ac conf/hb176rs_v4.conf: check_ib_bw_non_gdr 390"),
    200: (190.0, "azurehpc-health-checks@0e0a1ac conf/hb120rs_v3.conf: check_ib_bw_non_gdr 190"),
    100: (95.0, "azurehpc-health-checks@0e0a1ac conf/hc44rs.conf: check_ib_bw_non_gdr 95"),
}

_IB_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def _port_rates(ctx: CheckContext) -> dict[str, float]:
    """The rate of each RDMA device's first port, from the NIC reader (none: no floor)."""
    if ctx.nic is None:
        return {}
    return {
        s.device: s.speed_gbps
        for s in ctx.nic.sample(time.time(), None)
        if s.port == 1 and s.speed_gbps is not None
    }


def parse_ib_write_bw(output: str) -> float | None:
    """Average bandwidth (Gb/s) of the last row of ``ib_write_bw --report_gbits`` output."""
    rows = _IB_ROW.findall(output)
    return float(rows[-1][3]) if rows else None


class IbWriteBwCheck:
    """RDMA write bandwidth per port; node rank 0 is the client of peer 0.

    On a GPU node both ends write from and to GPU memory (``--use_cuda=<gpu>``, GPUDirect
    RDMA): ``ib_write_bw_gdr_gbps:<dev>``, judged on the SKU's GPUDirect floors. Without a GPU
    it is host memory: ``ib_write_bw_gbps:<dev>``, judged on the host-memory floor of the
    port's rate (:data:`HOST_MEMORY_FLOORS`). A GPUDirect floor never judges a host-memory
    number, nor the other way round.
    """

    name = "ib_write_bw"

    def __init__(self, base_port: int = 18515, timeout_s: float = 60) -> None:
        self.base_port, self.timeout_s = base_port, timeout_s

    @staticmethod
    def available(ctx: CheckContext) -> bool:
        return shutil.which(ctx.ib_write_bw) is not None

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        if not ctx.peers:
            raise CheckError("ib_write_bw needs a peer (--peers)")
        if not ctx.rdma_devices:
            raise CheckError("no RDMA device to test (sweep.rdma_devices, or none found)")
        devices = list(ctx.rdma_devices)
        server = ctx.node_rank != 0
        gpus = int(ctx.gpu.device_count()) if ctx.gpu is not None else 0
        family = "ib_write_bw_gdr_gbps" if gpus else "ib_write_bw_gbps"
        argvs = [
            [ctx.ib_write_bw, "-d", dev, "-p", str(self.base_port + i), "--report_gbits"]
            + ([f"--use_cuda={i % gpus}"] if gpus else [])
            + ([] if server else [ctx.peers[0]])
            for i, dev in enumerate(devices)
        ]
        rates = _port_rates(ctx) if not gpus else {}
        if server:  # every port listens at once; each client connects in turn
            procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True) for a in argvs]
            outputs = [self._wait(p) for p in procs]
        else:
            time.sleep(2.0)  # the peer's servers listen first
            outputs = [
                self._wait(subprocess.Popen(a, stdout=subprocess.PIPE, text=True)) for a in argvs
            ]
        out = []
        for dev, argv, (code, stdout) in zip(devices, argvs, outputs, strict=True):
            value = parse_ib_write_bw(stdout)
            role = "server for" if server else "to"
            memory = "GPU memory (GPUDirect RDMA)" if gpus else "host memory"
            rate = rates.get(dev)
            out.append(
                CheckResult(
                    f"{family}:{dev}",
                    value,
                    "Gb/s",
                    passed=value is not None and code == 0,
                    detail=f"{memory}, {role} {ctx.peers[0]}: {' '.join(argv)}"
                    + ("" if rate is None else f"; port at {rate:g} Gb/s")
                    + ("" if value is not None else f" gave no result (exit {code})"),
                    judged=value is not None,
                    floor=None if rate is None else HOST_MEMORY_FLOORS.get(int(rate)),
                )
            )
        return out

    def _wait(self, proc: subprocess.Popen[str]) -> tuple[int, str]:
        try:
            stdout, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return -9, ""
        return proc.returncode, stdout

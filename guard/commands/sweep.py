"""``guard sweep run``: the sweep checks on this host, judged, as one ``sweep`` message.

Exit status: 0 every check passed, 1 a check failed (or a runtime failure), 2 a usage error.
With ``--json`` standard output is exactly one line, the ``sweep`` message; progress goes to
standard error either way. This is what the ssh and Slurm executors run on the node.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from typing import Any

from guard.config import Settings, node_name
from guard.errors import GuardError, UsageError

from .common import add_log_level, configure_logging

__all__ = ["register"]


def _nvml() -> tuple[Any, str]:
    """``pynvml``, initialised, when an NVIDIA driver is here; else None and why not (the
    sweep's coverage fails a node that should have GPUs with that reason)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, a driver/library mismatch
        return None, f"{type(exc).__name__}: {exc}"[:300]
    return pynvml, ""


def _broker_listens(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """Whether the first bootstrap server accepts a TCP connection (spares librdkafka's
    retry log when no broker is there)."""
    host, _, port = bootstrap.split(",", maxsplit=1)[0].strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _fleet(settings: Settings, node: str) -> Any:
    """The fleet baseline from ClickHouse or the sweeps topic; an empty one says why not."""
    from guard.sweeps.baselines import (
        FleetBaseline,
        node_states_from_clickhouse,
        sweeps_from_clickhouse,
    )

    s = settings.sweep
    source = s.fleet_source
    if source == "auto":
        source = "clickhouse" if settings.clickhouse.dsn else "topic"
    if source == "none":
        return FleetBaseline({}, "sweep.fleet_source is none")
    try:
        if source == "clickhouse":
            from guard.store import connect

            client = connect(settings)
            try:
                past = sweeps_from_clickhouse(client, settings.clickhouse.database)
                since = min((p.ts for p in past), default=0.0)
                states = node_states_from_clickhouse(client, settings.clickhouse.database, since)
            finally:
                client.close()
        else:
            from guard.sweeps.service import read_node_states, read_sweeps

            if not _broker_listens(settings.kafka.bootstrap):
                raise ConnectionError(f"no broker listens at {settings.kafka.bootstrap}")
            past = read_sweeps(settings, timeout_s=5.0)
            views = read_node_states(settings, timeout_s=5.0, keep_history=True)
            states = [s for view in views.values() for s in view.history]
    except Exception as exc:  # no store or broker reachable: floors only, and say so
        where = "ClickHouse" if source == "clickhouse" else settings.topic("sweeps")
        return FleetBaseline({}, f"{where} unavailable: {str(exc)[:160]}")
    return FleetBaseline.from_sweeps(past, states, window=s.fleet_window, exclude_node=node)


def _context(args: argparse.Namespace, settings: Settings, node: str) -> tuple[Any, bool, list]:
    from guard.agents.nic import NicCollector
    from guard.sweeps.checks import CheckContext
    from guard.sweeps.checks.gpu_backend import torch_backend

    s = settings.sweep
    nvml, nvml_error = _nvml()
    gpus = nvml.nvmlDeviceGetCount() if nvml is not None else 0
    backend = torch_backend() if gpus else None
    if gpus and backend is None:
        raise GuardError(
            f"this host has {gpus} NVIDIA GPU(s) but torch with CUDA is not importable: "
            "install the sweep extra (pip install 'guard-telemetry[sweeps]') and run again"
        )
    nic = NicCollector(node, settings.agent.sysfs_root)
    rdma = list(s.rdma_devices) or sorted({dev for dev, port in nic.ports if port > 0})
    leave_out = []
    if not nic.ports and s.expected_nic_gbps is None:
        leave_out.append("nic")
    if not rdma or shutil.which(s.ib_write_bw) is None or args.node_rank > 1:
        leave_out.append("ib_write_bw")
    if shutil.which(s.dcgmi) is None:
        leave_out.append("dcgm")
    ctx = CheckContext(
        node=node,
        gpu=backend,
        nvml=nvml,
        nvml_error=nvml_error,
        nic=nic,
        expected_gpus=s.expected_gpus,
        expected_bus_ids=s.expected_bus_ids,
        expected_cpus=s.expected_cpus,
        expected_nic_gbps=s.expected_nic_gbps,
        soak_s=args.soak_s if args.soak_s is not None else s.soak_s,
        cpu_soak_s=args.soak_s if args.soak_s is not None else s.cpu_soak_s,
        cpu_soak_min_ratio=s.cpu_soak_min_ratio,
        peers=[p for p in (args.peers or "").split(",") if p],
        rendezvous=args.rendezvous,
        node_rank=args.node_rank,
        ib_write_bw=s.ib_write_bw,
        rdma_devices=rdma,
        dcgmi=s.dcgmi,
        dcgm_level=s.dcgm_level,
        dcgm_skip_ok=s.dcgm_skip_ok,
        progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
    )
    return ctx, backend is not None, leave_out


def _table(result: Any, durations: dict[str, float], cpu: bool) -> str:
    lines = []
    if cpu:
        lines.append("CPU path: no GPU on this host, so the CPU checks ran (numpy)")
    lines.append(f"{'check':34} {'value':>12} {'unit':7} {'baseline':>10} {'s':>6}  verdict")
    for c in result.checks:
        value = "-" if c.value is None else f"{c.value:.4g}"
        base = "-" if c.baseline is None else f"{c.baseline:.4g}"
        verdict = "pass" if c.passed else "FAIL"
        took = durations.get(c.name, 0.0)
        lines.append(f"{c.name:34} {value:>12} {c.unit:7} {base:>10} {took:6.1f}  {verdict}")
        lines.append(f"    {c.detail}")
    lines.append(
        f"{result.sweep}-node sweep of {result.node}: {'PASSED' if result.passed else 'FAILED'}"
    )
    return "\n".join(lines)


def cmd_sweep_run(args: argparse.Namespace, settings: Settings) -> int:
    from guard.schemas import encode
    from guard.sweeps.checks import run_sweep, select_checks

    configure_logging(args.log_level)
    if args.sweep == "multi" and not (args.peers and args.rendezvous):
        raise UsageError("--sweep multi needs --peers NODE[,NODE] and --rendezvous HOST:PORT")
    node = args.node or node_name(settings.agent.node)
    ctx, gpu, leave_out = _context(args, settings, node)
    names = [n for n in args.checks.split(",") if n] if args.checks else None
    try:
        checks = select_checks(names, gpu=gpu, sweep=args.sweep, leave_out=leave_out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fleet = _fleet(settings, node)
    kind = "GPU" if gpu else "CPU (no GPU on this host)"
    print(
        f"sweep of {node}: {kind} path, checks {', '.join(c.name for c in checks)}",
        file=sys.stderr,
        flush=True,
    )
    durations: dict[str, float] = {}

    def done(r: Any) -> None:
        durations[r.name] = r.duration_s
        verdict = "pass" if r.passed else "FAIL"
        value = "-" if r.value is None else f"{r.value:.4g} {r.unit}"
        print(f"{r.name}: {value} {verdict} ({r.duration_s:.1f} s)", file=sys.stderr, flush=True)

    result = run_sweep(
        ctx,
        checks,
        fleet,
        sweep=args.sweep,
        tolerance=settings.sweep.fleet_tolerance,
        on_result=done,
        min_sweeps=settings.sweep.fleet_min_sweeps,
        floors=settings.sweep.floors,
    )
    if args.json:
        sys.stdout.write(encode(result).decode() + "\n")
    else:
        print(_table(result, durations, not gpu))
    sys.stdout.flush()
    if args.publish:
        _publish(settings, result)
    return 0 if result.passed else 1


def _publish(settings: Settings, result: Any) -> None:
    from guard.kafka import make_producer, produce

    producer = make_producer(settings)
    produce(producer, settings, result)
    if producer.flush(15) != 0:
        raise GuardError(
            f"the sweep result was not delivered to {settings.kafka.bootstrap} "
            f"({settings.topic('sweeps')}); check GUARD_KAFKA_BOOTSTRAP and run again"
        )
    print(f"published to {settings.topic('sweeps')}", file=sys.stderr, flush=True)


def register(sub: Any, add: Any) -> None:
    """Add ``sweep run`` to the ``guard`` parser."""
    sweep = sub.add_parser("sweep", help="sweep checks on this node").add_subparsers(
        dest="sub", required=True
    )
    p = add("run", cmd_sweep_run, "run the sweep checks on this host and judge them", sweep)
    p.add_argument("--checks", help="comma-separated check names (default: all of this host's)")
    p.add_argument("--json", action="store_true", help="print the sweep message as one line")
    p.add_argument(
        "--node",
        help="node name (default: agent.node, else NODE_NAME, SLURMD_NODENAME, the host name)",
    )
    p.add_argument("--publish", action="store_true", help="also send it to the sweeps topic")
    p.add_argument("--sweep", choices=["single", "multi"], default="single")
    p.add_argument("--peers", help="multi: the other nodes of the all-reduce, comma-separated")
    p.add_argument("--rendezvous", help="multi: HOST:PORT of node rank 0 (the swept node)")
    p.add_argument("--node-rank", type=int, default=0, help="multi: 0 on the swept node")
    p.add_argument(
        "--soak-s", type=float, help="soak duration, s (default: sweep.soak_s, CPU: cpu_soak_s)"
    )
    add_log_level(p, "warning")

"""CLI subcommands of the agents room: ``guard simulate`` and ``guard agent``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from guard.config import Settings
from guard.errors import UsageError

from .common import (
    add_log_level,
    add_metrics_port,
    apply_options,
    non_negative_float,
    positive_float,
    positive_int,
)

__all__ = ["register"]


def cmd_simulate(args: argparse.Namespace, settings: Settings) -> int:
    from guard.agents.simulator import write_jsonl

    try:
        config = _sim_config(args)
    except ValueError as exc:
        raise UsageError(f"simulate: {exc}") from None
    started = time.monotonic()
    try:
        truth, counts = write_jsonl(config, args.out, workers=args.workers)
        truth.save(args.truth)
    except OSError as exc:
        raise UsageError(
            f"simulate: cannot write the output: {exc}; choose a writable --out and --truth"
        ) from None
    summary = {
        "out": args.out,
        "truth": args.truth,
        "messages": sum(counts.values()),
        "by_kind": counts,
        "faults": len(truth.faults),
        "confounders": len(truth.confounders),
        "wall_s": round(time.monotonic() - started, 2),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"simulated {config.nodes} nodes x {config.duration_s:g} s (seed {config.seed}): "
            f"{summary['messages']} messages {counts} -> {args.out}; "
            f"{summary['faults']} faults, {summary['confounders']} confounders -> {args.truth} "
            f"in {summary['wall_s']} s",
            file=sys.stderr,
        )
    return 0


def _sim_config(args: argparse.Namespace) -> Any:
    from guard.agents.simulator import ClusterSimulator, SimConfig

    faults = [_parse_fault(text) for text in args.fault or []]
    config = SimConfig(
        nodes=args.nodes,
        duration_s=args.duration,
        seed=args.seed,
        start_ts=args.start_ts,
        gpus_per_node=args.gpus_per_node,
        sample_interval_s=args.interval,
        step_s_nominal=args.step_s,
        faults=faults,
        random_faults=args.random_faults,
        severity=args.severity,
        confounders=not args.no_confounders,
        excluded=frozenset(args.exclude or ()),
    )
    ClusterSimulator(config)  # raises ValueError on a config that cannot run
    return config


def _parse_fault(text: str) -> Any:
    """``KIND[:node=NODE][:gpu=N][:onset=S][:end=S][:slowdown=X][:pattern=P]``."""
    from guard.agents.simulator import CATEGORY_BY_KIND, FaultSpec

    kind, *options = text.split(":")
    if kind not in CATEGORY_BY_KIND:
        raise ValueError(
            f"--fault {text!r}: unknown kind {kind!r}; known: {sorted(CATEGORY_BY_KIND)}"
        )
    spec = FaultSpec(kind)
    for option in options:
        name, _, value = option.partition("=")
        try:
            if name == "node":
                spec.node = value
            elif name == "gpu":
                spec.gpu = int(value)
            elif name == "onset":
                spec.onset_s = float(value)
            elif name == "end":
                spec.end_s = float(value)
            elif name == "slowdown":
                spec.slowdown = float(value)
            elif name == "pattern":
                spec.pattern = value
            else:
                raise ValueError(f"unknown option {name!r}")
        except ValueError as exc:
            raise ValueError(f"--fault {text!r}: {exc}") from None
    return spec


def cmd_agent(args: argparse.Namespace, settings: Settings) -> int:
    from guard.agents.daemon import run_agent

    apply_options(
        settings,
        args,
        {
            "agent.node": "node",
            "agent.job": "job",
            "agent.interval_s": "interval",
            "agent.socket_path": "socket",
            "agent.gpu_source": "gpu_source",
            "agent.dcgm_url": "dcgm_url",
            "agent.sysfs_root": "sysfs",
            "metrics.agent_port": "metrics_port",
        },
    )
    code: int = run_agent(args, settings)
    return code


def register(sub: Any, add: Any) -> None:
    """Add this room's subcommands to the ``guard`` parser."""
    p = add("simulate", cmd_simulate, "simulate a cluster with injected faults into JSONL + truth")
    p.add_argument("--nodes", type=positive_int, default=16)
    p.add_argument("--duration", type=positive_float, default=600.0, help="simulated seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="telemetry JSONL (one wire message a line)")
    p.add_argument("--truth", required=True, help="ground-truth JSON (docs/simulator-truth.md)")
    p.add_argument("--start-ts", type=float, default=1767225600.0, help="epoch s of the start")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument(
        "--interval", type=positive_float, default=1.0, help="agent sampling interval, s"
    )
    p.add_argument(
        "--step-s", type=positive_float, default=2.0, help="nominal step time of job-a, s"
    )
    p.add_argument(
        "--random-faults", type=int, default=None, help="faults drawn from the calibrated mix"
    )
    p.add_argument(
        "--fault",
        action="append",
        metavar="KIND[:node=N][:gpu=G][:onset=S][:end=S][:slowdown=X][:pattern=P]",
        help="inject this fault (repeatable); e.g. slow_gpu:node=node-003:gpu=2:onset=300",
    )
    p.add_argument("--severity", type=float, default=1.0, help="multiplies drawn slowdowns")
    p.add_argument("--no-confounders", action="store_true")
    p.add_argument("--exclude", action="append", help="node cordoned from the start")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="processes (default: one per CPU, up to 8)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    p = add("agent", cmd_agent, "node agent: sample GPUs and NICs, forward job timings to Kafka")
    p.add_argument(
        "--node", help="node name (default: $NODE_NAME, $SLURMD_NODENAME, the host name)"
    )
    p.add_argument("--job", help="job label (default: Slurm env, then what clients report)")
    p.add_argument(
        "--interval", type=positive_float, default=None, help="seconds (default from config)"
    )
    p.add_argument("--socket", help="Unix datagram socket of the training client")
    p.add_argument(
        "--gpu-source",
        choices=("nvml", "dcgm", "none"),
        help="GPU collector (default from config: nvml)",
    )
    p.add_argument("--dcgm-url", help="dcgm-exporter metrics URL (default from config)")
    p.add_argument("--sysfs", help="sysfs root (default /sys; tests use a fake tree)")
    p.add_argument("--simulate", action="store_true", help="publish a simulated cluster instead")
    p.add_argument(
        "--speed",
        type=non_negative_float,
        default=1.0,
        help="with --simulate: speed-up (0: as fast as possible)",
    )
    p.add_argument("--nodes", type=positive_int, default=16, help="with --simulate")
    p.add_argument(
        "--duration", type=positive_float, default=600.0, help="with --simulate: simulated s"
    )
    p.add_argument("--seed", type=int, default=0, help="with --simulate")
    p.add_argument("--truth", help="with --simulate: write the ground truth here")
    p.add_argument("--once", action="store_true", help="one sampling cycle, then exit")
    p.add_argument("--dry-run", action="store_true", help="print messages instead of publishing")
    add_metrics_port(p, "metrics.agent_port")
    add_log_level(p, "info")

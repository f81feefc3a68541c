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
    non_negative_int,
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
    jobs = [_parse_job(text) for text in args.job] if args.job else None
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
        jobs=jobs,
        clock_offset_s=args.clock_offset,
        job_lifetime_s=args.job_lifetime,
        job_gap_s=args.job_gap,
        warmup_steps=args.warmup_steps,
        warmup_extra=args.warmup_extra,
        hot_idle_nodes=args.hot_idle_nodes,
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


def _parse_job(text: str) -> Any:
    """``NAME:nodes=N[:stages=P][:step=S]``: a job placed on the next N free nodes."""
    from guard.agents.simulator import JobSpec

    name, *options = text.split(":")
    if not name or "=" in name:
        raise ValueError(f"--job {text!r}: begin with the job's name, e.g. job-a:nodes=8:step=6")
    fields: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        try:
            if key == "nodes":
                fields["nodes"] = int(value)
            elif key == "stages":
                fields["pp_stages"] = int(value)
            elif key == "step":
                fields["step_s_nominal"] = float(value)
            else:
                raise ValueError(f"unknown option {key!r} (nodes, stages, step)")
        except ValueError as exc:
            raise ValueError(f"--job {text!r}: {exc}") from None
    if fields.get("nodes", 0) < 1:
        raise ValueError(f"--job {text!r}: give nodes=N, N >= 1")
    if fields.get("pp_stages", 1) < 1 or not 0 < fields.get("step_s_nominal", 1.0) < float("inf"):
        raise ValueError(f"--job {text!r}: stages must be >= 1 and step a positive number")
    return JobSpec(name, **fields)


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
    p.add_argument(
        "--job",
        action="append",
        metavar="NAME:nodes=N[:stages=P][:step=S]",
        help="a job on the next N free nodes (repeatable; replaces the default job-a/job-b), "
        "P pipeline stages, S s nominal step; e.g. job-a:nodes=8:step=6",
    )
    p.add_argument(
        "--clock-offset",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="each host's clock off by a constant drawn in +-S seconds (default 0: off)",
    )
    p.add_argument(
        "--job-lifetime",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="job churn: each job ends after 0.5-1.5x S, a new one starts on its nodes "
        "(default 0: jobs run the whole run)",
    )
    p.add_argument(
        "--job-gap",
        type=non_negative_float,
        default=120.0,
        metavar="S",
        help="job churn: idle seconds between a job's end and the next (default 120)",
    )
    p.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=20,
        metavar="N",
        help="job churn: a new job's first N steps are slower (default 20)",
    )
    p.add_argument(
        "--warmup-extra",
        type=non_negative_float,
        default=0.5,
        metavar="X",
        help="job churn: the first warm-up step is 1+X times slower, easing to 1 (default 0.5)",
    )
    p.add_argument(
        "--hot-idle-nodes",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="N of the idle nodes run hot while idle: a confounder, not a fault (default 0)",
    )
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

"""``guard demo``: the whole pipeline on a simulated cluster."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from guard.config import Settings

from .common import add_log_level, apply_options, configure_logging, positive_float, positive_int

__all__ = ["register"]


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from guard.demo import DemoConfig, run_demo

    configure_logging(args.log_level)
    apply_options(settings, args, {"streams.engine": "engine"})
    config = DemoConfig(
        nodes=args.nodes,
        duration_s=args.duration,
        home=Path(args.home) if args.home else None,
        seed=args.seed,
        speed=args.speed,
        compression=args.compression,
        workers=args.workers,
        engine=settings.streams.engine,
    )
    run_demo(settings, config, as_json=args.json, report=Path(args.report) if args.report else None)
    return 0


def register(sub: Any, add: Any) -> None:
    """Add ``demo`` to the ``guard`` parser."""
    p = add("demo", cmd_demo, "run the whole pipeline on a simulated cluster (embedded)")
    p.add_argument("--nodes", type=positive_int, default=32, help="simulated nodes (8 GPUs each)")
    p.add_argument("--duration", type=positive_float, default=600, help="simulated seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--speed",
        type=positive_float,
        default=None,
        help="simulated seconds per wall second (default: what the workers keep up with)",
    )
    p.add_argument(
        "--compression",
        type=positive_float,
        default=10.0,
        help="the job's mechanics (NCCL watchdog, checkpoint interval, restart, re-crash, a "
        "person's drain) run this many times faster, together (default 10)",
    )
    p.add_argument("--workers", type=positive_int, default=1, help="streams worker processes")
    p.add_argument(
        "--engine",
        choices=["faust", "native"],
        default=None,
        help="streams transport (default from config: native)",
    )
    p.add_argument("--home", help="data directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument(
        "--report",
        metavar="FILE.html",
        help="also write the run as one self-contained HTML page (plots, opens offline)",
    )
    add_log_level(p, "warning")

"""CLI subcommands of the evaluation room: ``guard backtest`` and ``guard eval``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from guard.errors import GuardError

from .common import tune_gc_for_the_data_path

__all__ = ["register"]


def cmd_backtest(args: argparse.Namespace, settings: Any) -> int:
    from guard.evaluation.backtest import BacktestStats, make_detector, read_messages, run_backtest
    from guard.streams.processing import engine_config_of

    paths = [Path(p) for p in args.inputs]
    for path in paths:
        if not path.exists():
            raise GuardError(f"input {path} does not exist")
    stats = BacktestStats()
    detector = make_detector(args.detector, engine_config_of(settings))
    tune_gc_for_the_data_path()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("wb") as out:
        run_backtest(
            read_messages(paths, stats),
            out,
            detector,
            stats,
            progress=None if args.quiet else sys.stderr,
        )
    print(
        f"backtest ({args.detector}): {stats.messages:,} messages in {stats.seconds:.1f} s "
        f"({stats.rate:,.0f}/s), {stats.bad_lines} bad lines skipped; {stats.flags} flags "
        f"({stats.claims} warning/critical) -> {out_path}",
        file=sys.stderr,
    )
    return 0


def cmd_eval(args: argparse.Namespace, settings: Any) -> int:
    from guard.evaluation.scoring import evaluate, format_report, load_flags, load_truth

    for path in (args.truth, args.flags):
        if not Path(path).exists():
            raise GuardError(f"{path} does not exist")
    ev = evaluate(load_truth(args.truth), load_flags(args.flags), grace_s=args.grace)
    if args.json:
        print(json.dumps(ev.as_dict(), indent=2))
    else:
        print(format_report(ev))
    return 0


def register(sub: Any, add: Any) -> None:
    """Add this room's subcommands to the ``guard`` parser."""
    p = add("backtest", cmd_backtest, "run the detectors over recorded telemetry (JSONL) -> flags")
    p.add_argument("inputs", nargs="+", metavar="INPUT.jsonl", help="telemetry, one message a line")
    p.add_argument("--out", required=True, metavar="FLAGS.jsonl", help="where to write the flags")
    p.add_argument(
        "--detector",
        choices=("guard", "static", "nvrx"),
        default="guard",
        help="Guard's detectors (default) or a baseline: static alert rules, NVRx relative score",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")

    p = add("eval", cmd_eval, "score flags against simulator ground truth")
    p.add_argument("--truth", required=True, metavar="TRUTH.json")
    p.add_argument("--flags", required=True, metavar="FLAGS.jsonl")
    p.add_argument(
        "--grace",
        type=float,
        default=120.0,
        help="seconds after a fault's end that still count as detecting it (default 120)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

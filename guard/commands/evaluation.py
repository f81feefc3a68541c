"""CLI subcommands of the evaluation room: ``guard backtest`` and ``guard eval``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from guard.errors import GuardError, UsageError

from .common import tune_gc_for_the_data_path
from .replay import _epoch, is_clickhouse

__all__ = ["register"]


def cmd_backtest(args: argparse.Namespace, settings: Any) -> int:
    from guard.evaluation.backtest import BacktestStats, make_detector, read_messages, run_backtest
    from guard.streams.processing import engine_config_of

    out_path = Path(args.out)
    if not out_path.parent.is_dir():
        raise UsageError(f"backtest: --out {out_path}: folder {out_path.parent} does not exist")
    stats = BacktestStats()
    detector = make_detector(args.detector, engine_config_of(settings))
    client = None
    if is_clickhouse(args.inputs, "backtest"):
        client, messages, total = _clickhouse_messages(args, settings)
        unit = "messages"
    else:
        paths = [Path(p) for p in args.inputs]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise GuardError(
                f"backtest: {', '.join(missing)} not found (JSONL files, or `clickhouse` / a DSN)"
            )
        messages, total, unit = (
            read_messages(paths, stats, rows=args.detector == "guard"),
            sum(p.stat().st_size for p in paths),
            "bytes",
        )
    tune_gc_for_the_data_path()
    try:
        with out_path.open("wb") as out, _progress_bar(args.quiet, total, unit) as progress:
            run_backtest(messages, out, detector, stats, progress=progress)
    finally:
        if client is not None:
            client.close()
    if args.json:
        print(json.dumps({"detector": args.detector, "out": str(out_path), **stats.as_dict()}))
    else:
        print(
            f"backtest ({args.detector}): {stats.messages:,} messages in {stats.seconds:.1f} s "
            f"({stats.rate:,.0f}/s), {stats.bad_lines} bad lines skipped; {stats.flags} flags "
            f"({stats.claims} warning/critical) -> {out_path}",
            file=sys.stderr,
        )
    if stats.messages == 0:
        raise GuardError(
            f"backtest: no valid telemetry in {', '.join(args.inputs)} "
            f"({stats.bad_lines} bad lines); nothing was detected"
        )
    return 0


def _clickhouse_messages(args: argparse.Namespace, settings: Any) -> tuple[Any, Iterator[Any], int]:
    """The stored telemetry of ``--from``/``--to`` in event-time order (the replay's reader)."""
    from guard.store import connect
    from guard.streams.replay import BadRecord, ClickHouseSource, ReplayFilter

    if args.inputs[0] != "clickhouse":
        settings.clickhouse.dsn = args.inputs[0]
    client = connect(settings)
    source = ClickHouseSource(
        client, settings.clickhouse.database, ReplayFilter(args.start, args.end)
    )
    span = source.span()
    if span is None:
        client.close()
        raise GuardError(
            f"backtest: no telemetry in ClickHouse ({settings.clickhouse.database}) "
            "for that time range; store some with `guard sink`, or widen --from/--to"
        )
    good = (m for m in source.messages() if not isinstance(m, BadRecord))
    return client, good, span.count


@contextmanager
def _progress_bar(quiet: bool, total: int, unit: str) -> Iterator[Any]:
    """A rich progress bar on stderr (total, rate, time left) fed with backtest stats."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("backtest"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[messages]:,} messages, {task.fields[rate]:,.0f}/s"),
        TextColumn("{task.fields[flags]} flags"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
    )
    task = bar.add_task("backtest", total=total or None, messages=0, rate=0.0, flags=0)

    def update(stats: Any) -> None:
        done = stats.bytes_read if unit == "bytes" else stats.messages
        bar.update(
            task, completed=done, messages=stats.messages, rate=stats.rate, flags=stats.flags
        )

    with bar:
        yield update


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
    p = add("backtest", cmd_backtest, "run the detectors over recorded telemetry -> flags")
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="JSONL files (one message a line), or `clickhouse` / a ClickHouse DSN",
    )
    p.add_argument("--out", required=True, metavar="FLAGS.jsonl", help="where to write the flags")
    p.add_argument(
        "--detector",
        choices=("guard", "static", "nvrx"),
        default="guard",
        help="Guard's detectors (default) or a baseline: static alert rules, NVRx relative score",
    )
    p.add_argument(
        "--from",
        dest="start",
        type=_epoch,
        metavar="TIME",
        help="ClickHouse source: first event time (epoch s or ISO)",
    )
    p.add_argument(
        "--to",
        dest="end",
        type=_epoch,
        metavar="TIME",
        help="ClickHouse source: end of the time range (exclusive)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

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

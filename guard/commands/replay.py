"""`guard replay`: recorded telemetry (JSONL files or ClickHouse) back into the topics."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.errors import EXIT_INTERRUPTED, GuardError, UsageError

__all__ = ["register"]

DSN_SCHEMES = ("http://", "https://", "clickhouse://", "clickhouses://", "chdb://")

HELP = """\
SOURCE is one or more JSONL files (wire messages, one a line, e.g. from `guard simulate`),
or `clickhouse` (the configured clickhouse.dsn) or a ClickHouse DSN (http://user:pw@host:8123,
chdb:///path) read over --from/--to. Messages go out in event-time order to the telemetry
topics with the contract's keys (node for gpu/nic, job for step/collective); invalid lines go
to the dead-letter topic with the reason; flags, sweeps and node states are skipped.

--retime now (default) shifts every event time by one offset so that the replay ends at the
present (the last event is stamped when it is sent; with --speed 1 the replay looks live):
the topics' time retention (kafka.telemetry_retention_hours) would otherwise delete a replay
of old telemetry at once, and Kafka 4.x refuses records stamped more than 1 h in the future.
Flags then come out at the shifted times. --retime keep sends the recorded times unchanged.
"""


def _epoch(text: str) -> float:
    """Epoch seconds, or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither epoch seconds nor an ISO 8601 time (e.g. 2026-01-01T10:00)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def is_clickhouse(sources: list[str], command: str = "replay") -> bool:
    """Whether ``sources`` name ClickHouse (``clickhouse`` or a DSN) rather than JSONL files;
    one ClickHouse source or files, never both (a usage error of ``command``)."""
    if any(s == "clickhouse" or s.startswith(DSN_SCHEMES) for s in sources):
        if len(sources) > 1:
            raise UsageError(f"{command}: give one ClickHouse source, or JSONL files, not both")
        return True
    return False


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics
    from guard.shutdown import stop_on_signals
    from guard.streams.replay import ClickHouseSource, JsonlSource, Replayer, ReplayFilter

    if args.speed < 0:
        raise UsageError("replay: --speed must be 0 (as fast as possible) or more")
    only = ReplayFilter(args.start, args.end, args.nodes, args.jobs)
    client = None
    source: Any
    if is_clickhouse(args.sources):
        from guard.store import connect

        if args.sources[0] != "clickhouse":
            settings.clickhouse.dsn = args.sources[0]
        client = connect(settings)
        source = ClickHouseSource(client, settings.clickhouse.database, only)
        _something_stored(source, settings, args)
    else:
        paths = [Path(p) for p in args.sources]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise GuardError(
                f"replay: {', '.join(missing)} not found (a JSONL file, or `clickhouse` / a DSN)"
            )
        source = JsonlSource(paths, only)
    create_topics(settings)
    try:
        with stop_on_signals() as stop:
            stats = _run_with_bar(Replayer(settings), source, args, stop)
    finally:
        if client is not None:
            client.close()
    _summarise(stats, args)
    if stats.failed:
        raise GuardError(
            f"replay: the broker did not take {stats.failed} records ({stats.first_error}); "
            "with --retime keep, records stamped more than 1 h ahead are refused by Kafka 4.x "
            "and old ones fall to retention: use --retime now"
        )
    return EXIT_INTERRUPTED if stats.interrupted else 0


def _something_stored(source: Any, settings: Settings, args: argparse.Namespace) -> None:
    """A store without Guard's tables, or without telemetry in the selection, is one line
    saying so (not the driver's exception, not an empty replay that exits 0)."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    where = (
        f"ClickHouse at {settings.masked()['clickhouse']['dsn']} "
        f"(database {settings.clickhouse.database!r})"
    )
    try:
        span = source.span()
    except ClickHouseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GuardError(
            f"replay: {where} has no Guard tables to read ({first}): nothing was stored there; "
            "run `guard sink` (or `guard db migrate`) against it first, or give the DSN "
            "Guard stores in"
        ) from None
    if span is None:
        chosen = [
            f"{option} {value}"
            for option, value in (
                ("--from", args.start),
                ("--to", args.end),
                ("--nodes", ",".join(sorted(args.nodes)) if args.nodes else None),
                ("--jobs", ",".join(sorted(args.jobs)) if args.jobs else None),
            )
            if value is not None
        ]
        selection = f" for {' '.join(chosen)}" if chosen else ""
        raise GuardError(
            f"replay: {where} holds no telemetry{selection}: nothing to replay"
            + ("; widen the selection" if chosen else "; is a `guard sink` storing into it?")
        )


def _run_with_bar(replayer: Any, source: Any, args: argparse.Namespace, stop: Any) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    console = Console(stderr=True)
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns,
        TimeRemainingColumn(),
        console=console,
        disable=args.quiet,
    ) as bar:
        task = bar.add_task("replay", total=None)

        def progress(sent: int, total: int) -> None:
            bar.update(task, completed=sent, total=total or None)

        return replayer.run(source, args.speed, args.retime, stop, progress)


def _summarise(stats: Any, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(stats.as_dict()))
        return
    kinds = ", ".join(f"{kind} {n:,}" for kind, n in sorted(stats.by_kind.items())) or "none"
    shift = f"event times shifted by {stats.shift_s:+,.0f} s" if stats.shift_s else "times kept"
    print(
        f"replayed {stats.messages:,} messages ({kinds}) in {stats.seconds:.1f} s "
        f"({stats.rate:,.0f}/s); {shift}; {stats.dead_letters} dead letters, "
        f"{stats.skipped} not telemetry skipped" + (", interrupted" if stats.interrupted else ""),
        file=sys.stderr,
    )


def register(sub: Any, add: Any) -> None:
    """Add ``replay`` to the ``guard`` parser."""
    p = add("replay", cmd_replay, "replay JSONL or ClickHouse telemetry into the topics")
    p.description = HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="JSONL files, or clickhouse/DSN")
    p.add_argument(
        "--from",
        dest="start",
        type=_epoch,
        metavar="TIME",
        help="first event time (epoch s or ISO)",
    )
    p.add_argument(
        "--to", dest="end", type=_epoch, metavar="TIME", help="end of the time range (exclusive)"
    )
    p.add_argument("--nodes", type=_names, help="only these nodes (comma-separated)")
    p.add_argument("--jobs", type=_names, help="only these jobs (comma-separated)")
    p.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="0: as fast as the broker takes it (default); 1: real time; N: N x faster",
    )
    p.add_argument(
        "--retime",
        choices=("now", "keep"),
        default="now",
        help="now: shift event times so the replay ends now (default; see above); keep: unchanged",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

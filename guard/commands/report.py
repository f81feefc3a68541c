"""``guard report``: one self-contained HTML page of a run, from JSONL files or ClickHouse."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.errors import GuardError

__all__ = ["read_store", "register"]

_STEPS = """SELECT job, step, max(toUnixTimestamp64Micro(ts)) / 1e6 AS end_ts, any(step_s)
FROM `{db}`.`step_timings` WHERE job IS NOT NULL GROUP BY job, step ORDER BY end_ts"""
_FLAGS = """SELECT toUnixTimestamp64Micro(ts) / 1e6, node, job, id, detector, category, severity,
score, gpu, device, rank FROM `{db}`.`flags` FINAL ORDER BY ts"""
_STATES = """SELECT toUnixTimestamp64Micro(ts) / 1e6, node, state, prev, reason, actor
FROM `{db}`.`node_states` FINAL ORDER BY ts"""


def read_store(client: Any, database: str) -> list[Any]:
    """The run's steps (one per job and step), flags and node states, read from ClickHouse."""
    from guard.schemas import Flag, NodeState, StepTiming

    messages: list[Any] = []
    for job, step, end_ts, step_s in client.query(_STEPS.format(db=database)).result_rows:
        messages.append(StepTiming(ts=end_ts, node="-", job=job, rank=0, step=step, step_s=step_s))
    for row in client.query(_FLAGS.format(db=database)).result_rows:
        ts, node, job, fid, detector, category, severity, score, gpu, device, rank = row
        messages.append(
            Flag(
                ts=ts,
                node=node or None,
                job=job,
                id=fid,
                detector=detector,
                category=category,
                severity=severity,
                score=score,
                gpu=gpu,
                device=device,
                rank=rank,
            )
        )
    for ts, node, state, prev, reason, actor in client.query(
        _STATES.format(db=database)
    ).result_rows:
        messages.append(
            NodeState(ts=ts, node=node, state=state, prev=prev, reason=reason, actor=actor)
        )
    return sorted(messages, key=lambda m: m.ts)


def _read_jsonl(paths: list[str]) -> list[Any]:
    from guard.evaluation.backtest import BacktestStats, read_messages

    for p in paths:
        if not Path(p).exists():
            raise GuardError(f"input {p} does not exist")
    stats = BacktestStats()
    messages = list(read_messages([Path(p) for p in paths], stats))
    if stats.bad_lines:
        print(f"guard report: {stats.bad_lines} bad lines skipped in {paths}", file=sys.stderr)
    return messages


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    from guard.evaluation.report import from_messages, render_html
    from guard.schemas.truth import Truth

    if args.jsonl:
        messages = _read_jsonl(args.jsonl)
        source = ", ".join(args.jsonl)
    else:
        from guard.store import connect

        if args.store:
            settings.clickhouse.dsn = args.store
        database = settings.clickhouse.database
        try:
            messages = read_store(connect(settings), database)
        except GuardError:
            raise
        except Exception as exc:
            raise GuardError(
                f"cannot read the run from ClickHouse database {database!r}: "
                f"{str(exc).splitlines()[0]}; store one with `guard sink` (or `guard demo --home "
                "DIR`), or give --jsonl FILES"
            ) from exc
        source = "ClickHouse"
        if not messages:
            raise GuardError(
                f"no step timings, flags or node states in database "
                f"{settings.clickhouse.database!r}; run `guard sink` (or `guard demo --home DIR`) "
                "first, or give --jsonl FILES"
            )
    if args.truth and not Path(args.truth).exists():
        raise GuardError(f"truth file {args.truth} does not exist")
    truth = Truth.load(args.truth) if args.truth else None
    baseline = _read_jsonl(args.baseline) if args.baseline else []
    data = from_messages(messages, baseline, truth, title=args.title or f"Guard report: {source}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data), encoding="utf-8")
    print(f"guard report: {len(messages):,} messages -> {out}", file=sys.stderr)
    return 0


def register(sub: Any, add: Any) -> None:
    """Add ``report`` to the ``guard`` parser."""
    p = add(
        "report",
        cmd_report,
        "write one self-contained HTML page (plots, opens offline) of a run: step time with "
        "and without Guard, flags and node states per node, time to detect, goodput",
    )
    p.add_argument(
        "--jsonl",
        nargs="+",
        metavar="FILE.jsonl",
        help="messages of the run (telemetry, flags, node states); default: read ClickHouse",
    )
    p.add_argument(
        "--store",
        metavar="DSN",
        help="ClickHouse to read (e.g. chdb:///path or http://host:8123); default from config",
    )
    p.add_argument(
        "--baseline",
        nargs="+",
        metavar="FILE.jsonl",
        help="step timings of the same job without remediation (e.g. `guard simulate` output)",
    )
    p.add_argument("--truth", metavar="TRUTH.json", help="simulator ground truth: time to detect")
    p.add_argument("--title", help="page title")
    p.add_argument("--out", required=True, metavar="FILE.html", help="where to write the page")

"""`guard streams` and `guard sink`: the long-running stream processors."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from guard.config import Settings


def cmd_streams(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics

    create_topics(settings)  # the input topics must exist before the workers subscribe
    if args.engine:
        settings.streams.engine = args.engine
    if settings.streams.engine == "native":
        return _run_native(settings)
    import faust

    from guard.streams.faust_app import create_app

    app = create_app(settings)
    counters = app.guard_counters  # type: ignore[attr-defined]

    @app.timer(interval=settings.streams.progress_s)
    async def progress() -> None:
        print(_progress_line(counters, app.guard_restored()), file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    worker = faust.Worker(app, loglevel=args.loglevel, quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()
    return 0


def _progress_line(counters: Any, restored: int) -> str:
    return (
        f"guard streams: {counters.telemetry} telemetry messages, {counters.findings} "
        f"findings, {counters.flags} flags, {counters.dead_letters} dead letters, "
        f"{restored} keys restored from checkpoints"
    )


def _run_native(settings: Settings) -> int:
    from guard.streams.native import NativeWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    worker = NativeWorker(settings)

    def report(counters: Any) -> None:
        restored = sum(
            s.restored for s in (worker.node.state, worker.job.state, worker.fusion.state)
        )
        print(_progress_line(counters, restored), file=sys.stderr, flush=True)

    worker.run(stop, on_progress=report)
    return 0


def cmd_sink(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics
    from guard.store import connect, migrate
    from guard.streams.sink import ClickHouseSink

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    create_topics(settings)
    client = connect(settings)
    migrate(client, settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sink = ClickHouseSink(settings, client, group_id=args.group)
    ticker = threading.Thread(target=_report, args=(sink, stop, settings), daemon=True)
    ticker.start()
    stats = sink.run(stop)
    client.close()
    print(
        f"guard sink: stopped; {stats.stored} rows stored, {stats.dead_letters} dead letters",
        file=sys.stderr,
    )
    return 0


def _report(sink: Any, stop: threading.Event, settings: Settings) -> None:
    while not stop.wait(settings.streams.progress_s):
        s = sink.stats
        print(
            f"guard sink: {s.consumed} consumed, {s.stored} stored in {s.batches} batches, "
            f"{s.dead_letters} dead letters, {s.insert_failures} failed inserts",
            file=sys.stderr,
            flush=True,
        )


def register(sub: Any, add: Any) -> None:
    p = add("streams", cmd_streams, "run a streams worker (detectors over the telemetry topics)")
    p.add_argument("--loglevel", default="warning")
    p.add_argument(
        "--engine",
        choices=["faust", "native"],
        default=None,
        help="transport (default from config: native)",
    )
    p = add("sink", cmd_sink, "store Guard's topics in ClickHouse")
    p.add_argument("--group", default="guard-sink", help="consumer group id")

"""`guard streams` and `guard sink`: the long-running stream processors.

Both report progress on stderr as one JSON line per report (``progress_line``), which the
demo, the tests and the benchmarks read back with ``parse_progress``.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from guard.config import Settings

from .common import (
    add_log_level,
    add_metrics_port,
    apply_options,
    configure_logging,
    need_services,
    tune_gc_for_the_data_path,
)

__all__ = ["register"]


def _report(worker: str, event: str = "progress", **counts: int) -> None:
    from guard.streams.processing import progress_line

    print(progress_line(worker, event, **counts), file=sys.stderr, flush=True)


def _report_streams(counters: Any, checkpoints: dict[str, int]) -> None:
    # telemetry, findings, flags, dead_letters; keys resumed from checkpoints, and refused
    _report("streams", **counters.totals(), **checkpoints)


def cmd_streams(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics
    from guard.metrics import Metrics

    need_services()  # before the broker is awaited
    create_topics(settings)  # the input topics must exist before the workers subscribe
    apply_options(settings, args, {"streams.engine": "engine", "streams.web_port": "metrics_port"})
    metrics = Metrics("streams", stale_s=settings.metrics.stale_s)
    if settings.streams.engine == "native":
        tune_gc_for_the_data_path()
        return _run_native(settings, args.log_level or "info", metrics)
    import faust

    from guard.streams.faust_app import create_app
    from guard.streams.metrics import faust_lag, observe_streams

    app = create_app(settings)
    counters = app.guard_counters  # type: ignore[attr-defined]
    checkpoints = app.guard_checkpoint_totals  # type: ignore[attr-defined]
    observe_streams(metrics, counters, checkpoints, "faust")
    _serve(metrics, settings.streams.web_port, settings, "streams.web_port")

    @app.timer(interval=min(settings.streams.progress_s, 5.0))
    async def heartbeat() -> None:
        metrics.lag = faust_lag(app.consumer, settings.streams.app_id)
        metrics.beat()

    @app.timer(interval=settings.streams.progress_s)
    async def progress() -> None:
        _report_streams(counters, app.guard_checkpoint_totals())  # type: ignore[attr-defined]

    loglevel = args.log_level or "warning"
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()  # CPython's collector: see tune_gc_for_the_data_path
    return 0


def _serve(metrics: Any, port: int, settings: Settings, setting: str) -> Any:
    return metrics.serve(port, settings.metrics.host, setting)


def _run_native(settings: Settings, log_level: str, metrics: Any) -> int:
    from guard.shutdown import stop_on_signals
    from guard.streams.metrics import observe_streams
    from guard.streams.native import NativeWorker

    configure_logging(log_level)
    with stop_on_signals() as stop:
        worker = NativeWorker(settings, metrics=metrics)
        observe_streams(metrics, worker.counters, worker.checkpoint_totals, "native")
        server = _serve(metrics, settings.streams.web_port, settings, "streams.web_port")

        def report(counters: Any) -> None:
            _report_streams(counters, worker.checkpoint_totals())

        try:
            worker.run(stop, on_progress=report)
        finally:
            if server is not None:
                server.close()
    return 0


def cmd_sink(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics
    from guard.metrics import Metrics
    from guard.shutdown import stop_on_signals
    from guard.store import connect, migrate
    from guard.streams.metrics import observe_sink
    from guard.streams.sink import ClickHouseSink

    configure_logging(args.log_level)
    apply_options(settings, args, {"metrics.sink_port": "metrics_port"})
    create_topics(settings)
    client = connect(settings)
    migrate(client, settings)
    metrics = Metrics("sink", stale_s=settings.metrics.stale_s)
    with stop_on_signals() as stop:
        sink = ClickHouseSink(settings, client, group_id=args.group, metrics=metrics)
        observe_sink(metrics, sink.stats)
        server = _serve(metrics, settings.metrics.sink_port, settings, "metrics.sink_port")
        ticker = threading.Thread(target=_report_sink, args=(sink, stop, settings), daemon=True)
        ticker.start()
        stats = sink.run(stop)
    if server is not None:
        server.close()
    client.close()
    _report("sink", "stopped", stored=stats.stored, dead_letters=stats.dead_letters)
    return 0


def _report_sink(sink: Any, stop: threading.Event, settings: Settings) -> None:
    while not stop.wait(settings.streams.progress_s):
        s = sink.stats
        _report(
            "sink",
            consumed=s.consumed,
            stored=s.stored,
            batches=s.batches,
            dead_letters=s.dead_letters,
            insert_failures=s.insert_failures,
        )


def register(sub: Any, add: Any) -> None:
    """Add ``streams`` and ``sink`` to the ``guard`` parser."""
    p = add("streams", cmd_streams, "run a streams worker (detectors over the telemetry topics)")
    add_log_level(p, None, "log level (default: info; faust: warning)", "--loglevel")
    p.add_argument(
        "--engine",
        choices=["faust", "native"],
        default=None,
        help="transport (default from config: native)",
    )
    add_metrics_port(p, "streams.web_port")
    p = add("sink", cmd_sink, "store Guard's topics in ClickHouse")
    p.add_argument("--group", default="guard-sink", help="consumer group id")
    add_metrics_port(p, "metrics.sink_port")
    add_log_level(p, "info")

"""What the streams workers (both engines) and the sink show on ``/metrics``.

The families read the counters the progress lines print (:class:`StreamsCounters`,
:class:`SinkStats`) at scrape time; see :mod:`guard.metrics`. Two histograms are declared
here, once per process, and observed where the work happens: the event-to-flag latency by
engine (:func:`flags_sent`, called where a worker sends its flags) and the sink's insert
duration (:func:`timed_insert`, around the sink's insert).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import Histogram

from guard.metrics import DEAD_LETTER_REASONS, Metrics
from guard.schemas import CATEGORIES, SEVERITIES
from guard.schemas.tables import TABLES
from guard.schemas.topics import JOB_KINDS, NODE_KINDS

if TYPE_CHECKING:  # the sink's module imports the ClickHouse client; a worker needs neither
    from guard.schemas import Flag

    from .processing import StreamsCounters
    from .sink import SinkStats

__all__ = [
    "FLAG_LATENCY",
    "SINK_INSERT",
    "faust_lag",
    "flags_sent",
    "observe_sink",
    "observe_streams",
    "timed_insert",
]

#: From the event time of a flag (its evidence's newest sample) to the worker sending it:
#: the detection windows plus transport. A replay of old telemetry lands in +Inf.
FLAG_LATENCY = Histogram(
    "guard_flag_latency_seconds",
    "event time of a flag to the worker sending it, by engine",
    ["engine"],
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
    registry=None,
)
SINK_INSERT = Histogram(
    "guard_sink_insert_duration_seconds",
    "one batch insert into ClickHouse, by result (ok, error)",
    ["result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=None,
)

Result = TypeVar("Result")


def flags_sent(flags: Iterable[Flag], engine: str) -> None:
    """Observe each flag's latency from its event time to now (a worker sends it now)."""
    now = time.time()
    latency = FLAG_LATENCY.labels(engine)
    for flag in flags:
        latency.observe(max(0.0, now - flag.ts))


def timed_insert(insert: Callable[..., Result]) -> Callable[..., Result]:
    """``insert`` whose every call is observed in ``guard_sink_insert_duration_seconds``."""

    def timed(*args: Any, **kwargs: Any) -> Result:
        start = time.perf_counter()
        result = "error"
        try:
            value = insert(*args, **kwargs)
            result = "ok"
            return value
        finally:
            SINK_INSERT.labels(result).observe(time.perf_counter() - start)

    return timed


def _by(counts: Mapping[Any, int]) -> dict[tuple[str, ...], float]:
    """A Counter keyed by one label value or a tuple of them, as label tuples."""
    return {(k if isinstance(k, tuple) else (k,)): n for k, n in dict(counts).items()}


def observe_streams(
    metrics: Metrics,
    counters: StreamsCounters,
    checkpoint_totals: Callable[[], dict[str, int]],
    engine: str,
) -> None:
    """A streams worker's families: records, messages, findings, flags, dead letters,
    checkpoints; and the flag latency of its ``engine`` (native or faust)."""
    m = metrics
    m.counter(
        "guard_streams_records_total",
        "telemetry records consumed",
        lambda: counters.telemetry,
    )
    m.counter(
        "guard_streams_messages_total",
        "valid telemetry messages handled, by kind",
        lambda: _by(counters.kinds),
        ("kind",),
        [(kind,) for kind in NODE_KINDS + JOB_KINDS],
    )
    m.counter("guard_findings_total", "detector findings sent to fusion", lambda: counters.findings)
    m.counter(
        "guard_flags_total",
        "flags raised, by category and severity",
        lambda: _by(counters.flag_classes),
        ("category", "severity"),
        [(c, s) for c in CATEGORIES for s in SEVERITIES],
    )
    m.counter(
        "guard_dead_letters_total",
        "records sent to the dead-letter topic, by reason",
        lambda: _by(counters.dead_reasons),
        ("reason",),
        [(reason,) for reason in DEAD_LETTER_REASONS],
    )
    m.counter(
        "guard_checkpoints_restored_total",
        "keys resumed from a checkpoint",
        lambda: checkpoint_totals()["restored"],
    )
    m.counter(
        "guard_checkpoints_refused_total",
        "checkpoints of another format or unreadable (their keys started cold)",
        lambda: checkpoint_totals()["refused"],
    )
    FLAG_LATENCY.labels(engine)  # the series exists (zero) before the first flag
    m.include(FLAG_LATENCY)


def observe_sink(metrics: Metrics, stats: SinkStats) -> None:
    """The sink's families: records consumed, rows stored by table, batches, failures, and
    the insert duration."""
    m = metrics
    m.counter("guard_sink_records_total", "records consumed", lambda: stats.consumed)
    m.counter("guard_sink_messages_stored_total", "messages stored", lambda: stats.stored)
    m.counter(
        "guard_sink_rows_total",
        "rows inserted, by table",
        lambda: _by(stats.rows_by_table),
        ("table",),
        [(table.name,) for table in TABLES],
    )
    m.counter("guard_sink_batches_total", "batches stored", lambda: stats.batches)
    m.counter(
        "guard_sink_insert_failures_total",
        "inserts that failed (retried with backoff)",
        lambda: stats.insert_failures,
    )
    m.counter(
        "guard_dead_letters_total",
        "records sent to the dead-letter topic, by reason",
        lambda: _by(stats.dead_reasons),
        ("reason",),
        [(reason,) for reason in DEAD_LETTER_REASONS],
    )
    for result in ("ok", "error"):
        SINK_INSERT.labels(result)
    m.include(SINK_INSERT)


def faust_lag(consumer: Any, group: str) -> dict[tuple[str, str, str], float]:
    """Records behind the end of each partition a faust consumer of ``group`` holds
    (highwater - read)."""
    lag: dict[tuple[str, str, str], float] = {}
    for tp in consumer.assignment():
        end = consumer.highwater(tp)
        # faust's last read offset; before the first read, where its committed offset points
        read = consumer._read_offset.get(tp)
        at = read + 1 if read is not None else consumer._committed_offset.get(tp) or 0
        if end is not None and end >= 0:
            lag[(group, tp.topic, str(tp.partition))] = max(0, end - at)
    return lag

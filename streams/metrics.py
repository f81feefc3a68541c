"""What the streams workers (both engines) and the sink show on ``/metrics``.

The families read the counters the progress lines print (:class:`StreamsCounters`,
:class:`SinkStats`) at scrape time; see :mod:`guard.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from guard.metrics import Metrics

if TYPE_CHECKING:  # the sink's module imports the ClickHouse client; a worker needs neither
    from .processing import StreamsCounters
    from .sink import SinkStats

__all__ = ["faust_lag", "observe_sink", "observe_streams"]


def _by(counts: Mapping[Any, int]) -> dict[tuple[str, ...], float]:
    """A Counter keyed by one label value or a tuple of them, as label tuples."""
    return {(k if isinstance(k, tuple) else (k,)): n for k, n in dict(counts).items()}


def observe_streams(
    metrics: Metrics, counters: StreamsCounters, checkpoint_totals: Callable[[], dict[str, int]]
) -> None:
    """A streams worker's families: messages, findings, flags, dead letters, checkpoints."""
    m = metrics
    m.counter("guard_records_total", "telemetry records consumed", lambda: counters.telemetry)
    m.counter(
        "guard_messages_total",
        "valid telemetry messages handled, by kind",
        lambda: _by(counters.kinds),
        ("kind",),
    )
    m.counter("guard_findings_total", "detector findings sent to fusion", lambda: counters.findings)
    m.counter(
        "guard_flags_total",
        "flags raised, by category and severity",
        lambda: _by(counters.flag_classes),
        ("category", "severity"),
    )
    m.counter(
        "guard_dead_letters_total",
        "records sent to the dead-letter topic, by reason",
        lambda: _by(counters.dead_reasons),
        ("reason",),
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


def observe_sink(metrics: Metrics, stats: SinkStats) -> None:
    """The sink's families: records consumed, rows stored by table, batches, failures."""
    m = metrics
    m.counter("guard_records_total", "records consumed", lambda: stats.consumed)
    m.counter("guard_sink_messages_stored_total", "messages stored", lambda: stats.stored)
    m.counter(
        "guard_sink_rows_total",
        "rows inserted, by table",
        lambda: _by(stats.rows_by_table),
        ("table",),
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
    )


def faust_lag(consumer: Any) -> dict[tuple[str, str], float]:
    """Records behind the end of each partition a faust consumer holds (highwater - read)."""
    lag: dict[tuple[str, str], float] = {}
    for tp in consumer.assignment():
        end = consumer.highwater(tp)
        # faust's last read offset; before the first read, where its committed offset points
        read = consumer._read_offset.get(tp)
        at = read + 1 if read is not None else consumer._committed_offset.get(tp) or 0
        if end is not None and end >= 0:
            lag[(tp.topic, str(tp.partition))] = max(0, end - at)
    return lag

"""Replay recorded telemetry (JSONL files or ClickHouse) into the telemetry topics.

Messages go out in event-time order, keyed and stamped as the wire contract says (through
:func:`guard.kafka.produce`: ``node`` for gpu/nic, ``job`` for step/collective, record
timestamp = event time), paced at ``speed`` times real time (0: as fast as the broker
takes them). Only telemetry kinds are replayed; flags, sweeps and node states in an input
are counted and skipped. A line that is not a valid message goes to the dead-letter topic
with the reason, and the replay goes on.

Retiming (``retime="now"``, the default) shifts every event time (``ts``, and a
collective's ``arrive_ts`` / ``end_ts``) by one offset so that the replay ends at the
present: the last event is stamped at the moment it is sent. Without it, old telemetry
lands in topics whose time retention deletes it at once (the broker judges a segment by its
records' timestamps), and telemetry from the future (a clock ahead) is refused outright by
Kafka 4.x (``log.message.timestamp.after.max.ms``, 1 h). The offset is the same for every
message, so detectors, which only compare event times, give the same flags, shifted.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from guard.config import Settings
from guard.kafka import dead_letter, make_producer, produce
from guard.schemas import MODELS, GuardMessage, SchemaError
from guard.schemas.batches import BATCH_MODEL_OF_KIND as BATCH_MODELS
from guard.schemas.batches import SINGLE_OF
from guard.schemas.sample_decoder import parse_samples
from guard.schemas.tables import TABLE_BY_KIND
from guard.schemas.topics import JOB_KINDS, NODE_KINDS

__all__ = [
    "REPLAYED_KINDS",
    "BadRecord",
    "ClickHouseSource",
    "JsonlSource",
    "ReplayFilter",
    "ReplayStats",
    "Replayer",
    "retime_shift",
    "retimed",
]

REPLAYED_KINDS = NODE_KINDS + JOB_KINDS
#: Event-time fields, shifted together by retiming.
TIME_FIELDS = ("ts", "arrive_ts", "end_ts")


@dataclass(frozen=True)
class ReplayFilter:
    """Which messages to replay: event time in ``[start, end)``, node and job in the sets."""

    start: float | None = None
    end: float | None = None
    nodes: frozenset[str] | None = None
    jobs: frozenset[str] | None = None

    def keeps(self, ts: float, node: str | None, job: str | None) -> bool:
        return (
            (self.start is None or ts >= self.start)
            and (self.end is None or ts < self.end)
            and (self.nodes is None or node in self.nodes)
            and (self.jobs is None or job in self.jobs)
        )


@dataclass(frozen=True)
class BadRecord:
    """An input line that is not a valid message: it goes to the dead-letter topic."""

    raw: bytes
    error: str
    source: str


@dataclass(frozen=True)
class Span:
    """How many messages a source will replay, and their first and last event times."""

    count: int
    first: float
    last: float


class Source(Protocol):
    def span(self) -> Span | None: ...

    def messages(self) -> Iterator[GuardMessage | BadRecord]: ...


@dataclass
class ReplayStats:
    by_kind: Counter[str] = field(default_factory=Counter)
    dead_letters: int = 0
    skipped: int = 0  # not telemetry (flags, sweeps, node states)
    failed: int = 0  # records the broker did not take
    first_error: str | None = None
    shift_s: float = 0.0
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def messages(self) -> int:
        return sum(self.by_kind.values())

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "by_kind": dict(sorted(self.by_kind.items())),
            "dead_letters": self.dead_letters,
            "skipped": self.skipped,
            "failed": self.failed,
            "first_error": self.first_error,
            "shift_s": round(self.shift_s, 3),
            "seconds": round(self.seconds, 3),
            "rate": round(self.rate, 1),
            "interrupted": self.interrupted,
        }


def retime_shift(retime: str, span: Span | None, speed: float, now: float) -> float:
    """Seconds to add to every event time: 0 for ``keep``; for ``now``, the shift that puts
    the last event at the moment the replay is due to end, so that no record is stamped
    later than it is sent (at speed 1 the replay looks live; at 0 the last event is now).

    >>> retime_shift("now", Span(3, 100.0, 160.0), speed=0, now=1000.0)
    840.0
    >>> retime_shift("now", Span(3, 100.0, 160.0), speed=2, now=1000.0)  # ends in 30 s
    870.0
    >>> retime_shift("keep", Span(3, 100.0, 160.0), speed=0, now=1000.0)
    0.0
    """
    if retime == "keep" or span is None:
        return 0.0
    duration = (span.last - span.first) / max(speed, 1.0) if speed > 0 else 0.0
    return now + duration - span.last


def retimed(message: GuardMessage, shift: float) -> GuardMessage:
    """``message`` with every event time moved by ``shift`` seconds, in place.

    The replayer owns the messages it has just parsed. The values go straight into the
    model's ``__dict__`` (where pydantic keeps them; a float plus a float needs no
    validation): ``model_copy`` took as long as parsing the message, ``setattr`` a third.
    """
    if shift:
        fields = message.__dict__
        for name in TIME_FIELDS:
            value = fields.get(name)
            if value is not None:
                fields[name] = value + shift
    return message


class JsonlSource:
    """Wire messages, one JSON object a line, from several files merged by event time."""

    def __init__(self, paths: Iterable[Path], only: ReplayFilter | None = None) -> None:
        self.paths = [Path(p) for p in paths]
        self.only = only or ReplayFilter()

    def span(self) -> Span | None:
        # A light first pass (ts, kind, node, job only) so that the shift and the progress
        # bar's total are known before the first message is sent.
        count, first, last = 0, float("inf"), float("-inf")
        for path in self.paths:
            with path.open("rb") as fh:
                for line in fh:
                    head = _head(line)
                    if head is None or head[0] not in REPLAYED_KINDS:
                        continue
                    if not self.only.keeps(*head[1:4]):
                        continue
                    count += head[4]
                    first, last = min(first, head[1]), max(last, head[1])
        return Span(count, first, last) if count else None

    def messages(self) -> Iterator[GuardMessage | BadRecord]:
        streams = [self._read(i, path) for i, path in enumerate(self.paths)]
        for *_, item in heapq.merge(*streams, key=lambda entry: entry[:3]):
            yield item

    def _read(self, index: int, path: Path) -> Iterator[tuple[float, int, int, Any]]:
        with path.open("rb") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    singles = parse_samples(line)
                except SchemaError as exc:
                    bad = BadRecord(line.rstrip(b"\r\n"), str(exc), f"{path}:{number}")
                    yield 0.0, index, number, bad  # out of order: to the dead letters at once
                    continue
                for single in singles:  # batches are replayed as their samples
                    if self.only.keeps(single.ts, single.node, single.job):
                        yield single.ts, index, number, single


def _head(line: bytes) -> tuple[str, float, str | None, str | None, int] | None:
    """Kind (a batch's single kind), ts, node, job and number of samples of a line."""
    try:
        data = orjson.loads(line)
        kind, samples = str(data["kind"]), 1
        if kind in BATCH_MODELS:
            model = BATCH_MODELS[kind]
            kind, samples = SINGLE_OF[kind], len(data[model.entries_field])
        return kind, float(data["ts"]), data.get("node"), data.get("job"), samples
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class ClickHouseSource:
    """Telemetry rows of Guard's ClickHouse tables (``FINAL``: one row per message)."""

    def __init__(self, client: Any, database: str, only: ReplayFilter | None = None) -> None:
        self.client = client
        self.database = database
        self.only = only or ReplayFilter()

    def _where(self) -> tuple[str, dict[str, Any]]:
        clauses, params = ["1"], dict[str, Any]()
        f = self.only
        if f.start is not None:
            clauses.append("ts >= fromUnixTimestamp64Micro({start:Int64}, 'UTC')")
            params["start"] = round(f.start * 1e6)
        if f.end is not None:
            clauses.append("ts < fromUnixTimestamp64Micro({end:Int64}, 'UTC')")
            params["end"] = round(f.end * 1e6)
        for column, values in (("node", f.nodes), ("job", f.jobs)):
            if values is not None:
                clauses.append(f"{column} IN {{{column}s:Array(String)}}")
                params[f"{column}s"] = sorted(values)
        return " AND ".join(clauses), params

    def _table(self, kind: str) -> str:
        return f"`{self.database}`.`{TABLE_BY_KIND[kind].name}` FINAL"

    def span(self) -> Span | None:
        where, params = self._where()
        count, first, last = 0, float("inf"), float("-inf")
        for kind in REPLAYED_KINDS:
            sql = (
                "SELECT count(), toUnixTimestamp64Micro(min(ts)), toUnixTimestamp64Micro(max(ts))"
                f" FROM {self._table(kind)} WHERE {where}"
            )
            n, lo, hi = self.client.query(sql, parameters=params).result_rows[0]
            if n:
                count, first, last = count + n, min(first, lo / 1e6), max(last, hi / 1e6)
        return Span(count, first, last) if count else None

    def messages(self) -> Iterator[GuardMessage | BadRecord]:
        # Windows of event time, each read whole from every table and merged: memory stays
        # bounded, and no two result streams are open at once (chDB allows one per thread).
        span = self.span()
        if span is None:
            return
        width = max(1.0, (span.last - span.first) * self.WINDOW_ROWS / span.count)
        start = span.first
        while start <= span.last:
            end = start + width
            batch = [m for kind in REPLAYED_KINDS for m in self._rows(kind, start, end)]
            batch.sort(key=lambda m: m.ts)
            yield from batch
            start = end

    #: Rows per window of :meth:`messages`, on average.
    WINDOW_ROWS = 200_000

    def _rows(self, kind: str, start: float, end: float) -> Iterator[GuardMessage]:
        columns = TABLE_BY_KIND[kind].columns
        times = {c.name for c in columns if c.type.startswith(("DateTime64", "Nullable(DateTime"))}
        select = ", ".join(
            f"toUnixTimestamp64Micro(`{c.name}`)" if c.name in times else f"`{c.name}`"
            for c in columns
        )
        where, params = self._where()
        params.update(lo=round(start * 1e6), hi=round(end * 1e6))
        sql = (
            f"SELECT {select} FROM {self._table(kind)} WHERE {where}"
            " AND ts >= fromUnixTimestamp64Micro({lo:Int64}, 'UTC')"
            " AND ts < fromUnixTimestamp64Micro({hi:Int64}, 'UTC')"
        )
        model = MODELS[kind]
        for row in self.client.query(sql, parameters=params).result_rows:
            data = {"kind": kind}
            for column, value in zip(columns, row, strict=True):
                is_time = column.name in times and value is not None
                data[column.name] = value / 1e6 if is_time else value
            yield model.model_validate(data)


class Replayer:
    """Sends a source's messages to the telemetry topics, paced and retimed."""

    def __init__(self, settings: Settings, producer: Any = None) -> None:
        self.settings = settings
        self.producer = producer or make_producer(settings)

    def run(
        self,
        source: Source,
        speed: float = 0.0,
        retime: str = "now",
        stop: threading.Event | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> ReplayStats:
        """Replay everything ``source`` holds; ``on_progress(sent, total)`` now and then."""
        stop = stop or threading.Event()
        stats = ReplayStats()
        span = source.span()
        total = span.count if span else 0
        stats.shift_s = retime_shift(retime, span, speed, time.time())
        started = time.monotonic()
        reported = started
        sent = 0

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                stats.failed += 1
                stats.first_error = stats.first_error or str(err)

        for item in source.messages():
            if stop.is_set():
                stats.interrupted = True
                break
            if isinstance(item, BadRecord):
                dead_letter(self.producer, self.settings, item.raw, item.error, item.source)
                stats.dead_letters += 1
                continue
            if item.kind not in REPLAYED_KINDS:
                stats.skipped += 1
                continue
            if speed > 0 and span is not None:
                self._wait_until(started + (item.ts - span.first) / speed, stop)
            produce(self.producer, self.settings, retimed(item, stats.shift_s), delivered)
            stats.by_kind[item.kind] += 1
            sent += 1
            if on_progress is not None and time.monotonic() - reported >= 0.2:
                reported = time.monotonic()
                on_progress(sent, total)
            if not sent & 0x3FF:
                self.producer.poll(0)
        # Delivered or failed by then (message.timeout.ms); sooner when interrupted.
        undelivered = self.producer.flush(10.0 if stop.is_set() else 130.0)
        if undelivered:
            stats.failed += undelivered
            stats.first_error = stats.first_error or f"{undelivered} records not delivered in time"
        stats.seconds = time.monotonic() - started
        if on_progress is not None:
            on_progress(sent, total)
        return stats

    def _wait_until(self, due: float, stop: threading.Event) -> None:
        while not stop.is_set() and (left := due - time.monotonic()) > 0:
            self.producer.poll(min(0.1, left))

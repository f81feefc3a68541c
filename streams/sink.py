"""The ClickHouse sink: Guard's topics into ClickHouse, in batches, at least once.

Records are decoded straight into table columns by :func:`guard.schemas.rows.decode_columns`
(the acceptance of ``guard.schemas``: a bad record goes to the dead-letter topic with the
reason; a batch record's entries become its rows), grouped into batches bounded by rows and
age, and inserted per table. Kafka
offsets are committed only after a batch is stored. Duplicates are removed by design: each
batch carries an insert-deduplication token built from its offsets (a retried batch is a
no-op), and the tables are ReplacingMergeTree on natural keys (a redelivered message after
a crash collapses at merge time, or at once with ``FINAL``).

When ClickHouse is unreachable the sink keeps the sealed batches (up to ``max_buffer_rows``),
retries with backoff, and pauses consumption while the buffer is full; nothing is committed
that was not stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from guard.config import Settings
from guard.kafka import dead_letter, make_consumer, make_producer
from guard.metrics import Metrics, dead_letter_reason
from guard.schemas import SchemaError
from guard.schemas.rows import Decoded, decode_columns
from guard.schemas.tables import Table
from guard.schemas.topics import KIND_BY_TOPIC
from guard.store import insert_columns

from .metrics import timed_insert

__all__ = ["Batch", "ClickHouseSink", "SinkStats", "Tables", "sink_topics"]

log = logging.getLogger("guard.sink")

#: Most records one consume call returns, and librdkafka's fetch sizes: bigger fetches
#: than its defaults (1 MB a partition) keep one sink fed at tens of thousands of rows/s.
CONSUME_MAX = 20_000
FETCH = {"fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 16 << 20}


def sink_topics(settings: Settings) -> dict[str, str]:
    """Topic → message kind for everything the sink stores (a telemetry topic's batches
    are decoded with its kind: :func:`guard.schemas.decode`)."""
    return {settings.topic(suffix): kind for suffix, kind in KIND_BY_TOPIC.items()}


#: What the sink inserts: per table, its row count and its columns (the table's order).
Tables = dict[Table, tuple[int, list[list[Any]]]]


@dataclass
class Batch:
    """Rows of consumed records, per table as columns, and the offsets they came from."""

    tables: Tables = field(default_factory=dict)
    rows: int = 0
    # (topic, partition) -> (first offset, last offset)
    offsets: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    opened: float = field(default_factory=time.monotonic)

    def add_rows(self, decoded: Decoded) -> None:
        if not decoded.rows:
            return
        have = self.tables.get(decoded.table)
        if have is None:
            self.tables[decoded.table] = (decoded.rows, decoded.columns)
        else:
            for col, more in zip(have[1], decoded.columns, strict=True):
                col.extend(more)
            self.tables[decoded.table] = (have[0] + decoded.rows, have[1])
        self.rows += decoded.rows

    def add_offsets(self, partitions: list[tuple[str, int]], offsets: list[int]) -> None:
        """Records' (topic, partition)s and offsets, in consumption order."""
        last = dict(zip(partitions, offsets, strict=True))  # within a partition, the later wins
        first = dict(zip(reversed(partitions), reversed(offsets), strict=True))
        for where, offset in last.items():
            start, _ = self.offsets.get(where, (first[where], offset))
            self.offsets[where] = (start, offset)

    @property
    def token(self) -> str:
        """Deduplication token: the same offsets give the same token."""
        return ";".join(f"{t}/{p}/{a}-{b}" for (t, p), (a, b) in sorted(self.offsets.items()))

    def commit_positions(self) -> list[TopicPartition]:
        return [TopicPartition(t, p, last + 1) for (t, p), (_, last) in self.offsets.items()]


@dataclass
class SinkStats:
    consumed: int = 0
    stored: int = 0
    dead_letters: int = 0
    batches: int = 0
    insert_failures: int = 0
    #: records the fast decode could not vouch for, decided by pydantic (clean telemetry: 0)
    by_pydantic: int = 0
    rows_by_table: dict[str, int] = field(default_factory=dict)
    dead_reasons: Counter[str] = field(default_factory=Counter)


def _usable(record: Message) -> bool:
    """False for a consumer error (logged unless it is the end of a partition)."""
    error = record.error()
    if error is not None and error.code() != KafkaError._PARTITION_EOF:
        log.warning("consumer error: %s", error)
    return error is None


class ClickHouseSink:
    """Consumes Guard's topics and stores them in ClickHouse.

    ``insert`` defaults to :func:`guard.store.insert_columns` on ``client``; it is a
    parameter so that the demo can run the sink next to other users of one chDB client.
    """

    def __init__(
        self,
        settings: Settings,
        client: Any,
        group_id: str = "guard-sink",
        consumer: Consumer | None = None,
        insert: Callable[[Tables, str], dict[str, int]] | None = None,
        max_buffer_rows: int | None = None,
        retry_backoff_s: tuple[float, float] = (0.5, 30.0),
        metrics: Metrics | None = None,
    ):
        self.settings = settings
        self.topics = sink_topics(settings)
        self.metrics = metrics
        conf = {**FETCH, **(metrics.kafka_conf() if metrics else {})}
        self.consumer = consumer or make_consumer(
            settings, group_id, list(self.topics), on_revoke=self._on_revoke, **conf
        )
        self.producer = make_producer(settings)
        self._insert = insert or (
            lambda tables, token: insert_columns(client, settings, tables, dedup_token=token)
        )
        self._insert = timed_insert(self._insert)  # guard_sink_insert_duration_seconds
        self.batch_rows = settings.clickhouse.batch_rows
        self.batch_seconds = settings.clickhouse.batch_seconds
        self.max_buffer_rows = max_buffer_rows or 4 * self.batch_rows
        self.backoff_min, self.backoff_max = retry_backoff_s
        self.open = Batch()
        self.sealed: list[Batch] = []
        self.stats = SinkStats()
        self._paused = False
        self._next_retry = 0.0
        self._backoff = self.backoff_min
        self._rows_per_record: float | None = None  # of the last records taken

    # -- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> SinkStats:
        """Consume and store until ``stop`` is set; then store what is buffered and close."""
        try:
            while not stop.is_set():
                self.step(poll_s)
            self.drain(timeout_s=10.0)
        finally:
            self.close()
        return self.stats

    def step(self, poll_s: float = 0.2) -> None:
        """One round: consume what is there (unless paused), then flush what is due."""
        if not self._paused:
            room = max(1, min(CONSUME_MAX, self.max_buffer_rows - self._buffered()))
            records = self.consumer.consume(num_messages=room, timeout=poll_s)
            start = 0
            while start < len(records):  # slices that fit the open batch's rows
                per = self._rows_per_record  # unknown at first: one record tells
                room_rows = self.batch_rows - self.open.rows
                end = start + (1 if per is None else max(1, int(room_rows / per)))
                rows_before = self.open.rows
                self._take(records[start:end])
                taken = min(end, len(records)) - start
                if self.open.rows > rows_before:  # a batch record is many rows
                    self._rows_per_record = (self.open.rows - rows_before) / taken
                if self.open.rows >= self.batch_rows:
                    self._seal()
                start = end
        else:
            self.consumer.poll(0)  # keep the group membership alive while paused
            time.sleep(min(poll_s, 0.1))
        self._flush_due()
        if self.metrics is not None:
            self.metrics.beat()

    def drain(self, timeout_s: float) -> bool:
        """Store everything buffered, retrying until ``timeout_s``. True when all stored."""
        deadline = time.monotonic() + timeout_s
        self._seal()
        while self.sealed and time.monotonic() < deadline:
            self._next_retry = 0.0
            if not self._store_sealed():
                time.sleep(min(self._backoff, max(0.0, deadline - time.monotonic())))
        return not self.sealed

    def close(self) -> None:
        self.producer.flush(10)
        self.producer.close()
        self.consumer.close()

    # -- internals --------------------------------------------------------------------------

    def _take(self, records: list[Message]) -> None:
        """Decode ``records`` into the open batch, per topic in record order (a topic
        is one table); bad ones to the dead-letter topic."""
        if list(map(Message.error, records)).count(None) != len(records):
            records = list(filter(_usable, records))
        # a consumed record (no error) has its topic, partition and offset
        topics: list[Any] = list(map(Message.topic, records))
        partitions: list[Any] = list(map(Message.partition, records))
        offsets: list[Any] = list(map(Message.offset, records))
        # A dead-lettered record still advances the offsets: it must not block the partition.
        self.open.add_offsets(list(zip(topics, partitions, strict=True)), offsets)
        by_topic: dict[str, list[int]] = {}
        for i, topic in enumerate(topics):
            by_topic.setdefault(topic, []).append(i)
        for topic, indexes in by_topic.items():
            group = [records[i] for i in indexes] if len(indexes) < len(records) else records
            self.stats.consumed += len(group)
            kind = self.topics.get(topic)
            if kind is None:
                for record in group:
                    self._dead_letter(
                        record, SchemaError(f"no kind is stored from topic {topic!r}")
                    )
                continue
            values = list(map(Message.value, group))
            if None in values:
                values = [v or b"" for v in values]
            decoded = decode_columns(values, kind)
            self.stats.by_pydantic += decoded.slow
            for index, exc in decoded.rejected:
                self._dead_letter(group[index], exc)
            self.open.add_rows(decoded)

    def _dead_letter(self, record: Message, exc: SchemaError) -> None:
        where = f"{record.topic()}/{record.partition()}/{record.offset()}"
        dead_letter(self.producer, self.settings, record.value(), exc, where, record.key())
        self.stats.dead_letters += 1
        self.stats.dead_reasons[dead_letter_reason(exc)] += 1

    def _seal(self) -> None:
        if self.open.offsets:
            self.sealed.append(self.open)
            self.open = Batch()

    def _flush_due(self) -> None:
        now = time.monotonic()
        if self.open.rows >= self.batch_rows or (
            self.open.offsets and now - self.open.opened >= self.batch_seconds
        ):
            self._seal()
        if self.sealed and now >= self._next_retry:
            self._store_sealed()
        buffered = self._buffered()
        if buffered >= self.max_buffer_rows and not self._paused:
            log.warning("ClickHouse is behind: %d rows buffered, pausing consumption", buffered)
            self.consumer.pause(self.consumer.assignment())
            self._paused = True
        elif self._paused and buffered < self.max_buffer_rows // 2:
            self.consumer.resume(self.consumer.assignment())
            self._paused = False

    def _buffered(self) -> int:
        return self.open.rows + sum(b.rows for b in self.sealed)

    def _store_sealed(self) -> bool:
        while self.sealed:
            batch = self.sealed[0]
            try:
                written = self._insert(batch.tables, batch.token) if batch.rows else {}
            except Exception as exc:  # unreachable or refusing: keep the batch, retry later
                self.stats.insert_failures += 1
                self._next_retry = time.monotonic() + self._backoff
                log.warning(
                    "ClickHouse insert of %d rows failed (%s); retrying in %.1f s",
                    batch.rows,
                    exc,
                    self._backoff,
                )
                self._backoff = min(self.backoff_max, self._backoff * 2)
                return False
            self.consumer.commit(offsets=batch.commit_positions(), asynchronous=False)
            self.sealed.pop(0)
            self.stats.batches += 1
            self.stats.stored += batch.rows
            for table, rows in written.items():
                self.stats.rows_by_table[table] = self.stats.rows_by_table.get(table, 0) + rows
            self._backoff = self.backoff_min
        return True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Store what we hold for the revoked partitions while we still own them; what
        # cannot be stored is dropped uncommitted and will be redelivered to the new owner.
        self._seal()
        if self.sealed and not self._store_sealed():
            log.warning(
                "dropping %d unstored batches on rebalance (redelivered later)", len(self.sealed)
            )
            self.sealed.clear()

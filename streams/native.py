"""The native transport of ``guard streams``: librdkafka batches, no per-record framework cost.

The same work as the faust app (:mod:`guard.streams.faust_app`): one
:class:`~guard.detectors.core.DetectionCore`, each consumed batch handed to its ``step``, on
confluent-kafka: one consumer in the group
``streams.app_id`` subscribes to the telemetry topics and the internal findings topic with
the range assignor, so partition *p* of every topic (same partition count, same murmur2
keys) goes to the same worker — node state, job state and fusion state stay co-located
with their input. Detector state is checkpointed to compacted changelog topics
(``<prefix><app_id>-<table>-changelog``, one partition per input partition) and read back
when a partition is assigned, so a restarted or rebalanced worker resumes where the last
checkpoint left it. Offsets are committed after the findings, flags and checkpoints they
caused are on the broker (at least once).

Measured against the faust transport on the same machine in ``benchmarks/streams_throughput.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.cimpl import NewTopic  # where it lives: .admin re-exports it unsaid

from guard.config import Settings, streams_state_key
from guard.detectors.core import TABLES, DetectionCore, encode_finding, finding_key
from guard.detectors.engine import EngineConfig
from guard.kafka import (
    dead_letter,
    make_consumer,
    make_producer,
    produce_raw,
    read_spans,
    wait_for_broker,
)
from guard.metrics import Metrics, dead_letter_reason
from guard.schemas import encode
from guard.schemas.topics import NODE_KINDS

from .metrics import flags_sent
from .processing import KeyedState, StreamsCounters, engine_config_of, node_reads, topic_kinds

__all__ = ["NativeWorker"]

log = logging.getLogger("guard.streams")


class NativeWorker:
    """A streams worker on confluent-kafka. ``run(stop)`` until ``stop`` is set."""

    def __init__(
        self,
        settings: Settings,
        engine_config: EngineConfig | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        cfg = engine_config or engine_config_of(settings)
        self.metrics = metrics
        s = self.settings = settings
        st = settings.streams
        self.counters = StreamsCounters()
        self.telemetry_topics = topic_kinds(s.topic)
        self.findings_topic = s.topic("findings")
        self.changelogs = {table: s.topic(f"{st.app_id}-{table}-changelog") for table in TABLES}
        self.restored: dict[str, dict[str, bytes]] = {table: {} for table in TABLES}
        self.states: dict[str, KeyedState] = {}
        self.state_key = streams_state_key(s)  # before any connection: a missing key fails fast
        self.producer = make_producer(s, **{"linger.ms": 5})
        self.core = DetectionCore(cfg, stores=self._table, counters=self.counters)
        self._create_internal_topics()
        topics = [*self.telemetry_topics, self.findings_topic]
        self.consumer: Consumer = make_consumer(
            s,
            st.app_id,
            topics,
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            **{
                "partition.assignment.strategy": "range",
                "fetch.max.bytes": 8 << 20,
                "max.partition.fetch.bytes": 1 << 20,
                "queued.max.messages.kbytes": 8192,  # a short queue keeps findings prompt
                "queued.min.messages": 5000,
                # Prefetch bounds: under a large backlog they are most of the worker's
                # memory (benchmarks/chaos.py hostile, 1M messages: peak RSS 1.39 GB at
                # 64 MB fetches, 16 MB a partition, 32 MB queued; 0.97–1.04 GB at these).
                # Fusion no longer depends on the order the topics interleave in (read
                # barriers, event-time queue), so tighter bounds keep the claims the same.
                **(metrics.kafka_conf() if metrics else {}),  # consumer lag
            },
        )

    def checkpoint_totals(self) -> dict[str, int]:
        """Keys resumed from checkpoints so far, and checkpoints refused, over the tables."""
        return KeyedState.totals(self.states.values())

    # -- set-up ----------------------------------------------------------------------------

    def _table(self, table: str, make: Callable[[str], Any]) -> KeyedState:
        """One of the core's tables, checkpointed to its changelog topic."""
        state = self.states[table] = KeyedState(make, self.settings.streams.checkpoint_s)
        topic = self.changelogs[table]
        store = self.restored[table]
        state.load = store.get
        state.secret = self.state_key

        def save(key: str, partition: int, blob: bytes) -> None:
            store[key] = blob
            self._produce(topic, blob, key.encode(), partition=partition)

        def delete(key: str, partition: int) -> None:
            store.pop(key, None)
            self._produce(topic, None, key.encode(), partition=partition)  # a tombstone

        state.save = save
        state.delete = delete
        return state

    def _create_internal_topics(self) -> None:
        k = self.settings.kafka
        admin = wait_for_broker(self.settings)
        existing = set(admin.list_topics(timeout=10).topics)
        wanted = [
            NewTopic(
                topic,
                num_partitions=k.telemetry_partitions,
                replication_factor=k.replication_factor,
                config=config,
            )
            for topic, config in (
                (t, {"cleanup.policy": "compact"}) for t in self.changelogs.values()
            )
            if topic not in existing
        ]
        if wanted:
            for future in admin.create_topics(wanted).values():
                try:
                    future.result(30)
                except Exception as exc:  # created meanwhile by another worker
                    if "exist" not in str(exc).lower():
                        raise

    # -- the loop --------------------------------------------------------------------------

    def run(
        self, stop: threading.Event, on_progress: Callable[[StreamsCounters], None] | None = None
    ) -> StreamsCounters:
        st = self.settings.streams
        last_commit = last_idle = last_progress = last_expire = time.monotonic()
        try:
            while not stop.is_set():
                records = self.consumer.consume(st.batch_max, st.batch_within_s)
                if records:
                    self._handle(records)
                now = time.monotonic()
                if now - last_idle >= 1.0:
                    last_idle = now
                    self._send_findings(self.core.idle(now))
                    if now - last_expire >= 10.0:
                        last_expire = now
                        self._expire()
                if now - last_commit >= 2.0:
                    last_commit = now
                    self._commit()
                if on_progress is not None and now - last_progress >= st.progress_s:
                    last_progress = now
                    on_progress(self.counters)
                self.producer.poll(0)
                if self.metrics is not None:
                    self.metrics.beat()
            self._commit()
        finally:
            self.consumer.close()
            self.producer.flush(30)
        return self.counters

    def _expire(self) -> None:
        self.core.expire(self.settings.streams.key_idle_s)

    def _handle(self, records: list[Message]) -> None:
        telemetry: list[Message] = []
        batch: list[tuple[int, str, bytes | None]] = []  # what the core reads of them
        findings: list[Message] = []
        kinds = self.telemetry_topics
        read: dict[tuple[str, int], int] = {}  # (topic, partition) -> last offset read
        for record in records:
            error = record.error()
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            if error is not None or topic is None or partition is None or offset is None:
                if error is not None and error.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", error)
                continue  # (a record without an error has a topic, partition and offset)
            kind = kinds.get(topic)
            if kind is not None:
                telemetry.append(record)
                batch.append((partition, kind, record.value()))
                read[topic, partition] = offset + 1
            elif topic == self.findings_topic:
                findings.append(record)
        out = self.core.step(
            batch,
            [(r.partition(), r.key() or b"", r.value() or b"") for r in findings],
            time.monotonic(),
            node_reads(read, kinds, self._end),
        )
        self._dead_letters(telemetry, out.bad)
        self._dead_letters(findings, out.bad_findings)
        self._send_findings(out.findings)
        for flag in out.flags:
            self._produce(
                self.settings.topic("remediation"),
                encode(flag),
                flag.kafka_key(),
                timestamp=int(flag.ts * 1000),
            )
        flags_sent(out.flags, "native")

    def _end(self, topic: str, partition: int) -> int:
        """The partition's end offset as the consumer last fetched it (-1: unknown)."""
        marks = self.consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
        return marks[1] if marks and marks[1] >= 0 else -1

    def _dead_letters(self, batch: list[Message], bad: Iterable[tuple[int, Exception]]) -> None:
        for index, error in bad:
            self.counters.dead_reasons[dead_letter_reason(error)] += 1
            r = batch[index]
            source = f"{r.topic()}/{r.partition()}/{r.offset()}"
            dead_letter(self.producer, self.settings, r.value(), error, source, r.key())

    def _send_findings(self, found: list[Any]) -> None:
        for f in found:
            self._produce(
                self.findings_topic,
                encode_finding(f),
                finding_key(f).encode(),
                timestamp=int(f.ts * 1000),
            )

    def _produce(self, topic: str, value: bytes | None, key: bytes | None, **kwargs: Any) -> None:
        produce_raw(self.producer, topic, value, key, **kwargs)

    def _commit(self) -> None:
        # What the consumed records caused must be on the broker before their offsets.
        self.producer.flush(30)
        try:
            self.consumer.commit(asynchronous=False)
        except Exception as exc:  # nothing consumed yet, or a rebalance in progress
            if "NO_OFFSET" not in str(exc):
                log.debug("commit skipped: %s", exc)

    # -- rebalancing -----------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = sorted({tp.partition for tp in partitions})
        log.info("partitions assigned: %s", ",".join(map(str, numbers)) or "none")
        self._positions(
            [tp for tp in partitions if self.telemetry_topics.get(tp.topic) in NODE_KINDS]
        )
        for table, topic in self.changelogs.items():
            self._restore(table, topic, numbers)

    def _positions(self, partitions: list[TopicPartition]) -> None:
        """Where reading the node-telemetry partitions just assigned starts (the committed
        offset, or the first) and ends, to the core: a node of theirs with no telemetry read
        yet is behind them, not absent, while they hold records unread."""
        kinds = self.telemetry_topics
        try:
            spans = read_spans(self.consumer, partitions)
            self.core.reads.update({(kinds[t], p): span for (t, p), span in spans.items()})
        except KafkaException as exc:  # the positions then come with the first records read
            log.warning("start offsets of the assigned partitions unknown: %s", exc)

    def _restore(self, table: str, topic: str, partitions: list[int]) -> None:
        """Read the changelog partitions to their end into the restore store."""
        if not partitions:
            return
        eof: dict[str, Any] = {"enable.partition.eof": True}
        reader = make_consumer(self.settings, f"{self.settings.streams.app_id}-restore", **eof)
        try:
            reader.assign([TopicPartition(topic, p, 0) for p in partitions])
            pending = set(partitions)
            store = self.restored[table]
            deadline = time.monotonic() + 60
            while pending and time.monotonic() < deadline:
                record = reader.poll(0.5)
                if record is None:
                    continue
                error = record.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard(record.partition())
                    continue
                # Any bytes can be planted here: a key no node has just never matches.
                key = (record.key() or b"").decode(errors="replace")
                value = record.value()
                if value is None:
                    store.pop(key, None)
                else:
                    store[key] = value
        finally:
            reader.close()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = {tp.partition for tp in partitions}
        log.info("partitions revoked: %s", ",".join(map(str, sorted(numbers))) or "none")
        self.core.forget(numbers)  # each table checkpoints what it drops
        self._commit()

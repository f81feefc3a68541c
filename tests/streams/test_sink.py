"""The ClickHouse sink against a real broker and a real chDB engine."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from guard.config import Settings
from guard.kafka import make_consumer, make_producer, produce
from guard.schemas import Flag, GpuSample, GuardMessage, NicSample, NodeState, StepTiming
from guard.store import insert_columns
from guard.streams.sink import ClickHouseSink, Tables


def _messages(now: float, n: int = 40) -> list[GuardMessage]:
    out: list[GuardMessage] = []
    for i in range(n):
        ts = now - n + i
        out.append(GpuSample(ts=ts, node=f"node-{i % 4}", job="j", gpu=i % 8, temp_c=60.0 + i % 5))
        out.append(StepTiming(ts=ts, node=f"node-{i % 4}", job="j", rank=i % 8, step=i, step_s=2.0))
    out.append(
        NicSample(ts=now, node="node-1", device="mlx5_0", port=1, counters={"symbol_error": 1})
    )
    out.append(
        Flag(
            ts=now,
            node="node-2",
            id="f1",
            detector="thermal",
            category="thermal",
            severity="warning",
            score=2.5,
            evidence={"temp_c": 93},
        )
    )
    out.append(NodeState(ts=now, node="node-2", state="suspect", prev="healthy", reason="f1"))
    return out


def _publish(
    settings: Settings, messages: list[GuardMessage], garbage: bytes | None = None
) -> None:
    producer = make_producer(settings)
    for m in messages:
        produce(producer, settings, m)
    if garbage is not None:
        producer.produce(settings.topic("gpu"), garbage, b"node-0")
    assert producer.flush(30) == 0


def _count(client: Any, settings: Settings, table: str) -> int:
    db = settings.clickhouse.database
    return int(client.query(f"SELECT count() FROM {db}.{table} FINAL").result_rows[0][0])


def _run_until(sink: ClickHouseSink, done: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        sink.step(0.2)


def _committed(settings: Settings, group: str, topic: str) -> int:
    consumer = make_consumer(settings, group)
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return sum(max(tp.offset, 0) for tp in committed)
    finally:
        consumer.close()


def test_sink_stores_every_kind_and_dead_letters_garbage(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.5
    messages = _messages(time.time())
    _publish(settings, messages, garbage=b'{"kind":"gpu","ts":"soon"}')
    sink = ClickHouseSink(settings, client, group_id="sink-a")
    try:
        _run_until(sink, lambda: sink.stats.stored == len(messages) and not sink.sealed)
    finally:
        sink.close()
    assert sink.stats.dead_letters == 1
    # the garbage record, and the flag and the node state (kinds without a fast decode)
    assert sink.stats.by_pydantic == 1 + 1 + 1
    assert _count(client, settings, "gpu_samples") == 40
    assert _count(client, settings, "step_timings") == 40
    assert _count(client, settings, "nic_samples") == 1
    assert _count(client, settings, "flags") == 1
    assert _count(client, settings, "node_states") == 1
    # offsets committed after storing, the garbage record included (it must not block)
    assert _committed(settings, "sink-a", settings.topic("gpu")) == 41
    # the dead letter carries the original bytes
    dlq = make_consumer(settings, "dlq-reader", [settings.topic("dlq")])
    record = None
    deadline = time.monotonic() + 30
    while record is None and time.monotonic() < deadline:
        r = dlq.poll(0.5)
        record = r if r is not None and not r.error() else None
    dlq.close()
    assert record is not None and record.value() == b'{"kind":"gpu","ts":"soon"}'


def test_unreachable_clickhouse_buffers_retries_and_commits_only_after_storing(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.3
    attempts = {"n": 0}

    def flaky_insert(batch: Tables, token: str) -> dict[str, int]:
        attempts["n"] += 1
        if attempts["n"] <= 3:  # ClickHouse down for the first three attempts
            raise ConnectionError("Connection refused")
        return insert_columns(client, settings, batch, dedup_token=token)

    messages = _messages(time.time())
    _publish(settings, messages)
    sink = ClickHouseSink(
        settings, client, group_id="sink-b", insert=flaky_insert, retry_backoff_s=(0.1, 0.4)
    )
    try:
        _run_until(sink, lambda: sink.stats.insert_failures >= 1)
        assert _committed(settings, "sink-b", settings.topic("gpu")) == 0  # nothing stored yet
        _run_until(sink, lambda: sink.stats.stored == len(messages) and not sink.sealed)
    finally:
        sink.close()
    assert sink.stats.insert_failures == 3
    assert _count(client, settings, "gpu_samples") == 40
    assert _committed(settings, "sink-b", settings.topic("gpu")) == 40


def test_full_buffer_pauses_consumption_and_loses_nothing(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_rows = 10
    settings.clickhouse.batch_seconds = 0.2
    down = threading.Event()
    down.set()

    def insert(batch: Tables, token: str) -> dict[str, int]:
        if down.is_set():
            raise ConnectionError("ClickHouse unreachable")
        return insert_columns(client, settings, batch, dedup_token=token)

    messages = _messages(time.time(), n=60)
    _publish(settings, messages)
    sink = ClickHouseSink(
        settings,
        client,
        group_id="sink-c",
        insert=insert,
        max_buffer_rows=30,
        retry_backoff_s=(0.05, 0.1),
    )
    try:
        _run_until(sink, lambda: sink._paused)
        buffered = sink.open.rows + sum(b.rows for b in sink.sealed)
        assert 30 <= buffered <= 40 < len(messages)  # bounded, not everything pulled in
        down.clear()
        _run_until(sink, lambda: sink.stats.stored == len(messages) and not sink.sealed)
    finally:
        sink.close()
    assert _count(client, settings, "gpu_samples") == 60
    assert _count(client, settings, "step_timings") == 60


def test_redelivery_after_a_crash_leaves_no_duplicates(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.3
    messages = _messages(time.time())
    _publish(settings, messages)

    class ProcessDied(BaseException):  # not an Exception: nothing in the sink catches it
        pass

    def insert_then_die(batch: Tables, token: str) -> dict[str, int]:
        insert_columns(client, settings, batch, dedup_token=token)
        raise ProcessDied  # rows stored, offsets never committed

    first = ClickHouseSink(settings, client, group_id="sink-d", insert=insert_then_die)
    with pytest.raises(ProcessDied):
        _run_until(first, lambda: False, timeout_s=30)
    first.sealed.clear()  # a dead process remembers nothing; leave the group cleanly
    first.open = type(first.open)()
    first.consumer.close()
    # the crash came after an insert; which topics its first batch held depends on which
    # partitions the consumer read first, so the rows of every table count
    tables = ("gpu_samples", "step_timings", "nic_samples", "flags")
    stored_once = sum(_count(client, settings, table) for table in tables)
    assert stored_once > 0
    second = ClickHouseSink(settings, client, group_id="sink-d")
    try:
        _run_until(second, lambda: second.stats.stored == len(messages) and not second.sealed)
    finally:
        second.close()
    assert {table: _count(client, settings, table) for table in tables} == {
        "gpu_samples": 40,
        "step_timings": 40,
        "nic_samples": 1,
        "flags": 1,
    }


def test_batch_records_are_stored_as_the_rows_of_their_samples(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    from guard.schemas import batch_messages

    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.5
    settings.clickhouse.batch_rows = 40  # 5 batch records of 8 rows
    now = float(int(time.time()))
    singles: list[GuardMessage] = []
    for tick in range(5):
        for node in range(4):
            singles += [
                GpuSample(ts=now - 10 + tick, node=f"bn-{node}", job="jb", gpu=g, temp_c=50.0 + g)
                for g in range(8)
            ]
            singles += [
                StepTiming(ts=now - 10 + tick + r / 100, node=f"bn-{node}", job="jb",
                           rank=8 * node + r, step=tick, step_s=2.0, compute_s=1.5)
                for r in range(8)
            ]  # fmt: skip
    records = batch_messages(singles)
    assert {m.kind for m in records} == {"gpu_batch", "step_batch"} and len(records) == 40
    _publish(settings, records)
    sizes: list[int] = []

    def insert(batch: Tables, token: str) -> dict[str, int]:
        sizes.append(sum(rows for rows, _ in batch.values()))
        return insert_columns(client, settings, batch, dedup_token=token)

    sink = ClickHouseSink(settings, client, group_id="sink-batches", insert=insert)
    try:
        _run_until(sink, lambda: sink.stats.stored == len(singles) and not sink.sealed)
    finally:
        sink.close()
    assert sum(sizes) == len(singles) and max(sizes) <= 40  # batches bounded by rows
    assert sink.stats.consumed == 40 and sink.stats.dead_letters == 0
    assert sink.stats.by_pydantic == 0  # clean batch records: all by the fast decode
    db = settings.clickhouse.database
    rows = client.query(
        f"SELECT node, gpu, toUnixTimestamp64Milli(ts), temp_c FROM {db}.gpu_samples FINAL "
        "WHERE job = 'jb' ORDER BY node, ts, gpu"
    ).result_rows
    want = sorted(
        (m.node, m.gpu, round(m.ts * 1000), m.temp_c) for m in singles if isinstance(m, GpuSample)
    )
    assert sorted(tuple(r) for r in rows) == want
    steps = client.query(
        f"SELECT rank, step, toUnixTimestamp64Milli(ts) FROM {db}.step_timings FINAL "
        "WHERE job = 'jb' ORDER BY rank, step"
    ).result_rows
    assert sorted(tuple(r) for r in steps) == sorted(
        (m.rank, m.step, round(m.ts * 1000)) for m in singles if isinstance(m, StepTiming)
    )

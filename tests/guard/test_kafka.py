"""Produce → consume of every message kind through the real broker."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from guard.config import ConfigError, Settings
from guard.kafka import (
    DLQ_ERROR_HEADER,
    TOPIC_BY_KIND,
    BrokerUnreachable,
    client_config,
    create_topics,
    dead_letter,
    faust_broker_settings,
    make_consumer,
    make_producer,
    produce,
    to_record,
    wait_for_broker,
)
from guard.schemas import SchemaError, decode, parse_message

from ..schemas.strategies import STRATEGIES


def _read_all(settings: Settings, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    """Read a topic from the beginning of every partition without a consumer group join."""
    consumer = make_consumer(settings, group_id=f"reader-{topic}")
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = [TopicPartition(topic, p, 0) for p in metadata.topics[topic].partitions]
        consumer.assign(partitions)
        records = []
        deadline = time.monotonic() + timeout_s
        while len(records) < expected and time.monotonic() < deadline:
            record = consumer.poll(0.5)
            if record is not None and not record.error():
                records.append(record)
        return records
    finally:
        consumer.close()


def test_every_kind_round_trips_through_kafka(kafka_settings: Settings) -> None:
    drawn: dict[str, list] = {}

    @hsettings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        for kind, strategy in STRATEGIES.items():
            drawn[kind] = [data.draw(strategy) for _ in range(5)]

    draw()
    # Drawn event times reach back to 2001: the broker stamps records with them and deletes
    # what is older than its retention (7 days) at its next check, every minute — a record
    # could be gone before it was read. Recent times, one second apart, keep every record.
    now = time.time()
    for kind, messages in drawn.items():
        drawn[kind] = [m.model_copy(update={"ts": now - 60 - i}) for i, m in enumerate(messages)]
    producer = make_producer(kafka_settings)
    for messages in drawn.values():
        for message in messages:
            produce(producer, kafka_settings, message)
    assert producer.flush(30) == 0

    for kind, messages in drawn.items():
        topic = kafka_settings.topic(TOPIC_BY_KIND[kind])
        records = _read_all(kafka_settings, topic, len(messages))
        got = [decode(r.value(), kind) for r in records]
        assert sorted(got, key=repr) == sorted(messages, key=repr), kind
        for record, message in zip(records, got, strict=True):
            assert record.key() == message.kafka_key()
            # message timestamp = event time (ms)
            assert record.timestamp()[1] == int(message.ts * 1000)


def test_same_key_lands_on_one_partition(kafka_settings: Settings) -> None:
    from guard.schemas import GpuSample

    producer = make_producer(kafka_settings)
    for i in range(30):
        produce(producer, kafka_settings, GpuSample(ts=1000.0 + i, node=f"node-{i % 3}", gpu=i % 8))
    assert producer.flush(30) == 0
    records = _read_all(kafka_settings, kafka_settings.topic("gpu"), 30)
    partitions: dict[bytes, set[int]] = {}
    for r in records:
        partitions.setdefault(r.key(), set()).add(r.partition())
    assert len(records) == 30
    assert all(len(p) == 1 for p in partitions.values())


def test_bad_message_goes_to_the_dead_letter_topic_untouched(kafka_settings: Settings) -> None:
    raw = b'{"kind":"gpu","ts":1,"node":"n\xe9","gpu":0}'
    producer = make_producer(kafka_settings)
    try:
        parse_message(raw)
    except SchemaError as exc:
        dead_letter(producer, kafka_settings, raw, exc, source="guard.gpu/0/42", key=b"n")
    assert producer.flush(30) == 0
    [record] = _read_all(kafka_settings, kafka_settings.topic("dlq"), 1)
    assert record.value() == raw
    headers = dict(record.headers())
    assert b"not valid JSON" in headers[DLQ_ERROR_HEADER] or b"gpu" in headers[DLQ_ERROR_HEADER]
    assert headers["guard-source"] == b"guard.gpu/0/42"


def test_topics_are_created_once_with_their_configs(kafka_settings: Settings) -> None:
    again = create_topics(kafka_settings)
    assert set(again.values()) == {"exists"}
    # 4 telemetry, findings, 5 control (remediation, sweeps, node-state, dlq, advice)
    assert len(again) == 10
    assert to_record(
        kafka_settings,
        parse_message(b'{"kind":"node_state","ts":1,"node":"n1","state":"cordoned"}'),
    ).topic == kafka_settings.topic("node-state")


def test_faust_clients_use_the_same_security_settings(kafka_settings: Settings) -> None:
    """The faust engine's clients (aiokafka) get protocol, SASL and TLS from the same
    settings as librdkafka's; CI runs this module against a SCRAM listener too."""
    import asyncio

    from aiokafka import AIOKafkaProducer
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    settings = kafka_settings
    conf = faust_broker_settings(settings)
    auth = credentials_to_aiokafka_auth(conf["broker_credentials"])
    assert auth["security_protocol"] == settings.kafka.security_protocol
    if settings.kafka.security_protocol.startswith("SASL_"):
        assert auth["sasl_mechanism"] == settings.kafka.sasl_mechanism
        assert auth["sasl_plain_username"] == settings.kafka.sasl_username

    async def send() -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=[b.removeprefix("kafka://") for b in conf["broker"]], **auth
        )
        await producer.start()
        try:
            await producer.send_and_wait(settings.topic("dlq"), b"from faust", key=b"k")
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(send(), 60))
    [record] = _read_all(settings, settings.topic("dlq"), 1)  # read back through librdkafka
    assert record.value() == b"from faust"


def test_credentials_the_broker_refuses_are_a_clear_error(kafka_settings: Settings) -> None:
    settings = kafka_settings
    if settings.kafka.security_protocol == "PLAINTEXT":
        settings.kafka.security_protocol = "SASL_PLAINTEXT"  # without the SASL settings
        with pytest.raises(ConfigError, match=r"sasl_mechanism, kafka\.sasl_username"):
            client_config(settings)
        return
    settings.kafka.sasl_password = "not-the-password"  # type: ignore[assignment]
    with pytest.raises(BrokerUnreachable, match="refused Guard's credentials"):
        wait_for_broker(settings, timeout_s=20)

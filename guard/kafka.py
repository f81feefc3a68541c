"""Kafka plumbing: topics, producer and consumer factories, model → record, dead letters.

confluent-kafka (librdkafka) is used for everything outside the faust workers. Producers
use ``partitioner=murmur2_random`` so that a key lands on the partition faust (aiokafka,
murmur2) expects, and stamp each record with the message's event time.
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

# NewTopic's home: confluent_kafka.admin re-exports it without saying so (no __all__)
from confluent_kafka.cimpl import NewTopic

from guard.config import ConfigError, Settings
from guard.errors import GuardError
from guard.schemas import GuardMessage, encode

# The topic map lives in schemas/topics.py; re-exported for the transport code.
from guard.schemas.topics import CONTROL_TOPICS, INTERNAL_TOPICS, TELEMETRY_TOPICS, TOPIC_BY_KIND

__all__ = [
    "CONTROL_TOPICS",
    "DLQ_ERROR_HEADER",
    "INTERNAL_TOPICS",
    "TELEMETRY_TOPICS",
    "TOPIC_BY_KIND",
    "BrokerUnreachable",
    "KafkaRecord",
    "client_config",
    "create_topics",
    "dead_letter",
    "faust_broker_settings",
    "make_consumer",
    "make_producer",
    "produce",
    "produce_raw",
    "read_spans",
    "to_record",
    "topic_specs",
    "wait_for_broker",
]


DLQ_ERROR_HEADER = "guard-error"
DLQ_SOURCE_HEADER = "guard-source"


_AFTER_MS = re.compile(r"after \d+ms")


class LibrdkafkaLog:
    """librdkafka's own log (``logger`` of every client) as Guard's logger
    ``guard.kafka.librdkafka``: formatted like Guard's lines instead of raw ``%3|...|FAIL|``
    lines from librdkafka's threads, one level lower (a failed connection is a retry; Guard
    says what failed when it gives up: ``--log-level error`` hides them), and each distinct
    line at most once every ``every_s`` (a broker away repeats the same line many times a
    second).

    >>> import logging, sys
    >>> logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
    >>> log = LibrdkafkaLog(every_s=60)
    >>> for _ in range(3):
    ...     log.log(logging.ERROR, "%s [%s] %s", "FAIL", "guard#producer-1", "refused")
    WARNING FAIL [guard#producer-1] refused
    """

    DEMOTED: ClassVar[dict[int, int]] = {
        logging.CRITICAL: logging.ERROR,
        logging.ERROR: logging.WARNING,
        logging.WARNING: logging.INFO,
    }

    def __init__(self, name: str = "guard.kafka.librdkafka", every_s: float = 60.0) -> None:
        self.logger = logging.getLogger(name)
        self.every_s = every_s
        self._said: dict[str, float] = {}
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: Any) -> None:
        level = self.DEMOTED.get(level, logging.DEBUG)
        if not self.logger.isEnabledFor(level):
            return
        text = msg % args if args else msg
        key = _AFTER_MS.sub("after ms", text)  # "failed (after 0ms in state CONNECT)"
        now = time.monotonic()
        with self._lock:
            if now - self._said.get(key, -self.every_s) < self.every_s:
                return
            if len(self._said) > 1000:  # bounded: the lines name brokers and clients
                self._said.clear()
            self._said[key] = now
        self.logger.log(level, "%s", text)


#: The one librdkafka log of this process (its memory of lines already said is shared).
librdkafka_log = LibrdkafkaLog()


class BrokerUnreachable(GuardError):
    """No Kafka broker answered at the configured bootstrap address."""


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    topic: str
    key: bytes | None
    value: bytes
    timestamp_ms: int


def _check_security(settings: Settings) -> None:
    """A security protocol without what it needs is a clear error, not a hung connection."""
    k = settings.kafka
    if k.security_protocol.startswith("SASL_"):
        missing = [
            f"kafka.{name}"
            for name in ("sasl_mechanism", "sasl_username", "sasl_password")
            if getattr(k, name) is None
        ]
        if missing:
            raise ConfigError(
                f"kafka.security_protocol is {k.security_protocol} but {', '.join(missing)} "
                "is not set; set it in the TOML file or as GUARD_KAFKA_SASL_MECHANISM, "
                "GUARD_KAFKA_SASL_USERNAME, GUARD_KAFKA_SASL_PASSWORD"
            )


def client_config(settings: Settings) -> dict[str, Any]:
    """librdkafka settings shared by producers, consumers and the admin client: the one
    place Kafka security (SASL PLAIN/SCRAM, TLS) is turned into client settings; the faust
    engine gets the same from :func:`faust_broker_settings`."""
    _check_security(settings)
    k = settings.kafka
    conf: dict[str, Any] = {
        "bootstrap.servers": k.bootstrap,
        "client.id": k.client_id,
        "security.protocol": k.security_protocol,
        "log.connection.close": False,  # idle brokers closing connections is not news
        "logger": librdkafka_log,
    }
    optional = {
        "sasl.mechanism": k.sasl_mechanism,
        "sasl.username": k.sasl_username,
        "sasl.password": k.sasl_password.get_secret_value() if k.sasl_password else None,
        "ssl.ca.location": k.ssl_ca_location,
        "ssl.certificate.location": k.ssl_certificate_location,
        "ssl.key.location": k.ssl_key_location,
        "ssl.key.password": k.ssl_key_password.get_secret_value() if k.ssl_key_password else None,
    }
    conf.update({key: value for key, value in optional.items() if value is not None})
    conf.update(k.extra)
    return conf


def _ssl_context(settings: Settings) -> ssl.SSLContext:
    k = settings.kafka
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=k.ssl_ca_location)
    if k.ssl_certificate_location:
        password = k.ssl_key_password.get_secret_value() if k.ssl_key_password else None
        context.load_cert_chain(k.ssl_certificate_location, k.ssl_key_location, password)
    return context


def faust_broker_settings(settings: Settings) -> dict[str, Any]:
    """faust (aiokafka) app settings for the configured brokers and security: ``broker``
    and ``broker_credentials``, the same protocol, SASL mechanism, user and TLS files as
    :func:`client_config` gives librdkafka. ``kafka.extra`` is librdkafka's only."""
    import faust

    k = settings.kafka
    _check_security(settings)
    broker = [f"kafka://{b.strip()}" for b in k.bootstrap.split(",") if b.strip()]
    protocol = k.security_protocol
    credentials: Any = None
    context = _ssl_context(settings) if protocol in ("SSL", "SASL_SSL") else None
    if protocol.startswith("SASL_"):
        credentials = faust.SASLCredentials(
            username=k.sasl_username,
            password=k.sasl_password.get_secret_value() if k.sasl_password else None,
            mechanism=k.sasl_mechanism,
            ssl_context=context,
        )
    elif context is not None:
        credentials = faust.SSLCredentials(context)
    return {"broker": broker, "broker_credentials": credentials}


def make_producer(settings: Settings, **overrides: Any) -> Producer:
    """An idempotent, zstd-compressing producer that partitions like faust does."""
    conf = client_config(settings)
    conf.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "zstd",
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "partitioner": "murmur2_random",
            "message.timeout.ms": 120_000,
        }
    )
    conf.update(overrides)
    return Producer(conf)


def make_consumer(
    settings: Settings,
    group_id: str,
    topics: Iterable[str] | None = None,
    on_assign: Any = None,
    on_revoke: Any = None,
    **overrides: Any,
) -> Consumer:
    """A consumer that commits only when told (``enable.auto.commit`` off), from the start."""
    conf = client_config(settings)
    conf.update(
        {
            "group.id": group_id,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": settings.kafka.session_timeout_ms,
            "heartbeat.interval.ms": max(500, settings.kafka.session_timeout_ms // 4),
        }
    )
    conf.update(overrides)
    for_group = getattr(conf.get("stats_cb"), "for_group", None)
    if for_group is not None:  # guard.metrics.LagFeed: the lag is this group's
        conf["stats_cb"] = for_group(group_id)
    consumer = Consumer(conf)
    if topics is not None:
        callbacks = {"on_assign": on_assign, "on_revoke": on_revoke}
        consumer.subscribe(list(topics), **{k: v for k, v in callbacks.items() if v is not None})
    return consumer


def read_spans(
    consumer: Consumer, partitions: list[Any], timeout_s: float = 10.0
) -> dict[tuple[str, int], tuple[int, int]]:
    """(topic, partition) -> where reading it starts (the group's committed offset, else the
    partition's first) and where it ends now (its high watermark), for ``partitions`` just
    assigned to ``consumer``; :class:`KafkaException` when the broker does not answer."""
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for tp in consumer.committed(partitions, timeout=timeout_s):
        low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
        spans[tp.topic, tp.partition] = (tp.offset if tp.offset >= 0 else low, high)
    return spans


def to_record(settings: Settings, message: GuardMessage) -> KafkaRecord:
    """The one place a model becomes a Kafka record: topic by kind, key per the contract."""
    return KafkaRecord(
        topic=settings.topic(TOPIC_BY_KIND[message.kind]),
        key=message.kafka_key(),
        value=encode(message),
        timestamp_ms=int(message.ts * 1000),
    )


def produce(
    producer: Producer, settings: Settings, message: GuardMessage, on_delivery: Any = None
) -> None:
    """Queue one message; waits (polling) instead of failing when the local queue is full."""
    record = to_record(settings, message)
    produce_raw(
        producer,
        record.topic,
        record.value,
        record.key,
        timestamp=record.timestamp_ms,
        on_delivery=on_delivery,
    )


def produce_raw(
    producer: Producer, topic: str, value: bytes | None, key: bytes | None, **kwargs: Any
) -> None:
    """``producer.produce`` that waits (polling) instead of failing on a full local queue."""
    while True:
        try:
            producer.produce(topic, value, key, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


def dead_letter(
    producer: Producer,
    settings: Settings,
    raw: bytes | None,
    error: Exception | str,
    source: str,
    key: bytes | None = None,
) -> None:
    """Send an unusable message to the dead-letter topic, as it was, with the reason.

    The value is the original bytes untouched (even when not UTF-8); the reason and the
    source (``topic/partition/offset``) travel in headers.
    """
    produce_raw(
        producer,
        settings.topic("dlq"),
        raw,
        key,
        headers=[
            (DLQ_ERROR_HEADER, str(error).encode()[:4096]),
            (DLQ_SOURCE_HEADER, source.encode()),
        ],
    )


def topic_specs(settings: Settings) -> list[NewTopic]:
    """Every topic Guard uses, with partitions and retention."""
    k = settings.kafka
    hours = 3_600_000
    specs = [
        NewTopic(
            settings.topic(name),
            num_partitions=k.telemetry_partitions,
            replication_factor=k.replication_factor,
            config={"retention.ms": str(int(k.telemetry_retention_hours * hours))},
        )
        for name in TELEMETRY_TOPICS
    ]
    specs += [
        NewTopic(
            settings.topic(name),
            num_partitions=k.telemetry_partitions,
            replication_factor=k.replication_factor,
            config={"retention.ms": str(24 * hours)},
        )
        for name in INTERNAL_TOPICS
    ]
    control = {
        "remediation": {"retention.ms": str(int(k.dlq_retention_hours * hours))},
        "sweeps": {"retention.ms": str(int(k.dlq_retention_hours * hours))},
        # The latest state per node wins; tombstones are kept a day for slow readers.
        "node-state": {"cleanup.policy": "compact", "delete.retention.ms": str(24 * hours)},
        "dlq": {"retention.ms": str(int(k.dlq_retention_hours * hours))},
        "advice": {"retention.ms": str(int(k.dlq_retention_hours * hours))},  # C4P plans
    }
    specs += [
        NewTopic(
            settings.topic(name),
            num_partitions=k.control_partitions,
            replication_factor=k.replication_factor,
            config=config,
        )
        for name, config in control.items()
    ]
    return specs


def wait_for_broker(settings: Settings, timeout_s: float = 15.0) -> AdminClient:
    """An admin client once the broker answers, else :class:`BrokerUnreachable`."""
    refused: list[KafkaError] = []

    def on_error(error: KafkaError) -> None:
        if error.code() in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED):
            refused.append(error)

    # librdkafka takes callbacks in the config; AdminClient's annotation allows scalars only
    conf: dict[str, Any] = {**client_config(settings), "error_cb": on_error}
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline and not refused:
        try:
            admin.list_topics(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
            return admin
        except KafkaException as exc:
            last = exc
            admin.poll(0.2)  # serves error_cb: an authentication failure ends the wait
    if refused:
        k = settings.kafka
        raise BrokerUnreachable(
            f"the broker at {k.bootstrap} refused Guard's credentials ({refused[0].str()}); "
            f"check kafka.sasl_username ({k.sasl_username}), kafka.sasl_password and "
            f"kafka.sasl_mechanism ({k.sasl_mechanism}), or GUARD_KAFKA_SASL_*"
        )
    raise BrokerUnreachable(
        f"no Kafka broker answered at {settings.kafka.bootstrap} within {timeout_s:.0f} s "
        f"({last}); start one with `guard broker` or deploy/kafka/kafka.sh start, "
        "or set GUARD_KAFKA_BOOTSTRAP"
    )


def create_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic that does not exist yet. Returns topic → ``created`` | ``exists``."""
    admin = wait_for_broker(settings, timeout_s=timeout_s)
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = [spec for spec in topic_specs(settings) if spec.topic not in existing]
    result = {spec.topic: "exists" for spec in topic_specs(settings) if spec.topic in existing}
    if not wanted:
        return result
    futures = admin.create_topics(wanted, request_timeout=timeout_s)
    for topic, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            result[topic] = "created"
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                result[topic] = "exists"
            else:
                raise
    _wait_for_metadata(admin, [spec.topic for spec in wanted], timeout_s)
    return result


def _wait_for_metadata(admin: AdminClient, topics: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metadata = admin.list_topics(timeout=timeout_s)
        if all(
            t in metadata.topics and metadata.topics[t].partitions and not metadata.topics[t].error
            for t in topics
        ):
            return
        time.sleep(0.1)

"""Publisher and spool against a real broker that is stopped and restarted mid-stream."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from guard.agents.publisher import Publisher
from guard.broker import EmbeddedBroker, free_port
from guard.config import Settings
from guard.kafka import TOPIC_BY_KIND, create_topics, make_consumer
from guard.schemas import GpuSample, decode

pytestmark = pytest.mark.kafka
T0 = 1767225600.0


def _sample(i: int) -> GpuSample:
    return GpuSample(ts=T0 + i, node="node-1", job="job-a", gpu=i % 8, temp_c=50.0)


def consume_topics(
    settings: Settings, names: list[str], count: int, timeout_s: float = 60
) -> list[Any]:
    """Messages of Guard topics ``names`` (all partitions, from the start) until ``count``."""
    consumer = make_consumer(settings, f"check-{time.monotonic_ns()}")
    kinds = {settings.topic(TOPIC_BY_KIND[kind]): kind for kind in TOPIC_BY_KIND}
    partitions = []
    for name in names:
        topic = settings.topic(name)
        metadata = consumer.list_topics(topic, timeout=10)
        partitions += [
            TopicPartition(topic, p, OFFSET_BEGINNING) for p in metadata.topics[topic].partitions
        ]
    consumer.assign(partitions)
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and len(got) < count:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            got.append(decode(msg.value(), kinds[msg.topic()]))
    finally:
        consumer.close()
    return got


def _wait(publisher: Publisher, condition: Callable[[], bool], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"publisher stuck in state {publisher.state}"
        publisher.poll()
        time.sleep(0.05)


def test_spool_survives_a_broker_restart_with_nothing_lost(settings: Settings) -> None:
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    settings.kafka.bootstrap = broker.bootstrap
    settings.agent.delivery_timeout_s = 2.0
    create_topics(settings)
    publisher = Publisher(settings, probe_s=0.5)
    try:
        for i in range(200):
            publisher.publish(_sample(i))
        publisher.flush(30)
        assert publisher.state == "online" and publisher.stats["delivered"] == 200

        broker.stop()  # mid-stream: these go out, fail after the delivery timeout, get spooled
        for i in range(200, 500):
            publisher.publish(_sample(i))
            publisher.poll()
        _wait(publisher, lambda: publisher.state == "offline")
        for i in range(500, 700):  # while offline: straight to the spool
            publisher.publish(_sample(i))
            publisher.poll()
        assert len(publisher.spool) == 500 and publisher.dropped == 0

        broker = EmbeddedBroker(port=port).start()  # memory storage: a fresh, empty broker
        create_topics(settings)
        # Telemetry keeps coming while the backlog replays; it queues behind, then the
        # publisher goes back to publishing directly.
        more = iter(range(700, 100_000))

        def caught_up() -> bool:
            publisher.publish(_sample(next(more)))
            return publisher.state == "online" and len(publisher.spool) == 0

        _wait(publisher, caught_up)
        last = next(more)
        publisher.publish(_sample(last))
        publisher.flush(30)
    finally:
        publisher.close()
        broker_stats = dict(publisher.stats)
        got = consume_topics(settings, ["gpu"], last + 1 - 200)
        broker.stop()
    seen = [m.ts - T0 for m in got]
    assert set(seen) == set(range(200, last + 1))  # everything published after the outage began
    first = list(dict.fromkeys(seen))
    assert first == sorted(first)  # in order (one key: one partition)
    assert broker_stats["replayed"] >= 500


def test_beyond_the_spool_bound_drops_are_counted_and_nothing_blocks(settings: Settings) -> None:
    settings.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nobody listens
    settings.agent.delivery_timeout_s = 1.0
    settings.agent.spool_max_bytes = 64 << 10
    publisher = Publisher(settings, probe_s=0.5)
    for i in range(300):
        publisher.publish(_sample(i))
    _wait(publisher, lambda: publisher.state == "offline")
    for i in range(300, 3000):
        publisher.publish(_sample(i))
        publisher.poll()
    assert publisher.spool.size_bytes <= 64 << 10
    assert publisher.dropped > 0 and publisher.dropped + len(publisher.spool) == 3000
    publisher.close()
    assert publisher.stats["published"] == 3000


def test_a_record_the_broker_can_never_take_is_dropped_not_spooled(
    kafka_settings: Settings,
) -> None:
    from guard.kafka import make_producer
    from guard.schemas import NicSample

    publisher = Publisher(
        kafka_settings,
        producer_factory=lambda: make_producer(kafka_settings, **{"message.max.bytes": 4000}),
    )
    huge = NicSample(
        ts=T0, node="node-1", device="mlx5_0", port=1, counters={f"c{i:03d}": i for i in range(400)}
    )
    publisher.publish(_sample(1))
    publisher.publish(huge)  # too large for this producer: refused, counted, not retried
    publisher.publish(_sample(2))
    publisher.flush(30)
    assert publisher.state == "online" and len(publisher.spool) == 0
    assert publisher.stats["rejected"] == 1 and publisher.stats["delivered"] == 2
    publisher.close()


def test_probing_an_absent_broker_does_not_hold_up_the_agent(settings: Settings) -> None:
    # A probe of a broker that is away waits out its timeout (1 s): the agent's 1 Hz
    # collection loop calls poll() and must get it back while the probe is still waiting.
    settings.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nobody listens
    settings.agent.delivery_timeout_s = 1.0
    publisher = Publisher(settings, probe_s=0.5)
    publisher.publish(_sample(0))
    _wait(publisher, lambda: publisher.state == "offline")
    time.sleep(0.6)  # the next probe is due
    publisher.poll()
    probe = publisher._probe
    assert probe is not None and probe.is_alive()  # poll() returned, the probe still waits
    probe.join(10)
    assert not probe.ready and publisher.state == "offline"
    publisher.poll()  # the finished probe's answer is taken: still away
    assert publisher.state == "offline" and len(publisher.spool) == 1
    publisher.close()


def test_librdkafka_speaks_through_guards_log_once_per_line(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's producer and broker probes log as the services' clients do: through
    guard.kafka's LibrdkafkaLog (formatted, one level lower, each line once a minute), not a
    logger of their own that repeats every reconnect."""
    caplog.set_level(logging.DEBUG, logger="guard")
    settings.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nobody listens
    settings.agent.delivery_timeout_s = 1.0
    publisher = Publisher(settings, probe_s=0.5)
    publisher.publish(_sample(0))
    deadline = time.monotonic() + 4  # librdkafka reconnects every 0.1-1 s meanwhile
    while time.monotonic() < deadline:
        publisher.poll()
        time.sleep(0.05)
    publisher.close()
    said = [r for r in caplog.records if "librdkafka" in r.name]
    assert said, "librdkafka said nothing about a broker that is not there"
    assert {r.name for r in said} == {"guard.kafka.librdkafka"}
    texts = [re.sub(r"after \d+ms", "after ms", r.getMessage()) for r in said]
    assert len(texts) == len(set(texts)), texts  # each distinct line once
    assert any("Connection refused" in t for t in texts), texts
    assert all(r.levelno <= logging.WARNING for r in said)  # demoted: a retry, not an error

"""A host whose clock runs over an hour ahead: Kafka refuses its records; the node is flagged.

Apache Kafka 4.x refuses records stamped more than ``log.message.timestamp.after.max.ms``
(1 h) ahead of the broker. The embedded Tansu broker does not check timestamps, so this
module runs against Apache Kafka: the session's broker when it is one (CI), else the one
``deploy/kafka/kafka.sh`` starts (Java and Maven needed; about 25 s).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from guard.agents.daemon import AgentDaemon, JobTracker
from guard.agents.publisher import Publisher
from guard.config import Settings
from guard.kafka import create_topics
from guard.schemas import Flag, GpuSample

from .test_publisher import consume_topics

KAFKA_SH = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"
AHEAD_S = 2 * 3600.0


def _refuses_future_records(bootstrap: str) -> bool:
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 10000})
    errors: list[object] = []
    stamp = int((time.time() + AHEAD_S) * 1000)
    producer.produce(
        "guard-clock-probe", b"probe", timestamp=stamp, on_delivery=lambda e, m: errors.append(e)
    )
    producer.flush(15)
    return bool(errors and errors[0] is not None)


@pytest.fixture(scope="module")
def apache_kafka(kafka_bootstrap: str) -> Iterator[str]:
    if _refuses_future_records(kafka_bootstrap):
        yield kafka_bootstrap
        return
    started = (
        subprocess.run(
            [str(KAFKA_SH), "status"], capture_output=True, text=True, check=False
        ).returncode
        != 0
    )
    done = subprocess.run(
        [str(KAFKA_SH), "start"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"deploy/kafka/kafka.sh start failed: {done.stderr[-2000:]}"
    try:
        yield done.stdout.strip().splitlines()[-1]
    finally:
        if started:
            subprocess.run([str(KAFKA_SH), "stop"], capture_output=True, check=False)


def test_refused_records_are_counted_said_once_and_the_node_is_flagged(
    settings: Settings, apache_kafka: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings.kafka.bootstrap = apache_kafka
    settings.kafka.security_protocol = os.environ.get("GUARD_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")  # type: ignore[assignment]
    create_topics(settings)
    publisher = Publisher(settings)

    def skewed_clock_gpu(ts: float, job: str | None) -> list[GpuSample]:
        # what this host's collectors stamp when its clock runs two hours ahead
        return [
            GpuSample(ts=time.time() + AHEAD_S, node="node-9", gpu=g, temp_c=60.0) for g in range(8)
        ]

    daemon = AgentDaemon("node-9", publisher, [skewed_clock_gpu], JobTracker())
    with caplog.at_level(logging.ERROR, logger="guard.agents.publisher"):
        for _ in range(5):
            daemon.cycle()
            publisher.flush(15)
    deadline = time.monotonic() + 30
    while daemon.clock_notices.flags == 0 and time.monotonic() < deadline:
        daemon.cycle()
        publisher.flush(5)
    stats = publisher.stats
    deadline = time.monotonic() + 30  # every delivery report in
    while stats["rejected"] + stats["delivered"] < stats["published"] < 1e9:
        assert time.monotonic() < deadline, stats
        publisher.flush(1)
    # refused for its timestamp, or (batched) as an invalid record: counted, not lost silently
    assert stats["refused_timestamp"] + stats["refused_invalid"] == stats["rejected"] >= 40
    assert publisher.stats["delivered"] >= 1  # the flag, stamped so that the broker takes it
    assert len(publisher.spool) == 0  # refused for good: not spooled, nothing blocks
    said = [r for r in caplog.records if "refused a record" in r.getMessage()]
    assert len(said) == 1 and "ahead" in said[0].getMessage()
    assert len(caplog.records) == 1  # said once, not once per record
    assert publisher.refused_ahead_s is not None and publisher.refused_ahead_s > 3600
    [flag] = consume_topics(settings, ["remediation"], 1)
    assert isinstance(flag, Flag)
    assert (flag.node, flag.category, flag.severity, flag.detector) == (
        "node-9",
        "anomaly",
        "warning",
        "agent_clock",
    )
    assert flag.evidence["telemetry_refused"] >= 8  # the first cycle's eight GPUs, or more
    assert daemon.status()["refused_invalid"] == stats["refused_invalid"]
    publisher.close()

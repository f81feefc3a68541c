"""`guard broker` starts the embedded Tansu broker, serves a round trip, and stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from guard.config import Settings
from guard.kafka import create_topics, make_consumer, make_producer, produce
from guard.schemas import GpuSample, decode


def test_guard_broker_serves_a_round_trip_and_stops(settings: Settings) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "guard.cli", "broker"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        bootstrap = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert bootstrap.startswith("127.0.0.1:"), proc.stderr.read()  # type: ignore[union-attr]
        settings.kafka.bootstrap = bootstrap
        create_topics(settings)
        sample = GpuSample(ts=time.time(), node="n1", gpu=3, temp_c=71.0)
        producer = make_producer(settings)
        produce(producer, settings, sample)
        assert producer.flush(20) == 0
        consumer = make_consumer(settings, "broker-test", [settings.topic("gpu")])
        got = None
        deadline = time.monotonic() + 40
        while got is None and time.monotonic() < deadline:
            record = consumer.poll(0.5)
            if record is not None and not record.error():
                got = decode(record.value(), "gpu")
        consumer.close()
        assert got == sample
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "broker stopped" in err
    # the child broker is gone: nothing listens on its port any more
    import socket

    host, port = bootstrap.split(":")
    with socket.socket() as sock:
        assert sock.connect_ex((host, int(port))) != 0

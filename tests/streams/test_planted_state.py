"""A state record planted on a changelog topic (real Kafka) executes nothing and stops nothing.

Someone with ordinary write access to the cluster produces checkpoints under real node keys:
a forged one, one in the format before checkpoints were signed, one signed with the real key
(as if it leaked) whose pickle calls ``os.system``, and one under a key that is not UTF-8.
Each worker engine must refuse them all, count the refusals, start those keys cold and go on
turning telemetry into flags.
"""

from __future__ import annotations

import os
import pickle
import time
import zlib
from pathlib import Path

import pytest
from confluent_kafka.admin import NewTopic

from guard.config import Settings, streams_state_key
from guard.kafka import make_producer, produce, wait_for_broker
from guard.streams.checkpoints import CHECKPOINT_FORMAT, seal

from .planted import RunsCommand
from .test_faust_app import _latest_progress, gpu_round, read_flags, streams_worker, wait_for


def _changelog(settings: Settings, engine: str, app_id: str, table: str) -> str:
    # faust names a table's changelog after the app id alone; the native worker adds the prefix
    name = f"{app_id}-{table}-changelog"
    return name if engine == "faust" else settings.topic(name)


def _plant(settings: Settings, engine: str, app_id: str, marker: Path) -> int:
    """Plant the hostile checkpoints; returns how many a worker should refuse."""
    evil = zlib.compress(pickle.dumps(RunsCommand(marker)), 1)
    key = streams_state_key(settings)  # embedded mode: the key the worker will use
    node_table = {
        b"node-a": CHECKPOINT_FORMAT + os.urandom(32) + evil,
        b"node-b": b"guard-state-2:" + evil,
        b"node-c": seal(key, "node-c", RunsCommand(marker)),
        b"\xff\xfenode": b"\x00garbage",
    }
    fusion_table = {b"node-b": CHECKPOINT_FORMAT + os.urandom(32) + evil}
    admin = wait_for_broker(settings)
    topics = {
        _changelog(settings, engine, app_id, t): records
        for t, records in (("node-detectors", node_table), ("fusion", fusion_table))
    }
    futures = admin.create_topics(
        [
            NewTopic(
                t, settings.kafka.telemetry_partitions, 1, config={"cleanup.policy": "compact"}
            )
            for t in topics
        ]
    )
    for future in futures.values():
        future.result(30)
    producer = make_producer(settings)  # murmur2: each key on its node's partition
    for topic, records in topics.items():
        for k, v in records.items():
            producer.produce(topic, v, k)
    assert producer.flush(30) == 0
    return 4  # node-a, node-b, node-c and fusion's node-b; the odd key matches no node


@pytest.mark.parametrize("engine", ["native", "faust"])
def test_a_planted_state_record_runs_nothing_and_stops_nothing(
    kafka_settings: Settings, tmp_path: Path, engine: str
) -> None:
    settings = kafka_settings
    app_id = f"planted-{settings.kafka.topic_prefix}"
    marker = tmp_path / "pwned"
    refusals = _plant(settings, engine, app_id, marker)
    log = tmp_path / "worker.log"
    with streams_worker(settings, log, engine, app_id) as worker:
        # the telemetry comes once the worker runs: in one CI run a faust worker started on
        # the 288 records already waiting handled 287 and never the last; the cause is not
        # known (faust's start-up is suspected; the note of issue 25 says more), and this test
        # is about planted state, not start-up
        wait_for(lambda: bool(_latest_progress(log)), log, 60)
        producer = make_producer(settings)
        t0 = time.time() - 120
        for i in range(12):
            for node in ("node-a", "node-b", "node-c"):
                xid = 5 if (node == "node-b" and i == 4) else None
                for m in gpu_round(t0 + 10 * i, node, xid_gpu=xid):
                    produce(producer, settings, m)
        assert producer.flush(30) == 0
        flags = read_flags(settings, want=1, timeout_s=90, worker=worker)
        wait_for(lambda: _latest_progress(log).get("telemetry", 0) >= 288, log)
        wait_for(lambda: _latest_progress(log).get("refused", 0) >= refusals, log, 30)
        assert worker.poll() is None, log.read_text(errors="replace")[-3000:]
    text = log.read_text(errors="replace")
    assert not marker.exists(), text[-3000:]
    assert [(f.node, f.category) for f in flags] == [("node-b", "gpu_error")], text[-3000:]
    progress = _latest_progress(log)
    assert (progress["refused"], progress["restored"]) == (refusals, 0), progress


@pytest.mark.parametrize("engine", ["native", "faust"])
def test_idle_keys_expire_with_a_tombstone_on_the_changelog(
    kafka_settings: Settings, tmp_path: Path, engine: str
) -> None:
    from confluent_kafka import TopicPartition

    from guard.kafka import make_consumer

    settings = kafka_settings
    app_id = f"expiry-{settings.kafka.topic_prefix}"
    producer = make_producer(settings)
    t0 = time.time() - 60
    for i in range(3):
        for m in gpu_round(t0 + 10 * i, "node-a"):
            produce(producer, settings, m)
    assert producer.flush(30) == 0
    log = tmp_path / "worker.log"
    with streams_worker(settings, log, engine, app_id, GUARD_STREAMS_KEY_IDLE_S="2") as worker:
        wait_for(lambda: _latest_progress(log).get("telemetry", 0) >= 24, log)
        time.sleep(1.5)  # past the 1 s checkpoint period: the next batch saves node-a
        for m in gpu_round(t0 + 30, "node-a"):
            produce(producer, settings, m)
        assert producer.flush(30) == 0
        wait_for(lambda: _latest_progress(log).get("telemetry", 0) >= 32, log)
        time.sleep(15)  # idle past key_idle_s, and the 10 s expiry pass
        assert worker.poll() is None, log.read_text(errors="replace")[-3000:]
    topic = _changelog(settings, engine, app_id, "node-detectors")
    reader = make_consumer(settings, "changelog-reader", **{"enable.partition.eof": True})
    parts = reader.list_topics(topic, timeout=10).topics[topic].partitions
    reader.assign([TopicPartition(topic, p, 0) for p in parts])
    values: list[bytes | None] = []
    eof: set[int] = set()
    deadline = time.monotonic() + 30
    while len(eof) < len(parts) and time.monotonic() < deadline:
        r = reader.poll(0.5)
        if r is None:
            continue
        if r.error():
            eof.add(r.partition())
        elif r.key() == b"node-a":
            values.append(r.value())
    reader.close()
    assert values and values[0] is not None, values  # checkpointed while it had input
    assert values[-1] is None, log.read_text(errors="replace")[-3000:]  # then a tombstone

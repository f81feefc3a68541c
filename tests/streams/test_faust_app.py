"""`guard streams` workers (faust) against a real broker: flags out, bad input to the DLQ."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from guard.config import Settings
from guard.demo import worker_env
from guard.kafka import make_consumer, make_producer, produce
from guard.schemas import Flag, GpuSample, GuardMessage, StepTiming, decode
from guard.streams.processing import parse_progress


@contextmanager
def streams_worker(
    settings: Settings,
    log: Path,
    engine: str = "faust",
    app_id: str | None = None,
    **env_overrides: str,
) -> Iterator[subprocess.Popen[bytes]]:
    env = worker_env(
        settings,
        GUARD_STREAMS_APP_ID=app_id or f"streams-{settings.kafka.topic_prefix}",
        GUARD_STREAMS_ENGINE=engine,
        GUARD_STREAMS_CHECKPOINT_S="1",
        GUARD_STREAMS_PROGRESS_S="2",
        **env_overrides,
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "guard.cli", "streams"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _latest_progress(log: Path) -> dict[str, int]:
    lines = log.read_text(errors="replace").splitlines()
    reports = [r for r in map(parse_progress, lines) if r is not None]
    return reports[-1] if reports else {}


def processed(log: Path) -> int:
    """Telemetry messages the worker has handled, from its latest progress line."""
    return int(_latest_progress(log).get("telemetry", 0))


def restored(log: Path) -> int:
    """Keys the worker resumed from checkpoints, from its latest progress line."""
    return int(_latest_progress(log).get("restored", 0))


def wait_for(check: Callable[[], bool], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert check(), log.read_text(errors="replace")[-3000:]


def read_flags(
    settings: Settings, want: int, timeout_s: float, worker: subprocess.Popen[bytes] | None = None
) -> list[Flag]:
    consumer = make_consumer(settings, "flag-reader")
    topic = settings.topic("remediation")
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    flags: list[Flag] = []
    deadline = time.monotonic() + timeout_s
    while len(flags) < want and time.monotonic() < deadline:
        if worker is not None and worker.poll() is not None:
            break  # the worker died: fail now, with its log
        r = consumer.poll(0.5)
        if r is not None and not r.error():
            flags.append(decode(r.value(), "flag"))  # type: ignore[arg-type]
    consumer.close()
    return flags


def gpu_round(t: float, node: str, xid_gpu: int | None = None) -> list[GuardMessage]:
    return [
        GpuSample(
            ts=t + 0.001 * g,
            node=node,
            job="job-a",
            gpu=g,
            temp_c=62.0,
            power_w=600.0,
            power_limit_w=700.0,
            sm_clock_mhz=1980.0,
            sm_clock_max_mhz=1980.0,
            util_pct=98.0,
            xid=79 if g == xid_gpu else None,
        )
        for g in range(8)
    ]


@pytest.mark.parametrize("engine", ["faust", "native"])
def test_worker_turns_telemetry_into_flags_and_dead_letters_garbage(
    kafka_settings: Settings, tmp_path: Path, engine: str
) -> None:
    settings = kafka_settings
    t0 = time.time() - 120
    producer = make_producer(settings)
    for i in range(12):
        for node in ("node-a", "node-b", "node-c"):
            for m in gpu_round(
                t0 + 10 * i, node, xid_gpu=5 if (node == "node-b" and i == 4) else None
            ):
                produce(producer, settings, m)
    producer.produce(settings.topic("gpu"), b"\xff not json", b"node-a")
    producer.produce(settings.topic("steps"), b'{"kind":"step","ts":1}', b"job-a")
    for r in range(4):
        produce(
            producer,
            settings,
            StepTiming(ts=t0, node="node-a", job="job-a", rank=r, step=1, step_s=1.0),
        )
    assert producer.flush(30) == 0

    with streams_worker(settings, tmp_path / "worker.log", engine) as worker:
        flags = read_flags(settings, want=1, timeout_s=90, worker=worker)
        # the worker carried on after the bad records: the DLQ has both, with reasons
        dlq = make_consumer(settings, "dlq-reader", [settings.topic("dlq")])
        dead = []
        deadline = time.monotonic() + 30
        while len(dead) < 2 and time.monotonic() < deadline:
            r = dlq.poll(0.5)
            if r is not None and not r.error():
                dead.append(r)
        dlq.close()
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert [(f.node, f.gpu, f.category, f.severity) for f in flags] == [
        ("node-b", 5, "gpu_error", "critical")
    ], log[-3000:]
    assert sorted(r.value() for r in dead) == sorted([b"\xff not json", b'{"kind":"step","ts":1}'])
    assert all(dict(r.headers())["guard-error"] for r in dead)


@pytest.mark.slow
def test_faust_replacement_worker_resumes_from_the_changelogs(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    settings = kafka_settings
    producer = make_producer(settings)
    t0 = time.time() - 300

    def publish(start: float, rounds: int) -> None:
        for i in range(rounds):
            for node in ("node-a", "node-b"):
                for m in gpu_round(start + 2 * i, node):
                    produce(producer, settings, m)
        assert producer.flush(30) == 0

    first, second = tmp_path / "first.log", tmp_path / "second.log"
    with streams_worker(settings, first, "faust", "resume"):
        publish(t0, 10)
        wait_for(lambda: processed(first) >= 160, first)
        time.sleep(1.5)  # past the 1 s checkpoint period: the next batch checkpoints its keys
        publish(t0 + 20, 5)
        wait_for(lambda: processed(first) >= 240, first)
    with streams_worker(settings, second, "faust", "resume"):
        publish(t0 + 30, 3)
        wait_for(lambda: restored(second) >= 2, second)  # node-a and node-b, not a cold start

"""Sustained telemetry throughput of `guard streams` workers: Kafka in → flags out.

Pre-loads the telemetry topics with simulator output, then starts 1 (and then 2) workers
and watches the workers' committed offsets: the rate is messages / (time from the first
commit to the last), so start-up and group-join time are not counted. Several runs; the
median is reported. Uses $GUARD_KAFKA_BOOTSTRAP, else an embedded Tansu broker.

    .venv/bin/python benchmarks/streams_throughput.py [--nodes 16] [--duration 300] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.config import Settings, load_settings
from guard.demo import worker_env
from guard.kafka import TELEMETRY_TOPICS, client_config, create_topics, make_producer, produce


def preload(settings: Settings, nodes: int, duration: float) -> int:
    sim = ClusterSimulator(SimConfig(nodes=nodes, duration_s=duration, seed=3))
    producer = make_producer(settings)
    n = 0
    for message in sim.messages():
        produce(producer, settings, message)
        n += 1
        if n % 20_000 == 0:
            producer.poll(0)
    producer.flush(120)
    return n


def committed_total(settings: Settings, group: str) -> int:
    admin = AdminClient(client_config(settings))
    parts = [
        TopicPartition(settings.topic(t), p)
        for t in TELEMETRY_TOPICS
        for p in range(settings.kafka.telemetry_partitions)
    ]
    from confluent_kafka import ConsumerGroupTopicPartitions

    futures = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, parts)])
    result = next(iter(futures.values())).result(timeout=10)
    return sum(max(tp.offset, 0) for tp in result.topic_partitions)


def run_workers(settings: Settings, workers: int, total: int, home: Path, engine: str) -> float:
    app_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = worker_env(
        settings,
        GUARD_HOME=str(home),
        GUARD_STREAMS_APP_ID=app_id,
        GUARD_STREAMS_PROGRESS_S="3600",
        GUARD_STREAMS_ENGINE=engine,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "guard.cli", "streams"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(workers)
    ]
    try:
        first = None
        deadline = time.monotonic() + 900
        start_count = 0
        while time.monotonic() < deadline:
            done = committed_total(settings, app_id)
            now = time.monotonic()
            if first is None and done > 0:
                first, start_count = now, done
            if done >= total:
                assert first is not None
                if start_count >= total:  # one commit covered everything: nothing to time
                    raise SystemExit(
                        f"{total:,} messages were done within one commit interval; "
                        "use more --nodes or --duration"
                    )
                return (total - start_count) / max(1e-6, now - first)
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a worker exited early")
            time.sleep(0.25)
        raise TimeoutError("workers did not finish within 900 s")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--engines", default="faust,native")
    args = parser.parse_args()
    broker = None
    bootstrap = os.environ.get("GUARD_KAFKA_BOOTSTRAP")
    if not bootstrap:
        from guard.broker import EmbeddedBroker

        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
    home = Path(tempfile.mkdtemp(prefix="guard-bench-"))
    try:
        results: dict[tuple[str, int], list[float]] = {}
        for run in range(args.runs):
            settings = load_settings(
                home=home,
                kafka={
                    "bootstrap": bootstrap,
                    "topic_prefix": f"b{uuid.uuid4().hex[:6]}.",
                    "telemetry_partitions": args.partitions,
                },
            )
            create_topics(settings)
            total = preload(settings, args.nodes, args.duration)
            for engine in args.engines.split(","):
                for workers in (int(w) for w in args.workers.split(",")):
                    rate = run_workers(settings, workers, total, home, engine)
                    results.setdefault((engine, workers), []).append(rate)
                    print(
                        f"run {run + 1}: {engine}, {workers} worker(s), {total:,} messages: "
                        f"{rate:,.0f} msg/s",
                        flush=True,
                    )
        base = {w: statistics.median(r) for (e, w), r in results.items() if e == "faust"}
        for (engine, workers), rates in results.items():
            median = statistics.median(rates)
            ratio = f", {median / base[workers]:.1f}x faust" if workers in base else ""
            print(
                f"median {engine}, {workers} worker(s): {median:,.0f} msg/s "
                f"({median / workers:,.0f} per worker{ratio}; runs: "
                f"{', '.join(f'{r:,.0f}' for r in rates)})"
            )
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

"""Sink rows/s into chDB: Kafka → ClickHouseSink → chDB, against direct inserts.

Pre-loads the topics with simulator output, then times (a) the baseline: the same messages
inserted straight from memory with ``guard.store.insert_messages`` in batches of the sink's
size, and (b) the sink consuming them from Kafka (time from its first stored batch to the
last, so the group join is not counted). Medians of several runs.

    .venv/bin/python benchmarks/sink_throughput.py [--nodes 8] [--duration 300] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import clickhouse_connect
from _broker import bootstrap_or_embedded  # benchmarks/ is on sys.path when run

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.config import load_settings
from guard.kafka import create_topics, make_producer, produce
from guard.store import insert_messages, migrate
from guard.streams.sink import ClickHouseSink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bootstrap, broker = bootstrap_or_embedded()
    home = Path(tempfile.mkdtemp(prefix="guard-sink-bench-"))
    client = clickhouse_connect.get_client(dsn=f"chdb://{home / 'chdb'}")
    messages = list(
        ClusterSimulator(
            SimConfig(
                nodes=args.nodes, duration_s=args.duration, start_ts=float(int(time.time())), seed=5
            )
        ).messages()
    )
    direct, via_sink = [], []
    try:
        for run in range(args.runs):
            settings = load_settings(
                home=home,
                kafka={
                    "bootstrap": bootstrap,
                    "topic_prefix": f"s{uuid.uuid4().hex[:6]}.",
                    "telemetry_partitions": 4,
                },
            )
            settings.clickhouse.database = f"bench_direct_{run}"
            migrate(client, settings)
            batch = settings.clickhouse.batch_rows
            t0 = time.perf_counter()
            for i in range(0, len(messages), batch):
                insert_messages(client, settings, messages[i : i + batch])
            direct.append(len(messages) / (time.perf_counter() - t0))

            settings.clickhouse.database = f"bench_sink_{run}"
            migrate(client, settings)
            create_topics(settings)
            producer = make_producer(settings)
            for m in messages:
                produce(producer, settings, m)
            producer.flush(120)
            sink = ClickHouseSink(settings, client, group_id=f"bench-{run}")
            first = None
            deadline = time.monotonic() + 600
            while sink.stats.stored < len(messages) and time.monotonic() < deadline:
                stepped_at = time.perf_counter()
                sink.step(0.2)
                if first is None and sink.stats.consumed:
                    first = stepped_at  # the step that consumed first counts (small inputs)
            sink.drain(30)
            assert first is not None and sink.stats.stored == len(messages)
            via_sink.append(len(messages) / (time.perf_counter() - first))
            sink.close()
            print(
                f"run {run + 1}: {len(messages):,} rows: direct {direct[-1]:,.0f} rows/s, "
                f"sink from Kafka {via_sink[-1]:,.0f} rows/s",
                flush=True,
            )
        print(
            f"median: direct insert {statistics.median(direct):,.0f} rows/s, sink "
            f"{statistics.median(via_sink):,.0f} rows/s "
            f"({statistics.median(via_sink) / statistics.median(direct):.2f}x of direct)"
        )
    finally:
        client.close()
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

"""Sink rows/s into chDB: Kafka → ClickHouseSink → chDB, against direct inserts.

Pre-loads the topics with simulator output, then times (a) the baseline: the same messages
inserted straight from memory with ``guard.store.insert_messages`` in batches of the sink's
size, and (b) the sink consuming them from Kafka (time from its first stored batch to the
last, so the group join is not counted), and (c) the sink's decode alone
(``decode_columns`` over the same records, no Kafka, no insert). Medians of several runs.
Each rate is also given per CPU-second of this process (all its threads: librdkafka's,
chDB's): on a shared machine that is steadier than the wall clock, and it says what one core
would do.

    .venv/bin/python benchmarks/sink_throughput.py [--nodes 8] [--duration 300] [--runs 3]
        [--records single,batched] [--batch-rows N]

To compare with another checkout in the same run, run this script under that checkout's
interpreter too (it uses only the sink's and the store's public calls), alternating.

With ``--records batched`` the topics carry batch records (one per node per interval, per
node per step: :mod:`guard.schemas.batches`); rows/s counts rows stored (one per sample),
the same rows as from single records.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import clickhouse_connect
from _broker import bootstrap_or_embedded, fresh_settings  # benchmarks/ is on sys.path when run

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.config import Settings
from guard.kafka import create_topics, make_producer, produce
from guard.schemas import GuardMessage, batch_messages, encode
from guard.schemas.rows import decode_columns
from guard.store import insert_messages, migrate
from guard.streams.sink import ClickHouseSink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records", default="single", help="single and/or batched")
    parser.add_argument(
        "--batch-rows", type=int, default=None, help="clickhouse.batch_rows (the sink's inserts)"
    )
    args = parser.parse_args()
    bootstrap, broker = bootstrap_or_embedded()
    home = Path(tempfile.mkdtemp(prefix="guard-sink-bench-"))
    client = clickhouse_connect.get_client(dsn=f"chdb://{home / 'chdb'}")
    sim = ClusterSimulator(
        SimConfig(
            nodes=args.nodes, duration_s=args.duration, start_ts=float(int(time.time())), seed=5
        )
    )
    ticks = list(sim.batches())
    messages = [m for tick in ticks for m in tick]
    records = {
        "single": messages,
        "batched": [m for tick in ticks for m in batch_messages(tick)],
    }
    # The input (~10^5 models) stays alive for the whole run; a sink process holds nothing
    # like it, so it is kept out of the cyclic collector's walks (which cost a decode ~15 %).
    gc.freeze()
    encoded = {kind: _by_topic(recs) for kind, recs in records.items()}
    direct: list[tuple[float, float]] = []
    via_sink: dict[str, list[tuple[float, float]]] = {}
    decodes: dict[str, list[float]] = {}
    try:
        for run in range(args.runs):
            settings = _settings(home, bootstrap, f"bench_direct_{run}", args.batch_rows)
            migrate(client, settings)
            batch = settings.clickhouse.batch_rows
            insert_messages(client, settings, messages[:1])  # the client's lazy imports
            t0, cpu0 = time.perf_counter(), time.process_time()
            for i in range(1, len(messages), batch):
                insert_messages(client, settings, messages[i : i + batch])
            n = len(messages) - 1
            direct.append((n / (time.perf_counter() - t0), n / (time.process_time() - cpu0)))
            for kind in args.records.split(","):
                rate = _via_sink(
                    client,
                    _settings(home, bootstrap, f"bench_sink_{run}_{kind}", args.batch_rows),
                    records[kind],
                    len(messages),
                    f"bench-{run}-{kind}",
                )
                via_sink.setdefault(kind, []).append(rate)
                decoded = _decode_rate(encoded[kind])
                decodes.setdefault(kind, []).append(decoded)
                print(
                    f"run {run + 1}: {len(messages):,} rows ({len(records[kind]):,} {kind} "
                    f"records): direct {_rate(direct[-1])}, sink from Kafka {_rate(rate)}, "
                    f"its decode alone {decoded:,.0f} rows per CPU-s",
                    flush=True,
                )
        for kind, rates in via_sink.items():
            d, r = _median(direct), _median(rates)
            print(
                f"median, {kind} records: direct insert {_rate(d)}, sink {_rate(r)} "
                f"({r[0] / d[0]:.2f}x of direct; runs: {', '.join(_rate(x) for x in rates)}); "
                f"decode alone {statistics.median(decodes[kind]):,.0f} rows per CPU-s"
            )
    finally:
        client.close()
        if broker is not None:
            broker.stop()


def _by_topic(messages: list[GuardMessage]) -> dict[str, list[bytes]]:
    """The records of each telemetry topic (named by its single kind), encoded."""
    out: dict[str, list[bytes]] = {}
    for m in messages:
        out.setdefault(m.kind.removesuffix("_batch"), []).append(encode(m))
    return out


def _decode_rate(by_topic: dict[str, list[bytes]], run: int = 1000) -> float:
    """Rows per CPU-second of the sink's decode alone (``decode_columns``, runs of ``run``
    records, as a consumer batch gives them): the share of a row's cost that is not Kafka's
    or the insert's."""
    rows, started = 0, time.process_time()
    for kind, values in by_topic.items():
        for i in range(0, len(values), run):
            rows += decode_columns(values[i : i + run], kind).rows
    return rows / (time.process_time() - started)


def _median(rates: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r for r, _ in rates), statistics.median(c for _, c in rates)


def _rate(rate: tuple[float, float]) -> str:
    return f"{rate[0]:,.0f} rows/s ({rate[1]:,.0f} per CPU-s)"


def _settings(home: Path, bootstrap: str, database: str, batch_rows: int | None) -> Settings:
    settings = fresh_settings(home, bootstrap, "s", 4)
    settings.clickhouse.database = database
    if batch_rows:
        settings.clickhouse.batch_rows = batch_rows
    return settings


def _via_sink(
    client: Any, settings: Settings, records: list[GuardMessage], rows: int, group: str
) -> tuple[float, float]:
    """Rows/s of one sink consuming ``records`` from Kafka (first stored batch to the last)."""
    migrate(client, settings)
    create_topics(settings)
    producer = make_producer(settings)
    for m in records:
        produce(producer, settings, m)
    producer.flush(120)
    sink = ClickHouseSink(settings, client, group_id=group)
    first = cpu = None
    deadline = time.monotonic() + 600
    while sink.stats.stored < rows and time.monotonic() < deadline:
        stepped_at, cpu_at = time.perf_counter(), time.process_time()
        sink.step(0.2)
        if first is None and sink.stats.consumed:
            first, cpu = stepped_at, cpu_at  # the step that consumed first counts
    sink.drain(30)
    assert first is not None and cpu is not None and sink.stats.stored == rows
    rate = rows / (time.perf_counter() - first), rows / (time.process_time() - cpu)
    sink.close()
    return rate


if __name__ == "__main__":
    main()

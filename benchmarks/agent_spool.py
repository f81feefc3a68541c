"""The agent's spool across a broker outage: what is spooled, lost, duplicated, replay speed.

Starts an embedded Tansu broker, publishes simulated telemetry of N nodes through the
agent's publisher at a steady rate, stops the broker for ``--outage`` seconds, restarts it
(empty: memory storage; topics are recreated) and waits until the spool is replayed. Then
it reads the topic back and prints: records spooled, lost, duplicated, and how fast the
backlog drained. Then, with the broker gone for good and a small bound, how many records
the bound drops (counted, never silently).

    .venv/bin/python benchmarks/agent_spool.py [--nodes 8] [--outage 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from guard.agents.publisher import Publisher
from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.broker import EmbeddedBroker, free_port
from guard.config import Settings, load_settings
from guard.kafka import create_topics, make_consumer
from guard.schemas import decode


def _read_gpu_topic(settings: Settings) -> list[tuple[str, int, float]]:
    """(node, gpu, ts) of every record on the GPU topic, duplicates included."""
    consumer = make_consumer(settings, f"bench-{uuid.uuid4().hex}")
    topic = settings.topic("gpu")
    meta = consumer.list_topics(topic, timeout=10)
    consumer.assign(
        [TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.topics[topic].partitions]
    )
    seen = []
    idle = time.monotonic()
    while time.monotonic() - idle < 5:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        idle = time.monotonic()
        m = decode(msg.value(), "gpu")
        seen.append((m.node, m.gpu, m.ts))  # type: ignore[attr-defined]
    consumer.close()
    return seen


def one_run(nodes: int, outage_s: float, home: Path) -> dict[str, float]:
    port = free_port()
    settings = load_settings(
        home=home,
        kafka={"bootstrap": f"127.0.0.1:{port}", "topic_prefix": f"b{uuid.uuid4().hex[:8]}."},
    )
    settings.agent.delivery_timeout_s = 2.0
    broker = EmbeddedBroker(port=port).start()
    create_topics(settings)
    publisher = Publisher(settings, spool_dir=home / f"spool-{port}", probe_s=0.5)
    config = SimConfig(nodes=nodes, duration_s=600, seed=1, start_ts=float(int(time.time())))
    after_stop: set[tuple[str, int, float]] = set()
    phase, stopped_at, restarted_at, drained_at = "before", 0.0, 0.0, 0.0
    peak = 0
    start = time.monotonic()
    for tick, batch in enumerate(ClusterSimulator(config).batches()):
        now = time.monotonic() - start
        if phase == "before" and now > 10:
            broker.stop()
            phase, stopped_at = "outage", now
        elif phase == "outage" and now > stopped_at + outage_s:
            broker = EmbeddedBroker(port=port).start()
            create_topics(settings)
            phase, restarted_at = "after", now
        for message in batch:
            publisher.publish(message)
            if phase != "before" and message.kind == "gpu":
                after_stop.add((message.node, message.gpu, message.ts))  # type: ignore[attr-defined]
        publisher.poll()
        peak = max(peak, len(publisher.spool))
        if phase == "after" and publisher.state == "online" and not drained_at:
            drained_at = time.monotonic() - start
        if drained_at and now > drained_at + 5:
            break
        time.sleep(max(0.0, start + (tick + 1) * 0.1 - time.monotonic()))  # 10x real time
    publisher.flush(30)
    stats, dropped = dict(publisher.stats), publisher.dropped
    publisher.close()
    received = _read_gpu_topic(settings)
    broker.stop()
    return {
        "spooled": stats["spooled"],
        "replayed": stats["replayed"],
        "dropped": dropped,
        "peak_backlog": peak,
        "drain_s": drained_at - restarted_at if drained_at else float("nan"),
        "gpu_lost": len(after_stop - set(received)),
        "gpu_duplicates": len(received) - len(set(received)),
    }


def bound_run(home: Path) -> dict[str, float]:
    settings = load_settings(home=home, kafka={"bootstrap": f"127.0.0.1:{free_port()}"})
    settings.agent.delivery_timeout_s = 1.0
    settings.agent.spool_max_bytes = 1 << 20
    publisher = Publisher(settings, spool_dir=home / "bound", probe_s=0.5)
    published = 0
    for batch in ClusterSimulator(SimConfig(nodes=8, duration_s=120, seed=2)).batches():
        for message in batch:
            publisher.publish(message)
            published += 1
        publisher.poll()
    deadline = time.monotonic() + 60
    while publisher.state != "offline" and time.monotonic() < deadline:
        publisher.poll()  # wait for the in-flight records to fail over into the spool
        time.sleep(0.05)
    result = {
        "published": published,
        "kept": len(publisher.spool),
        "dropped": publisher.dropped,
        "spool_bytes": publisher.spool.size_bytes,
    }
    publisher.close(timeout_s=0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--outage", type=float, default=20.0, help="wall seconds without a broker")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_run(args.nodes, args.outage, Path(tmp)) for _ in range(args.runs)]
        for i, run in enumerate(runs, 1):
            print(
                f"run {i}: "
                + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items()
                )
            )

        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"median over {args.runs} runs: spooled {med('spooled'):.0f}, "
            f"lost {med('gpu_lost'):.0f}, duplicates {med('gpu_duplicates'):.0f}, "
            f"dropped {med('dropped'):.0f}; backlog "
            f"drained {med('drain_s'):.1f} s after the restart"
        )
        bound = bound_run(Path(tmp))
        print(
            f"1 MiB bound, broker gone: {bound['published']} published, {bound['kept']} kept "
            f"({bound['spool_bytes']} B), {bound['dropped']} dropped (counted and logged)"
        )


if __name__ == "__main__":
    main()

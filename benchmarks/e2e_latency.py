"""End-to-end latency: event time → flag on guard.remediation, through Kafka and the workers.

A simulated cluster (Xid faults injected at known times: an Xid is flagged on the sample
that carries it, so the detector's own window is zero) is generated and encoded up front,
then published in real time (or at --speed) so that the generator cannot be the
bottleneck; `guard streams` workers detect; flags are read from guard.remediation. Latency
of a flag = when it was read − when the message that completed its evidence (the flag's
``ts``) was due to be published. Prints median and p95, and each worker's peak resident memory.

    .venv/bin/python benchmarks/e2e_latency.py [--nodes 1250] [--duration 60] [--engine native]
        [--batched]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.broker import EmbeddedBroker
from guard.config import load_settings
from guard.demo.pipeline import FlagReader, StreamsWorkers
from guard.kafka import create_topics, make_producer, produce_raw, to_record
from guard.schemas import batch_messages


def _peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (Linux ``VmHWM``), MB; NaN where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1250, help="8 GPUs each")
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--engine", choices=["faust", "native"], default="native")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--batched",
        action="store_true",
        help="batch records: one per node per interval, per node per step (contract 1.1)",
    )
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="guard-latency-"))
    bootstrap = os.environ.get("GUARD_KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
    settings = load_settings(
        home=home,
        kafka={
            "bootstrap": bootstrap,
            "telemetry_partitions": args.partitions,
            "topic_prefix": f"lat{uuid.uuid4().hex[:6]}.",  # a shared broker keeps old runs
        },
    )
    settings.streams.engine = args.engine
    settings.streams.app_id = "latency"
    create_topics(settings)
    start = float(int(time.time())) + 3600  # placeholder; re-based when publishing
    faults = [FaultSpec("xid", onset_s=t) for t in range(10, int(args.duration) - 5, 5)]
    sim = ClusterSimulator(
        SimConfig(
            nodes=args.nodes,
            duration_s=args.duration,
            seed=9,
            start_ts=start,
            faults=faults,
            random_faults=0,
        )
    )
    t0 = time.monotonic()
    records = [
        to_record(settings, m)
        for tick in sim.batches()
        for m in (batch_messages(tick) if args.batched else tick)
    ]
    print(f"generated {len(records):,} messages in {time.monotonic() - t0:.0f} s", flush=True)
    workers = StreamsWorkers(settings, args.workers, home)
    workers.start()
    arrivals: list[float] = []  # wall time (epoch) each flag was read
    reader = FlagReader(settings, on_flag=lambda flag: arrivals.append(time.time()))
    reader.start()
    producer = make_producer(settings, **{"linger.ms": 5})
    try:
        time.sleep(settings.kafka.session_timeout_ms / 1000 + 4)  # let the workers join
        wall0 = time.time() + 0.5
        for r in records:
            due = wall0 + (r.timestamp_ms / 1000 - start) / args.speed
            wait = due - time.time()
            if wait > 0.002:
                producer.poll(0)
                time.sleep(wait)
            produce_raw(producer, r.topic, r.value, r.key, timestamp=r.timestamp_ms)
        producer.flush(60)
        behind = time.time() - (wall0 + args.duration / args.speed)
        deadline = time.monotonic() + 120
        while workers.telemetry < len(records) and time.monotonic() < deadline:
            workers.check_alive()
            time.sleep(0.5)
        time.sleep(3)
        peaks = [_peak_rss_mb(proc.pid) for proc in workers.procs]
        latencies = sorted(
            arrival - (wall0 + (flag.ts - start) / args.speed)
            for flag, arrival in zip(reader.flags, arrivals, strict=True)
            if flag.category == "gpu_error"
        )
    finally:
        reader.stop_event.set()
        reader.join(10)  # its consumer closed before the broker stops
        workers.stop()
        if broker is not None:
            broker.stop()
    gpus = args.nodes * 8
    print(
        f"{gpus:,} GPUs at 1 Hz, {args.duration:.0f} s at {args.speed}x, {args.workers} "
        f"{args.engine} worker(s): {len(records):,} {'batch ' if args.batched else ''}records "
        f"({len(records) / args.duration * args.speed:,.0f} records/s offered; publisher ended "
        f"{behind:.1f} s behind schedule), {len(latencies)} Xid flags of {len(faults)}"
    )
    print("worker peak RSS: " + ", ".join(f"{mb:,.0f} MB" for mb in peaks))
    if latencies:
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        print(
            f"event → flag latency: median {statistics.median(latencies):.2f} s, "
            f"p95 {p95:.2f} s, max {latencies[-1]:.2f} s"
        )


if __name__ == "__main__":
    main()

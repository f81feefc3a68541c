"""End-to-end latency: event time → flag on guard.remediation, through the live pipeline.

A simulated cluster is replayed in real time (or at --speed) through Kafka, the streams
worker(s), the sink and the orchestrator, with Xid faults injected at known times (an Xid
is flagged on the sample that carries it: the detector's own window is zero). Latency of a
flag = when it was read from guard.remediation − when the message that completed its
evidence (the flag's ``ts``) was published. Prints median and p95 over the run's flags.

    .venv/bin/python benchmarks/e2e_latency.py [--nodes 16] [--duration 180] [--engine native]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from guard.agents.simulator import FaultSpec
from guard.config import load_settings
from guard.demo import DemoConfig, Pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--engine", choices=["faust", "native"], default="native")
    parser.add_argument("--sample-interval", type=float, default=1.0)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="guard-latency-"))
    faults = [FaultSpec("xid", onset_s=t) for t in range(30, int(args.duration) - 20, 15)]
    config = DemoConfig(
        nodes=args.nodes,
        duration_s=args.duration,
        speed=args.speed,
        workers=args.workers,
        engine=args.engine,
        faults=faults,
        home=home,
        sample_interval_s=args.sample_interval,
    )
    settings = load_settings(home=home, kafka={"telemetry_partitions": 4})
    settings.clickhouse.dsn = f"chdb://{home / 'chdb'}"
    pipe = Pipeline(settings, config)
    try:
        pipe.start()
        t0 = time.monotonic()
        pipe.publish()
        wall = time.monotonic() - t0
        pipe.drain(timeout_s=120)
        assert pipe.flag_reader is not None
        latencies = [
            arrival - pipe.wall_epoch_of(flag.ts)
            for flag, arrival in zip(pipe.flag_reader.flags, pipe.flag_reader.arrivals, strict=True)
            if flag.severity != "info" and flag.category == "gpu_error"
        ]
        rate = pipe.published / wall
    finally:
        pipe.stop()
    gpus = args.nodes * 8
    print(
        f"{gpus} GPUs at {1 / args.sample_interval:g} Hz, speed {args.speed}x, "
        f"{args.workers} {args.engine} worker(s): "
        f"{pipe.published:,} messages in {wall:.0f} s ({rate:,.0f} msg/s), "
        f"{len(latencies)} Xid flags of {len(faults)} injected"
    )
    if latencies:
        latencies.sort()
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        print(
            f"event → flag latency: median {statistics.median(latencies):.2f} s, "
            f"p95 {p95:.2f} s, max {latencies[-1]:.2f} s"
        )


if __name__ == "__main__":
    main()

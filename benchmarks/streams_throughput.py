"""Sustained telemetry throughput of `guard streams` workers: Kafka in → flags out.

Pre-loads the telemetry topics with simulator output, then starts 1 (and then 2) workers
and follows their progress lines (every 0.5 s): the rate is messages / (time from the first
line that shows work to the line where every message is handled), so start-up and
group-join time are not counted. Several runs; the median is reported. Uses
$GUARD_KAFKA_BOOTSTRAP, else an embedded Tansu broker.

    .venv/bin/python benchmarks/streams_throughput.py [--nodes 64] [--duration 300] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO

from _broker import bootstrap_or_embedded  # benchmarks/ is on sys.path when run

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.config import Settings, load_settings
from guard.demo import worker_env
from guard.kafka import create_topics, make_producer, produce
from guard.streams.processing import parse_progress


def preload(settings: Settings, nodes: int, duration: float) -> int:
    # Event time = record time: a past start (the simulator's default) makes the broker's
    # time-based retention delete the preloaded segments minutes later, mid-benchmark.
    start = float(int(time.time() - duration))
    sim = ClusterSimulator(SimConfig(nodes=nodes, duration_s=duration, seed=3, start_ts=start))
    producer = make_producer(settings)
    n = 0
    for message in sim.messages():
        produce(producer, settings, message)
        n += 1
        if n % 20_000 == 0:
            producer.poll(0)
    producer.flush(120)
    return n


def run_workers(settings: Settings, workers: int, total: int, home: Path, engine: str) -> float:
    """Messages/s from the workers' own progress lines (every 0.5 s), summed over workers.

    The clock starts at the first line that shows work and stops at the first line where the
    workers together have handled every preloaded message; join and start-up are not counted.
    """
    app_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = worker_env(
        settings,
        GUARD_HOME=str(home),
        GUARD_STREAMS_APP_ID=app_id,
        GUARD_STREAMS_PROGRESS_S="0.5",
        GUARD_STREAMS_ENGINE=engine,
    )
    counts = [0] * workers
    marks: list[tuple[float, int]] = []  # (when, all workers' count) at each progress line
    lock = threading.Lock()

    def follow(index: int, stream: IO[bytes]) -> None:
        with open(home / f"{app_id}-{index}.log", "wb") as log:  # kept for a failed run
            for line in stream:
                log.write(line)
                report = parse_progress(line)
                if report is not None:
                    with lock:
                        counts[index] = int(report["telemetry"])
                        marks.append((time.monotonic(), sum(counts)))

    procs = []
    for index in range(workers):
        proc = subprocess.Popen(
            [sys.executable, "-m", "guard.cli", "streams"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        threading.Thread(target=follow, args=(index, proc.stderr), daemon=True).start()
        procs.append(proc)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            with lock:
                started = [(t, n) for t, n in marks if n > 0]
                finished = [t for t, n in marks if n >= total]
            if finished:
                t0, n0 = started[0]
                if n0 >= total:
                    raise SystemExit(
                        f"{total:,} messages were done within one progress interval; "
                        "use more --nodes or --duration"
                    )
                return (total - n0) / max(1e-6, finished[0] - t0)
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a worker exited early")
            time.sleep(0.25)
        raise TimeoutError(f"workers did not finish within 900 s; logs: {home}/{app_id}-*.log")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--engines", default="faust,native")
    parser.add_argument(
        "--faust-workers",
        default="1",
        help="worker counts for the faust baseline (each faust run takes minutes)",
    )
    args = parser.parse_args()
    bootstrap, broker = bootstrap_or_embedded()
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
                counts = args.faust_workers if engine == "faust" else args.workers
                for workers in (int(w) for w in counts.split(",")):
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

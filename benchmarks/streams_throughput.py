"""Sustained telemetry throughput of `guard streams` workers: Kafka in → flags out.

Pre-loads the telemetry topics with simulator output (single-sample records, or with
``--records batched`` one record per node per interval / per node per step:
:mod:`guard.schemas.batches`), then starts 1 (and then 2) workers and follows their
progress lines (every 0.5 s): the rate is records / (time from the first line that shows
work to the line where every record is handled), so start-up and group-join time are not
counted; samples/s is that rate times the samples a record carries on average. The bare
loop (``--engines ...,bare``) is one confluent-kafka consumer that only consumes and
JSON-decodes the same records, in this process: the ceiling of any Python worker.
``faust-floor`` is faust's: the faust app of ``guard streams`` taking the same batches and only
JSON-decoding them (``_faust_floor.py``), the ceiling of any faust worker; ``decode`` is the
bare loop with the workers' validated decode instead of ``orjson.loads``, the ceiling of any
worker that validates what it reads. Several
runs; the median is reported. Uses $GUARD_KAFKA_BOOTSTRAP, else an embedded Tansu broker.

    .venv/bin/python benchmarks/streams_throughput.py [--nodes 64] [--duration 300] [--runs 3]
        [--records single,batched] [--engines faust,native,bare,faust-floor,decode]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO

import orjson
from _broker import bootstrap_or_embedded  # benchmarks/ is on sys.path when run

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.config import Settings, load_settings
from guard.demo import worker_env
from guard.detectors.core import _column_decoder as column_decoder  # the core's own
from guard.kafka import TELEMETRY_TOPICS, create_topics, make_consumer, make_producer, produce
from guard.schemas.batches import batch_messages
from guard.schemas.sample_decoder import decode_samples
from guard.streams.processing import parse_progress, topic_kinds


def preload(settings: Settings, nodes: int, duration: float, batched: bool) -> tuple[int, int]:
    """Records and samples written."""
    # Event time = record time: a past start (the simulator's default) makes the broker's
    # time-based retention delete the preloaded segments minutes later, mid-benchmark.
    start = float(int(time.time() - duration))
    sim = ClusterSimulator(SimConfig(nodes=nodes, duration_s=duration, seed=3, start_ts=start))
    producer = make_producer(settings)
    n = samples = 0
    for tick in sim.batches():
        samples += len(tick)
        for message in batch_messages(tick) if batched else tick:
            produce(producer, settings, message)
            n += 1
            if n % 20_000 == 0:
                producer.poll(0)
    producer.flush(120)
    return n, samples


def bare_loop(settings: Settings, total: int, validated: bool = False) -> float:
    """Records/s of a bare consume + JSON decode loop over the preloaded topics; with
    ``validated``, each record decoded as the workers' core decodes it (validated fields for
    the columns: :mod:`guard.schemas.sample_decoder`) instead of ``orjson.loads``."""
    consumer = make_consumer(
        settings,
        f"bench-bare-{uuid.uuid4().hex[:8]}",
        [settings.topic(t) for t in TELEMETRY_TOPICS],
        **{"fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 16 << 20},
    )
    kinds = topic_kinds(settings.topic)

    def loads(value: bytes, topic: str) -> object:
        return orjson.loads(value)

    if validated:

        def loads(value: bytes, topic: str) -> object:
            kind = kinds[topic]
            decode = column_decoder(value, kind)
            return decode(value, kind) if decode is not None else decode_samples(value, kind)

    n = 0
    t0 = 0.0
    deadline = time.monotonic() + 600
    try:
        while n < total and time.monotonic() < deadline:
            records = consumer.consume(2000, 0.1)  # what the native worker asks for
            if records and not t0:
                t0 = time.perf_counter()
                n0 = len(records)
            for record in records:
                if record.error() is None:
                    loads(record.value(), record.topic())
                    n += 1
        if n < total:
            raise TimeoutError(f"bare loop read {n:,} of {total:,} records in 600 s")
        return (n - n0) / max(1e-6, time.perf_counter() - t0)
    finally:
        consumer.close()


def worker_command(engine: str, index: int, profile: Path | None) -> list[str]:
    """``guard streams`` (for ``faust-floor``, :mod:`_faust_floor`), under ``py-spy record``
    (collapsed stacks) when profiling."""
    command = (
        [sys.executable, str(Path(__file__).with_name("_faust_floor.py"))]
        if engine == "faust-floor"
        else [sys.executable, "-m", "guard.cli", "streams"]
    )
    if profile is None:
        return command
    profile.mkdir(parents=True, exist_ok=True)
    out = profile / f"{engine}-{uuid.uuid4().hex[:6]}-{index}.txt"
    spy = str(Path(sys.executable).with_name("py-spy"))
    return [spy, "record", "--rate", "50", "--format", "raw", "--output", str(out), "--", *command]


def run_workers(
    settings: Settings, workers: int, total: int, home: Path, engine: str, profile: Path | None
) -> float:
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
        GUARD_STREAMS_ENGINE="faust" if engine == "faust-floor" else engine,
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
            worker_command(engine, index, profile),
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
        for p in procs:  # py-spy writes its profile on SIGINT and stops the worker
            p.send_signal(signal.SIGINT if profile else signal.SIGTERM)
        for p in procs:
            p.wait(30)


def one_run(
    args: argparse.Namespace,
    run: int,
    records: str,
    bootstrap: str,
    home: Path,
    results: dict[tuple[str, str, int], list[tuple[float, float]]],
) -> None:
    settings = load_settings(
        home=home,
        kafka={
            "bootstrap": bootstrap,
            "topic_prefix": f"b{uuid.uuid4().hex[:6]}.",
            "telemetry_partitions": args.partitions,
        },
    )
    create_topics(settings)
    total, samples = preload(settings, args.nodes, args.duration, records == "batched")
    per_record = samples / total
    for engine in args.engines.split(","):
        counts = (
            args.faust_workers
            if engine.startswith("faust")
            else "1"
            if engine in ("bare", "decode")
            else args.workers
        )
        for workers in (int(w) for w in counts.split(",")):
            if engine in ("bare", "decode"):
                rate = bare_loop(settings, total, validated=engine == "decode")
            else:
                rate = run_workers(settings, workers, total, home, engine, args.py_spy)
            results.setdefault((records, engine, workers), []).append((rate, rate * per_record))
            print(
                f"run {run + 1}: {records} records, {engine}, {workers} worker(s), {total:,} "
                f"records ({samples:,} samples): {rate:,.0f} records/s, "
                f"{rate * per_record:,.0f} samples/s",
                flush=True,
            )


def report(results: dict[tuple[str, str, int], list[tuple[float, float]]]) -> None:
    for (records, engine, workers), runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        samples = statistics.median(s for _, s in runs)
        bare = results.get((records, "bare", 1))
        of_bare = (
            f", {samples / statistics.median(s for _, s in bare):.0%} of bare"
            if bare and engine != "bare"
            else ""
        )
        print(
            f"median {records} records, {engine}, {workers} worker(s): {rate:,.0f} records/s, "
            f"{samples:,.0f} samples/s ({samples / workers:,.0f} samples/s per worker{of_bare}; "
            f"runs: {', '.join(f'{s:,.0f}' for _, s in runs)} samples/s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--engines", default="faust,native,bare")
    parser.add_argument("--records", default="single,batched", help="single and/or batched")
    parser.add_argument(
        "--faust-workers",
        default="1",
        help="worker counts for the faust baseline (each faust run takes minutes)",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile each worker with py-spy: collapsed stacks into DIR (benchmarks/_pyspy.py)",
    )
    args = parser.parse_args()
    bootstrap, broker = bootstrap_or_embedded()
    home = Path(tempfile.mkdtemp(prefix="guard-bench-"))
    try:
        results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for run in range(args.runs):
            for records in args.records.split(","):
                one_run(args, run, records, bootstrap, home, results)
        report(results)
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

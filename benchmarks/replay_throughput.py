"""`guard replay` messages/s: a simulator recording (JSONL) into the telemetry topics.

Writes one recording with the simulator, then replays it at ``--speed 0`` (as fast as the
broker takes it) with ``--retime now`` onto a fresh topic set each run, through the same
:class:`~guard.streams.replay.Replayer` the command uses; the time counts from the first
message read to the last one acknowledged by the broker, after the first pass that finds
the time span. Also times the parse-and-retime part alone (no broker). Medians of several
runs.

    .venv/bin/python benchmarks/replay_throughput.py [--nodes 16] [--duration 300] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _broker import bootstrap_or_embedded, fresh_settings  # benchmarks/ is on sys.path when run

from guard.agents.simulator import SimConfig, write_jsonl
from guard.kafka import create_topics
from guard.streams.replay import JsonlSource, Replayer, retime_shift, retimed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bootstrap, broker = bootstrap_or_embedded()
    home = Path(tempfile.mkdtemp(prefix="guard-replay-bench-"))
    recording = home / "run.jsonl"
    config = SimConfig(nodes=args.nodes, duration_s=args.duration, start_ts=1767225600.0, seed=5)
    _, counts = write_jsonl(config, recording)
    total = sum(counts.values())
    parse_rates, replay_rates = [], []
    try:
        for _ in range(args.runs):
            source = JsonlSource([recording])
            started = time.perf_counter()
            span = source.span()
            shift = retime_shift("now", span, 0, time.time())
            n = sum(1 for m in source.messages() if retimed(m, shift))  # type: ignore[arg-type]
            parse_rates.append(n / (time.perf_counter() - started))

            settings = fresh_settings(home, bootstrap, "r", 12)
            create_topics(settings)
            stats = Replayer(settings).run(JsonlSource([recording]), speed=0, retime="now")
            assert stats.messages == total and stats.failed == 0, stats.as_dict()
            replay_rates.append(stats.rate)
    finally:
        if broker is not None:
            broker.stop()
    size_mb = recording.stat().st_size / 1e6
    runs = ", ".join(f"{r:,.0f}" for r in replay_rates)
    print(f"recording: {total:,} messages, {size_mb:.1f} MB", end=" ")
    print(f"({args.nodes} nodes x {args.duration:g} s)")
    print(f"parse + retime only:    {statistics.median(parse_rates):>10,.0f} msg/s")
    print(f"replay into the broker: {statistics.median(replay_rates):>10,.0f} msg/s", end=" ")
    print(f"(median of {args.runs} runs: {runs})")


if __name__ == "__main__":
    main()

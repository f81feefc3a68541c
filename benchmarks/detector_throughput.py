"""Detector throughput and state size: how fast backtest runs, how much state a GPU costs.

Prints:

* **detectors only** — messages per second of CPU time through :class:`MessageFeed`
  (models already in memory; one core), median of ``--runs`` runs (CPU time, not wall
  time, because the machine is shared);
* **backtest end to end** — ``guard backtest`` on a JSONL file (read, validate every line
  through ``guard.schemas``, detect, write flags), median of ``--runs`` runs; and the
  schema-only parse rate for comparison (``--batched``: also on the same messages as
  batch records, one per node per instant or per node per step); beside each file's runs,
  a bare read + JSON parse of the same file (the standard library's ``json`` and msgspec,
  no schema, no detection) and the backtest's rate as a share of it, run by run; with
  ``--batched``, the core alone over the batched file's records already decoded to fields
  (what the backtest would run at with a free decode);
* **state** — pickled bytes of the engine's partitions after the run, per GPU (total over
  all partitions / GPUs in the cluster), the largest node partition per GPU, and the largest
  job partition per GPU of that job, for several cluster sizes; beside them what the sealed
  (compressed) checkpoints of all partitions take, and the memory their objects take once
  restored (traced allocations while unpickling them). The budget is 10 KB per GPU
  (docs/architecture.md, design rule 6: state is bounded).

Usage::

    .venv/bin/python benchmarks/detector_throughput.py [--nodes 32] [--duration 300] [--runs 5]
    .venv/bin/python benchmarks/detector_throughput.py --profile   # top functions by own time
    .venv/bin/python benchmarks/detector_throughput.py --batched   # backtest on batches too
    .venv/bin/python benchmarks/detector_throughput.py --against OTHER/.venv/bin/python

``--against PYTHON`` compares two codes on the **same input**: it writes the simulator's
messages (of this code) to a JSONL file once, then alternates child runs of this script
(``--child``) under this interpreter and under ``PYTHON`` (another checkout's virtualenv,
e.g. an older commit's detectors), ``--runs`` of each, interleaved so that both see the same
machine load; each child parses the file with its own schemas (not timed), then times its
detectors (CPU time) and its ``guard backtest`` end to end. It prints both medians and their
ratio, and both bests (noise only ever slows a run down) and theirs: on a shared machine
only such a same-run ratio means anything.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pickle
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.detectors.core import MessageFeed
from guard.evaluation.backtest import BacktestStats, make_detector, read_messages, run_backtest
from guard.schemas import encode, parse_message
from guard.streams.checkpoints import seal


def detectors_only(messages: list, runs: int) -> list[float]:
    rates = []
    for _ in range(runs):
        engine = MessageFeed()
        process = engine.update
        started = time.process_time()  # CPU time of this process: the machine is shared
        for m in messages:
            process(m)
        engine.flush()
        rates.append(len(messages) / (time.process_time() - started))
    return rates


def core_only(rows: list, samples: int, runs: int) -> list[float]:
    """Samples per second of CPU time of the backtest's feed alone over records already
    decoded to fields (``read_messages(..., rows=True)``): no read, no JSON decode."""
    rates = []
    for _ in range(runs):
        feed = MessageFeed()
        started = time.process_time()
        for record in rows:
            feed.update(record)
        feed.flush()
        rates.append(samples / (time.process_time() - started))
    return rates


def child(path: Path, repeat: int) -> dict[str, list[float]]:
    """``repeat`` runs of each measurement over the JSONL at ``path`` (``--child``)."""
    messages = [parse_message(line) for line in path.read_bytes().splitlines() if line]
    gc.freeze()  # the preloaded input is not the engine's memory (a backtest streams it)
    rates = detectors_only(messages, repeat)
    e2e, stats = backtest_rates([path], repeat)
    return {
        "detectors": rates,
        "backtest": e2e[path]["backtest"],
        "flags": [stats.flags],
        "claims": [stats.claims],
    }


def bare_read(path: Path, loads: Callable[[bytes], object]) -> float:
    """CPU seconds of a bare read + JSON parse of ``path``, a line at a time (no schema, no
    detection): the floor of any backtest of that file."""
    started = time.process_time()
    with path.open("rb") as f:
        for line in f:
            loads(line)
    return time.process_time() - started


#: the bare read's JSON parsers: the standard library's, and msgspec's (what Guard decodes with)
BARE_PARSERS: dict[str, Callable[[bytes], object]] = {
    "json": json.loads,
    "msgspec": msgspec.json.Decoder().decode,
}


def backtest_rates(
    paths: list[Path], runs: int
) -> tuple[dict[Path, dict[str, list[float]]], BacktestStats]:
    """Samples per second of CPU time of ``guard backtest`` (read, validate, detect, write
    flags) over each file, and of a bare read + JSON parse of the same file (each parser of
    :data:`BARE_PARSERS`), all runs interleaved; and the last run's stats."""
    rates: dict[Path, dict[str, list[float]]] = {
        path: {name: [] for name in ["backtest", "decode", *BARE_PARSERS]} for path in paths
    }
    stats = BacktestStats()
    for _ in range(runs):
        for path in paths:
            stats = BacktestStats()
            started = time.process_time()
            with tempfile.TemporaryFile() as out:
                run_backtest(_read(path, stats), out, make_detector("guard"), stats)
            rates[path]["backtest"].append(stats.messages / (time.process_time() - started))
            for name, loads in BARE_PARSERS.items():
                rates[path][name].append(stats.messages / bare_read(path, loads))
            rates[path]["decode"].append(stats.messages / validated_read(path))
    return rates, stats


def validated_read(path: Path) -> float:
    """CPU seconds of the backtest's own read and validated decode of ``path`` with no
    detection: the floor of a backtest that validates what it reads."""
    started = time.process_time()
    for _ in _read(path, BacktestStats()):
        pass
    return time.process_time() - started


def _read(path: Path, stats: BacktestStats) -> Any:
    """The records of ``path`` as `guard backtest` reads them (GPU and NIC lines as fields)."""
    try:
        return read_messages([path], stats, rows=True)
    except TypeError:  # a checkout before that (--against)
        return read_messages([path], stats)


def against(other: str, messages: list, runs: int) -> None:
    """Interleaved child runs of this code and ``other``'s over the same input: medians and
    bests (noise on a shared machine only ever slows a run down), and their ratios."""
    script = str(Path(__file__).resolve())
    results: dict[str, dict[str, list[float]]] = {
        name: {"detectors": [], "backtest": []} for name in ("this", "other")
    }
    counts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.jsonl"
        path.write_bytes(b"".join(encode(m) + b"\n" for m in messages))
        for i in range(runs):
            order = [("this", sys.executable), ("other", other)]
            for name, python in order if i % 2 == 0 else order[::-1]:
                done = subprocess.run(
                    [python, script, "--child", str(path), "--repeat", "2"],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                got = json.loads(done.stdout.splitlines()[-1])
                for what in ("detectors", "backtest"):
                    results[name][what] += got[what]
                counts[name] = f"{got['flags'][0]:.0f} flags, {got['claims'][0]:.0f} claims"
    for what in ("detectors", "backtest"):
        this, then = results["this"][what], results["other"][what]
        print(
            f"{what + ':':<11} median this {statistics.median(this):>9,.0f} msg/s, other "
            f"{statistics.median(then):>9,.0f} msg/s, ratio "
            f"{statistics.median(this) / statistics.median(then):.2f}; best this "
            f"{max(this):>9,.0f}, other {max(then):>9,.0f}, ratio {max(this) / max(then):.2f}"
            f" ({len(this)} runs each)"
        )
    for name, line in counts.items():
        print(f"{name}: {line}")


def state_per_gpu(nodes: int, duration: float, seed: int) -> dict[str, float]:
    sim = ClusterSimulator(SimConfig(nodes=nodes, duration_s=duration, seed=seed))
    engine = MessageFeed()
    for m in sim.messages():
        engine.update(m)
    truth = sim.truth()
    gpus = nodes * truth.gpus_per_node
    sizes = engine.state_bytes()
    tables = ("nodes", "jobs", "fusion", "fabric")
    parts = [o for table in tables for o in engine.core.parts(table).values()]
    blobs = [pickle.dumps(o, pickle.HIGHEST_PROTOCOL) for o in parts]
    sealed = sum(len(seal(b"k" * 32, "key", o)) for o in parts)  # what a checkpoint writes
    gc.collect()
    tracemalloc.start()
    restored = [pickle.loads(b) for b in blobs]  # the state's own objects, nothing else
    in_memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del restored
    node_max = max(len(pickle.dumps(p)) for p in engine.nodes.values()) / truth.gpus_per_node
    job_max = max(
        len(pickle.dumps(engine.jobs[j.job])) / j.ranks for j in truth.jobs if j.job in engine.jobs
    )
    return {
        "total_per_gpu": sum(sizes.values()) / gpus,
        "node_partition_per_gpu": node_max,
        "job_partition_per_gpu": job_max,
        "checkpoint_per_gpu": sealed / gpus,
        "in_memory_per_gpu": in_memory / gpus,
        **{k: v / gpus for k, v in sizes.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--state-sizes", default="16,64,256", help="cluster sizes for state")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--batched", action="store_true", help="also time the backtest on batched records"
    )
    parser.add_argument("--against", metavar="PYTHON", help="compare with another checkout")
    parser.add_argument(
        "--input", type=Path, help="a JSONL telemetry file instead of the simulator's output"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeat)))
        return 0

    if args.input:
        messages = list(read_messages([args.input]))
        source = str(args.input)
    else:
        messages = list(
            ClusterSimulator(
                SimConfig(nodes=args.nodes, duration_s=args.duration, seed=args.seed)
            ).messages()
        )
        source = f"{args.nodes} nodes x {args.duration:.0f} s"
    gc.freeze()  # the preloaded input is not the engine's memory (a backtest streams it)
    kinds: dict[str, int] = {}
    for m in messages:
        kinds[m.kind] = kinds.get(m.kind, 0) + 1
    print(f"input: {source}, {len(messages):,} messages {kinds}")
    if args.against:
        against(args.against, messages, args.runs)
        return 0
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        detectors_only(messages, 1)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())
        return 0

    rates = detectors_only(messages, args.runs)
    print(
        f"detectors only:        median {statistics.median(rates):>10,.0f} msg/s "
        f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.jsonl"
        path.write_bytes(b"".join(encode(m) + b"\n" for m in messages))
        lines = path.read_bytes().splitlines()
        parse_rates = []
        for _ in range(max(1, args.runs // 2)):
            started = time.process_time()
            for line in lines:
                parse_message(line)
            parse_rates.append(len(lines) / (time.process_time() - started))
        print(f"schema parse only:     median {statistics.median(parse_rates):>10,.0f} msg/s")
        files = {"single records": path}
        if args.batched:  # one record per node per instant / per node per step
            # imported here: --against runs this script under checkouts that predate batches
            from guard.schemas.batches import batch_messages

            files["batched records"] = Path(tmp) / "batched.jsonl"
            files["batched records"].write_bytes(
                b"".join(encode(m) + b"\n" for m in batch_messages(messages))
            )
        e2e, _ = backtest_rates(list(files.values()), max(1, args.runs // 2))
        for label, file in files.items():
            rates = e2e[file]["backtest"]
            print(
                f"backtest, {label}: median {statistics.median(rates):>10,.0f} samples/s "
                f"(runs: {', '.join(f'{r:,.0f}' for r in rates)}; "
                f"{file.stat().st_size / 1e6:.0f} MB)"
            )
            for name in BARE_PARSERS:
                bare = e2e[file][name]
                ratio = statistics.median(
                    b / r for b, r in zip(rates, bare, strict=True)
                )  # run by run: a backtest and the bare read beside it saw the same machine
                print(
                    f"  bare read + {name} parse of that file: median "
                    f"{statistics.median(bare):>10,.0f} samples/s; backtest / bare "
                    f"{ratio:.2f}"
                )
            decode = e2e[file]["decode"]
            print(
                f"  read + validated decode of that file (the backtest's own, no detection): "
                f"median {statistics.median(decode):>10,.0f} samples/s; backtest / that "
                f"{statistics.median(b / r for b, r in zip(rates, decode, strict=True)):.2f}"
            )
        if args.batched:  # what a free decode would leave: the core over decoded rows
            decoded = list(read_messages([files["batched records"]], BacktestStats(), rows=True))
            rates = core_only(decoded, len(messages), max(1, args.runs // 2))
            print(
                f"core alone over the batched file's decoded rows: median "
                f"{statistics.median(rates):>10,.0f} samples/s "
                f"(runs: {', '.join(f'{r:,.0f}' for r in rates)}; the backtest with a free decode)"
            )

    for nodes in (int(n) for n in args.state_sizes.split(",") if n):
        s = state_per_gpu(nodes, 120.0, args.seed)
        print(
            f"state, {nodes:>3} nodes: {s['total_per_gpu']:>7,.0f} B/GPU in all "
            f"(node partitions {s['nodes']:,.0f}, job partitions {s['jobs']:,.0f}, "
            f"fusion {s['fusion']:,.0f}); largest node partition "
            f"{s['node_partition_per_gpu']:,.0f} B/GPU, largest job partition "
            f"{s['job_partition_per_gpu']:,.0f} B/GPU (budget 10,240); sealed checkpoints "
            f"{s['checkpoint_per_gpu']:,.0f} B/GPU, in memory {s['in_memory_per_gpu']:,.0f} B/GPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

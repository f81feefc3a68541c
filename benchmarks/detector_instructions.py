"""Detector cost in machine instructions (valgrind), for comparisons a shared machine cannot blur.

Timings on this 2-core shared machine move by ±20 % from run to run with the neighbours'
load, and same-run ratios of two codes moved from 0.77 to 0.63 between a quiet and a busy
hour (a larger working set suffers more from shared caches). A change worth 3 % is invisible
in them. Instruction counts are not: valgrind's ``cachegrind`` counts every instruction the
interpreter executes, the same from run to run (hash seed fixed) to ~0.3 %.

Each measurement runs a child twice under ``valgrind --tool=cachegrind --cache-sim=no``:
once parsing the input and importing the engine, once doing that and running the engine over
the messages; the difference is the engine's instructions (parsing, imports and interpreter
start-up cancel out). ``--against PYTHON`` measures another checkout's engine (its
virtualenv's interpreter) on the same input, written by this checkout's simulator; a
``--config`` JSON object switches detectors off (``{"peer_anomaly": false}``) to show what
one costs (``--other-config``: the other checkout's switches, when its engine has other
ones). ``--end-to-end`` counts ``guard backtest``'s work instead (read the JSONL, parse and
validate every line, detect, write the flags): the figure the backtest's throughput follows;
there the setup child only imports. Engine only, the parsed input is frozen out of the
cyclic collector's walks (``gc.freeze``): a backtest streams its input and holds nothing
like it, and the collections that walk it (triggered by the engine's own allocations, e.g. a
river model's ~9,500 tree nodes) moved the counts by ~1–2 % from run to run and charged the
engine ~7 % for the benchmark's memory.
Instructions are not time (cache misses are not counted), so this complements
``detector_throughput.py``; it does not replace it.

Usage::

    .venv/bin/python benchmarks/detector_instructions.py [--nodes 16] [--messages 40000]
    .venv/bin/python benchmarks/detector_instructions.py --against OTHER/.venv/bin/python
    .venv/bin/python benchmarks/detector_instructions.py --config '{"fabric": false}'
    .venv/bin/python benchmarks/detector_instructions.py --end-to-end --messages 200000 \
        --against OTHER/.venv/bin/python

Needs valgrind (Debian: ``apt-get install valgrind``); a run takes about a minute per
measurement of 40k messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import gc, json, sys
from pathlib import Path
from guard.schemas import parse_message
from guard.detectors.core import MessageFeed
from guard.detectors.engine import EngineConfig
path, run, config = sys.argv[1], sys.argv[2] == "run", sys.argv[3]
lines = [line for line in Path(path).read_bytes().splitlines() if line]
messages = [parse_message(line) for line in lines]
gc.freeze()  # the parsed input is the benchmark's memory, not the engine's: never walk it
if run:
    engine = MessageFeed(EngineConfig(**json.loads(config)))
    update = engine.update
    for message in messages:
        update(message)
    engine.flush()
"""

#: ``guard backtest`` over the file
_END_TO_END = """
import json, sys, tempfile
from pathlib import Path
from guard.detectors.engine import EngineConfig
from guard.evaluation.backtest import BacktestStats, make_detector, read_messages, run_backtest
path, run, config = sys.argv[1], sys.argv[2] == "run", sys.argv[3]
switches = json.loads(config)  # none: the default engine, as any checkout makes it
detector = make_detector("guard", EngineConfig(**switches)) if switches else make_detector("guard")
if run:
    stats = BacktestStats()
    with tempfile.TemporaryFile() as out:
        run_backtest(read_messages([Path(path)], stats), out, detector, stats)
"""

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def instructions(python: str, path: Path, run: bool, config: str, child: str = _CHILD) -> int:
    """Instructions valgrind counted for one child (its whole life)."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            python,
            "-c",
            child,
            str(path),
            "run" if run else "setup",
            config,
        ],
        capture_output=True,
        text=True,
        # OpenBLAS (numpy) otherwise starts spinning threads whose spin valgrind counts
        # (±50M instructions a run); the engine does no BLAS work
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"},
        check=False,
    )
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run of {python} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def engine_instructions(python: str, path: Path, config: str, child: str = _CHILD) -> int:
    return instructions(python, path, True, config, child) - instructions(
        python, path, False, config, child
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--messages", type=int, default=40_000, help="the first N messages")
    parser.add_argument("--against", metavar="PYTHON", help="another checkout's interpreter")
    parser.add_argument("--config", default="{}", help="EngineConfig switches, as JSON")
    parser.add_argument(
        "--other-config", default=None, help="the other checkout's switches (default: --config)"
    )
    parser.add_argument(
        "--end-to-end", action="store_true", help="guard backtest's work: read, parse, detect"
    )
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("detector_instructions: valgrind is not installed (apt-get install valgrind)")
        return 2
    other_config = args.config if args.other_config is None else args.other_config
    json.loads(args.config), json.loads(other_config)  # a bad object fails here, not in a child
    child = _END_TO_END if args.end_to_end else _CHILD

    from guard.agents.simulator import ClusterSimulator, SimConfig
    from guard.schemas import encode

    sim = ClusterSimulator(SimConfig(nodes=args.nodes, duration_s=args.duration, seed=args.seed))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.jsonl"
        lines = [encode(m) + b"\n" for m in sim.messages()][: args.messages]
        path.write_bytes(b"".join(lines))  # the first N: the children read them all
        n = len(lines)
        what = "guard backtest (read, parse, detect)" if args.end_to_end else "the engine"
        print(f"input: {args.nodes} nodes x {args.duration:.0f} s, first {n:,} messages; {what}")
        this = engine_instructions(sys.executable, path, args.config, child)
        print(f"this:  {this / 1e9:.3f}e9 instructions, {this / n:,.0f} per message")
        if args.against:
            other = engine_instructions(args.against, path, other_config, child)
            print(f"other: {other / 1e9:.3f}e9 instructions, {other / n:,.0f} per message")
            print(f"this / other: {this / other:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

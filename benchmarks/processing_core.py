"""Where a streams worker's time goes: the shared processing core over records in memory.

Both engines (native and faust) and ``guard backtest`` hand batches of records to the same
core, :meth:`~guard.detectors.core.DetectionCore.step` (decode each record through
``guard.schemas``, expand a batch into its samples, run the keyed detectors, tick their
clocks). This times that core over the simulator's records held in memory — no broker, so
the figures are the ceiling of one worker on one core — and, on the same records in the
same run, its parts:

* **core** — ``DetectionCore.step`` for the node and the job stream, in batches of
  ``--batch`` records (a worker's ``batch_max``); **core node** and **core job** each stream
  alone (GPU and NIC records, columnar; step and collective records, per sample);
* **decode** — each record to its samples as the core decodes it
  (:func:`~guard.schemas.sample_decoder.decode_samples`, msgspec against the models'
  constraints) alone;
* **pydantic** — the same through ``guard.schemas.decode`` and a batch's ``samples()``:
  what the core paid before, and what a record the fast path refuses still pays;
* **detectors** — :class:`~guard.detectors.engine.MessageFeed` over the decoded samples;
* **orjson** — ``orjson.loads`` of each record: what a bare consume + decode loop pays.

Rates are samples per CPU-second of this process (the machine is shared), medians of
``--runs`` interleaved runs; the per-sample costs under them add up to roughly the core's
(the core also keeps per-key state, clocks and counters). Issue #14 asks ≥ 100k samples/s
of a native worker with batch records.

    .venv/bin/python benchmarks/processing_core.py [--nodes 16] [--duration 300] [--runs 3]
        [--records single,batched] [--batch 2000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import orjson

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.detectors.core import DetectionCore, MessageFeed, encode_findings
from guard.schemas import GuardMessage, decode, encode
from guard.schemas.batches import batch_messages, expand
from guard.schemas.sample_decoder import decode_samples

#: the stream (and its Kafka key) of each telemetry kind
LEVEL = {"gpu": "node", "nic": "node", "step": "job", "collective": "job"}

Records = dict[str, list[tuple[int, str, bytes]]]  # level -> (partition, kind, value)


def records_of(messages: list[GuardMessage], batched: bool) -> Records:
    """The records a worker would consume, per stream, topic named by its kind."""
    out: Records = {"node": [], "job": []}
    for m in batch_messages(messages) if batched else messages:
        kind = m.kind.removesuffix("_batch")
        out[LEVEL[kind]].append((0, kind, encode(m)))
    return out


def core(records: Records, batch: int) -> tuple[float, int]:
    """CPU seconds of the processing core over ``records``, and the samples it counted. What
    a step sends to the findings topic comes back with the next step, as a worker consumes
    it (fusion, and the jobs' river models over the nodes' windows)."""
    detection = DetectionCore()
    started = time.process_time()
    for recs in records.values():
        pending: list[tuple[int, bytes, bytes]] = []
        for i in range(0, len(recs), batch):
            out = detection.step(recs[i : i + batch], pending, 0.0)
            pending = encode_findings(out.findings)
        while pending:
            pending = encode_findings(detection.step((), pending, 0.0).findings)
    return time.process_time() - started, detection.counters.samples


def decode_only(records: Records) -> float:
    started = time.process_time()
    for recs in records.values():
        for _, kind, value in recs:
            decode_samples(value, kind)
    return time.process_time() - started


def pydantic_only(records: Records) -> float:
    started = time.process_time()
    for recs in records.values():
        for _, kind, value in recs:
            expand(decode(value, kind))
    return time.process_time() - started


def orjson_only(records: Records) -> float:
    loads = orjson.loads
    started = time.process_time()
    for recs in records.values():
        for _, _, value in recs:
            loads(value)
    return time.process_time() - started


def detectors_only(samples: list[GuardMessage]) -> float:
    engine = MessageFeed()
    update = engine.update
    started = time.process_time()
    for m in samples:
        update(m)
    engine.flush()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records", default="single,batched", help="single and/or batched")
    parser.add_argument("--batch", type=int, default=2000, help="records per process() call")
    args = parser.parse_args()
    sim = ClusterSimulator(SimConfig(nodes=args.nodes, duration_s=args.duration, seed=3))
    messages = list(sim.messages())
    # the detectors see a stream's samples in its own order, as in a worker: node, then job
    samples = [m for m in messages if LEVEL[m.kind] == "node"]
    samples += [m for m in messages if LEVEL[m.kind] == "job"]
    inputs = {kind: records_of(messages, kind == "batched") for kind in args.records.split(",")}
    gc.freeze()  # the preloaded input is not a worker's garbage
    n = len(messages)
    print(f"input: {args.nodes} nodes x {args.duration:.0f} s, {n:,} samples")
    parts: dict[str, Callable[[Records], float]] = {
        "decode": decode_only,
        "pydantic": pydantic_only,
        "orjson": orjson_only,
    }
    for label, records in inputs.items():
        rates: dict[str, list[float]] = {
            name: [] for name in ("core", "core node", "core job", *parts, "detectors")
        }
        for _ in range(args.runs):
            seconds, counted = core(records, args.batch)
            assert counted == n, (counted, n)
            rates["core"].append(n / seconds)
            for level in ("node", "job"):  # each stream alone: gpu + nic, step + collective
                seconds, counted = core({level: records[level]}, args.batch)
                rates[f"core {level}"].append(counted / seconds)
            for name, part in parts.items():
                rates[name].append(n / part(records))
            rates["detectors"].append(n / detectors_only(samples))
        count = sum(len(r) for r in records.values())
        print(f"{label} records ({count:,} records, {n / count:.1f} samples each):")
        for name, values in rates.items():
            median = statistics.median(values)
            runs = ", ".join(f"{v:,.0f}" for v in values)
            print(
                f"  {name:<10} {median:>9,.0f} samples/s  {1e6 / median:5.1f} us/sample"
                f"  (runs: {runs})"
            )


if __name__ == "__main__":
    main()

"""What a streams worker does with a batch of records, whatever carries them.

Plain Python shared by both transports of ``guard streams`` (the faust app and the native
librdkafka worker): keyed detector state with periodic checkpoints, one event clock per
stream, the routing of telemetry to :mod:`guard.detectors` and of findings to fusion. The
transports only move bytes in and out.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from guard.config import ConfigError, Settings
from guard.detectors.engine import (
    FABRIC_KEY,
    EngineConfig,
    JobDetectors,
    NodeDetectors,
    fabric_detector,
    fabric_key,
)
from guard.detectors.findings import Finding
from guard.detectors.fusion import JobFusion, NodeFusion
from guard.detectors.nic import NicDetector
from guard.metrics import dead_letter_reason
from guard.schemas import (
    CATEGORIES,
    SEVERITY_RANK,
    Flag,
    GuardMessage,
    NicSample,
    SchemaError,
)
from guard.schemas.sample_decoder import decode_samples
from guard.schemas.topics import JOB_KINDS, NODE_KINDS, TOPIC_BY_KIND

from .checkpoints import CHECKPOINT_FORMAT, CheckpointRefused, seal, unseal

__all__ = [
    "CHECKPOINT_FORMAT",
    "EventClock",
    "FusionProcessor",
    "KeyedState",
    "StreamsCounters",
    "TelemetryProcessor",
    "decode_finding",
    "encode_finding",
    "engine_config_of",
    "finding_key",
    "parse_progress",
    "progress_line",
    "topic_kinds",
]

# (topic, partition, value) of one record
Record = tuple[str, int, bytes | None]

#: Largest checkpoint record; bigger states (a job of thousands of ranks) are split into
#: parts under keys ``<key>\x1f<i>`` with a manifest under the key itself. Kafka refuses
#: records over 1 MB by default, and a refused checkpoint would stop the worker.
CHUNK_BYTES = 512 * 1024
_MANIFEST = b"guard-chunks:"
#: Most parts a manifest may name (512 MB of state): a forged manifest cannot make a
#: worker look up billions of keys.
MAX_CHUNKS = 1024

log = logging.getLogger("guard.streams")


@dataclass
class StreamsCounters:
    """What a worker did, for progress lines, benchmarks and ``/metrics``."""

    telemetry: int = 0  # records (a batch is one)
    samples: int = 0  # single samples, a batch counted by its entries
    findings: int = 0
    flags: int = 0
    dead_letters: int = 0
    kinds: Counter[str] = field(default_factory=Counter)  # valid messages by kind
    flag_classes: Counter[tuple[str, str]] = field(default_factory=Counter)  # category, severity
    dead_reasons: Counter[str] = field(default_factory=Counter)

    def totals(self) -> dict[str, int]:
        """The running totals of a progress line."""
        return {
            "telemetry": self.telemetry,
            "samples": self.samples,
            "findings": self.findings,
            "flags": self.flags,
            "dead_letters": self.dead_letters,
        }


def progress_line(worker: str, event: str = "progress", **counts: int) -> str:
    """A worker's report as one JSON line (the demo, tests and benchmarks read it back).

    >>> progress_line("streams", telemetry=3, flags=1)
    '{"event": "progress", "worker": "streams", "telemetry": 3, "flags": 1}'
    """
    return json.dumps({"event": event, "worker": worker, **counts})


def parse_progress(line: str | bytes) -> dict[str, Any] | None:
    """The report in a line of a worker's output, or None for any other line.

    >>> parse_progress('{"event": "progress", "worker": "streams", "telemetry": 3}')["telemetry"]
    3
    >>> parse_progress("partitions assigned: 0,1") is None
    True
    """
    text = line.strip()
    if not text.startswith(b"{" if isinstance(text, bytes) else "{"):
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return None
    return report if isinstance(report, dict) and report.get("event") == "progress" else None


@dataclass
class KeyedState:
    """Live detector objects per key, checkpointed every ``every_s`` seconds.

    ``load(key)`` returns the last checkpoint's bytes (or None); ``save(key, partition,
    blob)`` stores one. The partition travels with each object so that a rebalance can
    forget exactly what moved away. Checkpoints are sealed with ``secret``
    (:mod:`guard.streams.checkpoints`): the workers set the configured streams state key;
    the default, a random key, reads back only what this object wrote.
    """

    make: Callable[[str], Any]
    every_s: float
    load: Callable[[str], bytes | None] = lambda key: None
    save: Callable[[str, int, bytes], None] = lambda key, partition, blob: None
    #: ``delete(key, partition)``: forget a key's checkpoint (a tombstone on the changelog)
    delete: Callable[[str, int], None] = lambda key, partition: None
    live: dict[str, tuple[Any, int]] = field(default_factory=dict)
    saved_at: dict[str, float] = field(default_factory=dict)
    #: when each key last had input (monotonic), for :meth:`expire`
    seen: dict[str, float] = field(default_factory=dict)
    secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    restored: int = 0
    #: checkpoints found but not used (another format, a bad signature, unreadable, or not
    #: this table's kind of object): those keys start cold
    refused: int = 0

    def get(self, key: str, partition: int) -> Any:
        entry = self.live.get(key)
        if entry is not None and entry[1] == partition:
            return entry[0]
        obj = self._restore(key)
        if obj is not None:
            self.restored += 1
        else:
            obj = self.make(key)
        self.live[key] = (obj, partition)
        # A per-key offset spreads the checkpoints over the period: keys created together
        # (every node of a cluster at start-up) would otherwise all be saved in one burst
        # every period and stall the worker for that long.
        spread = (zlib.crc32(key.encode()) % 1024) / 1024 * self.every_s
        self.saved_at[key] = time.monotonic() - spread
        return obj

    def checkpoint_due(self, keys: Iterable[str], force: bool = False) -> int:
        """Save the keys whose last checkpoint is older than ``every_s``. Returns how many.

        Called with the keys of each batch, it also marks them seen (see :meth:`expire`).
        """
        now = time.monotonic()
        saved = 0
        for key in keys:
            self.seen[key] = now
            entry = self.live.get(key)
            if entry is None or (not force and now - self.saved_at.get(key, 0.0) < self.every_s):
                continue
            self._store(key, entry[1], entry[0])
            self.saved_at[key] = now
            saved += 1
        return saved

    def _store(self, key: str, partition: int, obj: Any) -> None:
        blob = seal(self.secret, key, obj)
        if len(blob) <= CHUNK_BYTES:
            self.save(key, partition, blob)
            return
        parts = [blob[i : i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)]
        for i, part in enumerate(parts):  # parts first: the manifest completes the set
            self.save(f"{key}\x1f{i}", partition, part)
        self.save(key, partition, _MANIFEST + str(len(parts)).encode())

    def _restore(self, key: str) -> Any:
        blob = self.load(key)
        if blob is None:
            return None
        try:
            blob = self._assemble(key, blob)
            if blob is None:
                return None  # an incomplete checkpoint: start cold rather than wrong
            obj = unseal(self.secret, key, blob)
            cold = self.make(key)
            if type(obj) is not type(cold):
                raise CheckpointRefused(
                    f"it holds a {type(obj).__name__}, not a {type(cold).__name__}"
                )
            return obj
        except CheckpointRefused as exc:
            why = str(exc)
        self.refused += 1
        log.warning("checkpoint of %r refused: %s; that key starts cold", key, why)
        return None

    def _assemble(self, key: str, blob: bytes) -> bytes | None:
        """The whole checkpoint of ``key`` from its first record (a manifest or all of it)."""
        if not blob.startswith(_MANIFEST):
            return blob
        count = blob[len(_MANIFEST) :]
        if not count.isdigit() or not 0 < int(count) <= MAX_CHUNKS:
            raise CheckpointRefused(f"its manifest names {count[:20]!r} parts")
        parts = [self.load(f"{key}\x1f{i}") for i in range(int(count))]
        if any(p is None for p in parts):
            return None
        return b"".join(p for p in parts if p is not None)

    @staticmethod
    def totals(states: Iterable[KeyedState]) -> dict[str, int]:
        """Keys resumed from checkpoints, checkpoints refused, and keys held now (each
        key's detectors in memory; :meth:`expire` bounds it), over ``states``."""
        states = list(states)
        return {
            "restored": sum(s.restored for s in states),
            "refused": sum(s.refused for s in states),
            "keys": sum(len(s.live) for s in states),
        }

    def expire(self, idle_s: float) -> list[str]:
        """Drop the keys without input for ``idle_s`` (0: never), their checkpoints with
        them; returns them. Keeps a worker's memory bounded when key names churn (jobs that
        ended, nodes renamed, a flood of made-up names)."""
        if idle_s <= 0:
            return []
        cutoff = time.monotonic() - idle_s
        gone = [k for k, t in self.seen.items() if t < cutoff]
        for key in gone:
            del self.seen[key]
            entry = self.live.pop(key, None)
            self.saved_at.pop(key, None)
            if entry is not None:
                self.delete(key, entry[1])
        return gone

    def forget(self, partitions: set[int]) -> list[str]:
        """Checkpoint, then drop, the keys of ``partitions``; returns them.

        The partitions moved to another worker, which resumes their keys from this last
        checkpoint rather than one up to ``every_s`` old.
        """
        keys = [k for k, (_, p) in self.live.items() if p in partitions]
        self.checkpoint_due(keys, force=True)
        for key in keys:
            del self.live[key]
            self.saved_at.pop(key, None)
            self.seen.pop(key, None)
        return keys


class EventClock:
    """Event time per key; drives the time-based checks (hangs, lost GPUs) of each key.

    A key is judged on its own clock only: partitions (and the topics of one stream) are
    consumed at different paces, so one job's messages can run seconds of event time ahead
    of another's, and ticking a job with someone else's time would make its in-flight
    collectives look hung. When a key's input stops for a while, its event time follows
    the wall clock, so that a job that stopped sending (a hang) or a node that went silent
    (a lost GPU) is still noticed.
    """

    def __init__(self, state: KeyedState, tick_s: float) -> None:
        self.state = state
        self.tick_s = tick_s
        self.watermark: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.last_tick: dict[str, float] = {}

    def advance(self, latest: dict[str, float]) -> list[Finding]:
        """``latest``: the newest event time seen per key in a batch."""
        found: list[Finding] = []
        now = time.monotonic()
        for key, ts in latest.items():
            if ts <= self.watermark.get(key, 0.0):
                continue
            self.watermark[key] = ts
            self.wall[key] = now
            if ts - self.last_tick.get(key, 0.0) >= self.tick_s:
                found += self._tick(key, ts)
        return found

    def idle(self, after_s: float = 2.0) -> list[Finding]:
        found: list[Finding] = []
        now = time.monotonic()
        for key, wall in list(self.wall.items()):
            idle = now - wall
            if idle >= after_s and key in self.state.live:
                found += self._tick(key, self.watermark[key] + idle)
        return found

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.watermark.pop(key, None)
            self.wall.pop(key, None)
            self.last_tick.pop(key, None)

    def _tick(self, key: str, now: float) -> list[Finding]:
        self.last_tick[key] = now
        entry = self.state.live.get(key)
        return entry[0].tick(now) if entry is not None else []


def engine_config_of(settings: Settings) -> EngineConfig:
    """The engine configuration of the ``[detectors]`` settings (a bad detector argument is a
    configuration error that names it)."""
    try:
        return EngineConfig.from_mapping(
            settings.detectors.model_dump(),
            topology=settings.fabric.load(),
            nodes_per_leaf=settings.fabric.nodes_per_leaf,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{exc} (fix the [detectors] section or GUARD_DETECTORS_*)") from None


def topic_kinds(topic: Callable[[str], str], level: str) -> dict[str, str]:
    """Topic name -> message kind for the ``"node"`` or ``"job"`` stream (``topic`` adds the
    configured prefix)."""
    kinds = NODE_KINDS if level == "node" else JOB_KINDS
    return {topic(TOPIC_BY_KIND[kind]): kind for kind in kinds}


#: the record kinds whose samples the fabric detector reads
_NIC_KINDS = frozenset({"nic", "nic_batch"})


class TelemetryProcessor:
    """Decodes telemetry records and feeds them to the keyed detectors of one stream.

    ``level`` is ``"node"`` (gpu, nic; key = node) or ``"job"`` (step, collective; key =
    job).
    """

    def __init__(
        self,
        level: str,
        kind_of_topic: dict[str, str],
        config: EngineConfig,
        every_s: float,
        counters: StreamsCounters,
    ) -> None:
        self.level = level
        self.kind_of_topic = kind_of_topic
        make: Callable[[str], Any] = (
            (
                lambda key: (
                    fabric_detector(config)
                    if key.startswith(FABRIC_KEY)
                    else NodeDetectors(key, config)
                )
            )
            if level == "node"
            else (lambda key: JobDetectors(key, config))
        )
        self.config = config
        #: the node stream also keeps one fabric hot-spot detector per input partition
        self.fabric = level == "node" and config.fabric and config.node_telemetry
        self.state = KeyedState(make, every_s)
        self.clock = EventClock(self.state, config.tick_s)
        self.counters = counters

    def forget(self, partitions: set[int]) -> None:
        self.clock.forget(self.state.forget(partitions))

    def expire(self, idle_s: float) -> int:
        """Drop keys idle for ``idle_s`` (:meth:`KeyedState.expire`); returns how many."""
        gone = self.state.expire(idle_s)
        self.clock.forget(gone)
        return len(gone)

    def key_of(self, message: GuardMessage) -> str | None:
        return message.node if self.level == "node" else message.job

    def process(
        self, records: Iterable[Record]
    ) -> tuple[list[Finding], list[tuple[int, SchemaError]]]:
        """Findings of a batch, and the batch positions of records that were not valid."""
        found: list[Finding] = []
        bad: list[tuple[int, SchemaError]] = []
        latest: dict[str, float] = {}
        kinds = self.counters.kinds
        n = samples = 0
        for n, (topic, partition, value) in enumerate(records, 1):
            try:
                kind, singles = decode_samples(value or b"", self.kind_of_topic[topic])
            except SchemaError as exc:
                bad.append((n - 1, exc))
                continue
            kinds[kind] += 1
            key = self.key_of(singles[0])  # a batch's samples share its node and job
            if key is None:
                continue
            detectors = self.state.get(key, partition)
            samples += len(singles)
            update = detectors.update
            newest = latest.get(key, 0.0)
            for single in singles:
                found += update(single)
                if single.ts > newest:  # noqa: PLR1730 (per sample: max() costs a call)
                    newest = single.ts
            if newest > 0.0:
                latest[key] = newest
            if self.fabric and kind in _NIC_KINDS:
                found += self._fabric(singles, partition, latest, detectors.nic)
        self.counters.telemetry += n
        self.counters.samples += samples
        self.counters.dead_letters += len(bad)
        self.counters.dead_reasons.update(dead_letter_reason(exc) for _, exc in bad)
        self.state.checkpoint_due(latest)
        found += self.clock.advance(latest)
        self.counters.findings += len(found)
        return found, bad

    def _fabric(
        self,
        samples: Iterable[GuardMessage],
        partition: int,
        latest: dict[str, float],
        nic: NicDetector,
    ) -> list[Finding]:
        """NIC samples to the partition's fabric detector (ticked and saved like a key),
        with the increases their node's NIC detector (``nic``) read from them."""
        key = fabric_key(partition)
        detector = self.state.get(key, partition)
        if detector.topology is None:  # not pickled with it: a restored one gets it back
            detector.topology = self.config.topology
        found: list[Finding] = []
        for sample in samples:
            if sample.kind == "nic":
                assert isinstance(sample, NicSample)
                found += detector.add(sample, nic.increase(sample))
                if sample.ts > latest.get(key, 0.0):
                    latest[key] = sample.ts
        return found


def finding_key(finding: Finding) -> str:
    """Findings are repartitioned by the node they are about (``job:<id>`` for job-level)."""
    return finding.node if finding.node is not None else f"job:{finding.job or ''}"


def encode_finding(finding: Finding) -> bytes:
    return orjson.dumps(asdict(finding))


_FINDING = TypeAdapter(Finding)


def decode_finding(raw: bytes) -> Finding:
    """A finding off the internal findings topic, which anyone who can produce can write to:
    anything but a well-typed finding of a known category and severity is a SchemaError."""
    try:
        finding = _FINDING.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise SchemaError(first["msg"], "finding", field) from None
    if finding.category not in CATEGORIES:
        raise SchemaError(f"unknown category {finding.category!r}", "finding", "category")
    if finding.severity not in SEVERITY_RANK:
        raise SchemaError(f"unknown severity {finding.severity!r}", "finding", "severity")
    return finding


class FusionProcessor:
    """Per-node (and per-job) fusion of findings into flags, in event-time order per batch."""

    def __init__(self, every_s: float, counters: StreamsCounters) -> None:
        self.state = KeyedState(
            lambda key: JobFusion(key[4:]) if key.startswith("job:") else NodeFusion(key),
            every_s,
        )
        self.counters = counters

    def process(
        self, records: Iterable[tuple[bytes, int, bytes]]
    ) -> tuple[list[Flag], list[tuple[int, SchemaError]]]:
        """``records``: (key, partition, value) of findings. Returns the flags, and the batch
        positions of records that were not findings (for the dead-letter topic)."""
        decoded: list[tuple[Finding, str, int]] = []
        bad: list[tuple[int, SchemaError]] = []
        for n, (key, partition, value) in enumerate(records):
            try:
                decoded.append((decode_finding(value), key.decode(), partition))
            except (SchemaError, UnicodeDecodeError) as exc:
                bad.append((n, exc if isinstance(exc, SchemaError) else SchemaError(str(exc))))
        decoded.sort(key=lambda item: item[0].ts)
        flags: list[Flag] = []
        for finding, key, partition in decoded:
            flag = self.state.get(key, partition).update(finding)
            if flag is not None:
                flags.append(flag)
        self.state.checkpoint_due({key for _, key, _ in decoded})
        self.counters.flags += len(flags)
        self.counters.flag_classes.update((f.category, f.severity) for f in flags)
        self.counters.dead_letters += len(bad)
        self.counters.dead_reasons.update(dead_letter_reason(exc) for _, exc in bad)
        return flags, bad

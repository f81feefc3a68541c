"""What the two transports of ``guard streams`` share around the detection core.

Both the faust app and the native librdkafka worker run one
:class:`~guard.detectors.core.DetectionCore` and call its one verb, ``step(telemetry,
findings, wall)``, with the records of a batch. What they add lives here: the core's tables
as :class:`KeyedState` (each key checkpointed to a changelog, sealed, and restored when a
partition comes back), the progress lines, the configuration of the detectors, and the
topic -> kind map of the records a worker reads.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from guard.config import ConfigError, Settings
from guard.detectors.core import CoreCounters, Reads
from guard.detectors.engine import EngineConfig
from guard.schemas.topics import JOB_KINDS, NODE_KINDS, TOPIC_BY_KIND

from .checkpoints import CHECKPOINT_FORMAT, CheckpointRefused, seal, unseal

__all__ = [
    "CHECKPOINT_FORMAT",
    "KeyedState",
    "StreamsCounters",
    "engine_config_of",
    "parse_progress",
    "progress_line",
    "topic_kinds",
]

#: A worker's counters are its core's.
StreamsCounters = CoreCounters

#: Largest checkpoint record; bigger states (a job of thousands of ranks) are split into
#: parts under keys ``<key>\x1f<i>`` with a manifest under the key itself. Kafka refuses
#: records over 1 MB by default, and a refused checkpoint would stop the worker.
CHUNK_BYTES = 512 * 1024
_MANIFEST = b"guard-chunks:"
#: Most parts a manifest may name (512 MB of state): a forged manifest cannot make a
#: worker look up billions of keys.
MAX_CHUNKS = 1024

log = logging.getLogger("guard.streams")


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
    text = line.decode(errors="replace").strip() if isinstance(line, bytes) else line.strip()
    if not text.startswith("{"):
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


def topic_kinds(topic: Callable[[str], str], level: str = "all") -> dict[str, str]:
    """Topic name -> message kind of the telemetry topics: the ``"node"`` stream's, the
    ``"job"`` stream's or (default) both (``topic`` adds the configured prefix)."""
    kinds = {"node": NODE_KINDS, "job": JOB_KINDS}.get(level, (*NODE_KINDS, *JOB_KINDS))
    return {topic(TOPIC_BY_KIND[kind]): kind for kind in kinds}


def node_reads(
    read: dict[tuple[str, int], int],
    kinds: dict[str, str],
    end: Callable[[str, int], int | None],
) -> Reads:
    """The core's ``reads`` (:data:`~guard.detectors.core.Reads`) from a batch: ``read``,
    (topic, partition) -> the next offset to read, of the telemetry topics (``kinds``: topic
    -> kind); ``end``: the partition's end offset as the consumer last knew it (None or < 0:
    not known). Only node-telemetry partitions count (fusion's wait for a node's stream
    that is behind, not quiet)."""
    reads: dict[tuple[str, int], tuple[int, int]] = {}
    for (topic, partition), offset in read.items():
        if (kind := kinds[topic]) in NODE_KINDS:
            last = end(topic, partition)
            reads[kind, partition] = (offset, last if last is not None and last >= 0 else -1)
    return reads

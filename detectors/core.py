"""The detection core: what ``guard backtest``, the native worker and the faust app all run.

One :class:`DetectionCore` owns the detection state of the partitions its runner holds: the
router (node telemetry to the node's detectors, rank telemetry to the job's, NIC samples
also to the partition's fabric detector), one event clock per key, the detectors, and the
fusion of findings into flags. Every runner calls it the same way, with one verb:

``out = core.step(telemetry, findings, wall[, reads])``

* ``telemetry``: ``(partition, kind, value)`` records — the raw bytes of telemetry records
  (single or batch kinds); ``kind`` is the kind the topic carries, or ``None`` (a line of a
  file: any kind);
* ``findings``: ``(partition, key, value)`` records of the internal findings topic;
* ``wall``: the runner's clock, in seconds. A worker passes ``time.monotonic()``; a backtest
  passes its input's event-time watermark, which is what a live run at real-time pace would
  read on its clock. That clock is the only thing that tells silence (a hung job, a GPU
  that stopped reporting) from a job that is merely between messages.
* ``reads`` (optional, a live runner's): where its reading of each node-telemetry partition
  stands, ``(kind, partition) -> (next offset, end offset)``; fusion waits for a node whose
  partitions hold records unread since a straggler came (:class:`_ReadBarriers`).

``out.findings`` go to fusion by their key (:func:`finding_key`): a worker produces them to
the findings topic, whose partition of a node's key is that node's telemetry partition (its
fusion state lives with it); a backtest hands them to the next ``step`` itself — the same
records, through the same encoder (:func:`encode_findings`). ``out.flags`` are the flags of
the findings it fused, ``out.bad`` and ``out.bad_findings`` the batch positions of records
that were not valid (for the dead-letter topic).

**Clocks.** Each key (a node, a job, a partition's fabric) is judged on its own event time:
partitions and topics are consumed at their own paces, so one job's messages can run seconds
ahead of another's, and ticking a job with another's time would make its in-flight collectives
look hung. A key's time-driven checks (hangs, lost GPUs) run every ``tick_s`` of its own time;
a key without input for ``idle_after_s`` on the runner's clock has its time follow that clock
(:meth:`DetectionCore.idle`), so a job that stopped sending is still noticed.

**State.** Keys live in three tables (node detectors, job detectors, fusion), each a
:class:`PartStore` the runner gives: :class:`MemoryStore` for a backtest; a worker's store
checkpoints each key to a changelog and forgets what a rebalance moves away.

Example
-------
>>> from guard.schemas import GpuSample, encode
>>> from guard.detectors.core import DetectionCore
>>> core = DetectionCore()
>>> flags = []
>>> for t in range(6):
...     records = [(0, "gpu", encode(GpuSample(ts=100.0 + 10 * t, node="n1", gpu=g, temp_c=60.0,
...                 xid=48 if (g == 3 and t == 2) else None))) for g in range(8)]
...     out = core.step(records, pending if t else [], wall=100.0 + 10 * t)
...     pending = encode_findings(out.findings)
...     flags += out.flags
>>> flags += core.step([], pending, wall=160.0).flags
>>> [(f.node, f.gpu, f.category, f.severity) for f in flags]
[('n1', 3, 'gpu_error', 'critical')]

"""

from __future__ import annotations

import math
import pickle
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Protocol, TypeAlias

import numpy as np

from guard.schemas import Finding as FindingRecord
from guard.schemas import (
    Flag,
    GuardMessage,
    SchemaError,
    WindowFeatures,
    decode,
    encode,
)
from guard.schemas.codec import leading_kind
from guard.schemas.sample_decoder import (
    Rows,
    decode_rows,
    decode_samples,
    decode_structs,
    parse_samples,
    record_ts,
    structs_of,
)
from guard.schemas.topics import JOB_KINDS, NODE_KINDS

from .engine import FABRIC_KEY, EngineConfig, JobDetectors, NodeDetectors, fabric_detector
from .findings import Finding
from .fusion import EXPLAINABLE, JobFusion, NodeFusion
from .gpu_round import GpuColumns
from .gpu_step import update_gpus
from .job_columns import CollectiveColumns, StepColumns
from .nic import NicColumns, NicIncreases, update_nics
from .peer_anomaly import GpuJobAnomaly

__all__ = [
    "ANOMALY_KEY",
    "READ_MAX_S",
    "TABLES",
    "CoreCounters",
    "CoreOutput",
    "DetectionCore",
    "MemoryStore",
    "MessageFeed",
    "Outgoing",
    "PartStore",
    "Reads",
    "decode_finding",
    "encode_finding",
    "encode_findings",
    "finding_key",
]

#: The core's tables, by the changelog name a worker keeps them under.
TABLES = ("node-detectors", "job-detectors", "fusion")

#: (partition, kind or None, value) of one telemetry record; the value is its bytes, or the
#: samples of a record its runner decoded already
TelemetryRecord = tuple[int, str | None, Any]
#: (partition, key, value) of one record of the findings topic
FindingRecordIn = tuple[int, bytes, bytes]
#: where a live runner's reading of its node-telemetry partitions stands: (kind, partition) ->
#: (the next offset it will read, the partition's end offset as last known; -1: unknown)
Reads = Mapping[tuple[str, int], tuple[int, int]]
#: what the core sends to the findings topic: findings for fusion, and nodes' window
#: features for their job's river model (key ``anomaly:<job>``)
Outgoing: TypeAlias = Finding | WindowFeatures


@dataclass
class CoreCounters:
    """What a core did, for progress lines, benchmarks and ``/metrics``."""

    telemetry: int = 0  # records (a batch is one)
    samples: int = 0  # single samples, a batch counted by its entries
    findings: int = 0
    flags: int = 0
    dead_letters: int = 0
    kinds: Counter[str] = field(default_factory=Counter)  # valid records by kind
    flag_classes: Counter[tuple[str, str]] = field(default_factory=Counter)  # category, severity
    dead_reasons: Counter[str] = field(default_factory=Counter)  # the runner fills it

    def totals(self) -> dict[str, int]:
        """The running totals of a progress line."""
        return {
            "telemetry": self.telemetry,
            "samples": self.samples,
            "findings": self.findings,
            "flags": self.flags,
            "dead_letters": self.dead_letters,
        }


class PartStore(Protocol):
    """Live state objects per key, each with the partition it came from."""

    live: dict[str, tuple[Any, int]]

    def get(self, key: str, partition: int) -> Any: ...

    def checkpoint_due(self, keys: Iterable[str], force: bool = False) -> int: ...

    def forget(self, partitions: set[int]) -> list[str]: ...

    def expire(self, idle_s: float) -> list[str]: ...


#: (table name, factory of a key's cold state) -> the store of that table
StoreFactory = Callable[[str, Callable[[str], Any]], PartStore]


class MemoryStore:
    """A table in memory, never checkpointed (a backtest's)."""

    def __init__(self, table: str, make: Callable[[str], Any]) -> None:
        self.table = table
        self.make = make
        self.live: dict[str, tuple[Any, int]] = {}

    def get(self, key: str, partition: int) -> Any:
        entry = self.live.get(key)
        if entry is None or entry[1] != partition:
            entry = self.live[key] = (self.make(key), partition)
        return entry[0]

    def checkpoint_due(self, keys: Iterable[str], force: bool = False) -> int:
        return 0

    def forget(self, partitions: set[int]) -> list[str]:
        gone = [k for k, (_, p) in self.live.items() if p in partitions]
        for key in gone:
            del self.live[key]
        return gone

    def expire(self, idle_s: float) -> list[str]:
        return []


@dataclass
class CoreOutput:
    """What one :meth:`DetectionCore.step` made."""

    findings: list[Outgoing] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    bad: list[tuple[int, SchemaError]] = field(default_factory=list)
    bad_findings: list[tuple[int, SchemaError]] = field(default_factory=list)


class _KeyClock:
    """Event time of each key of one table: newest seen, when (runner's clock), last tick;
    and (the node table's) newest of each telemetry kind of the key, whose topics are
    consumed at their own paces."""

    __slots__ = ("fused_at", "fused_to", "in_flight", "kinds", "last_tick", "newest", "seen_at")

    def __init__(self) -> None:
        self.newest: dict[str, float] = {}
        self.seen_at: dict[str, float] = {}
        self.last_tick: dict[str, float] = {}
        self.kinds: dict[str, dict[str, float]] = {}
        #: a node's findings sent to the findings topic and not yet fused here
        self.in_flight: dict[str, int] = {}
        #: the node's event time when none of its findings was last in flight, and when
        #: (runner's clock) that time was last seen to advance
        self.fused_to: dict[str, float] = {}
        self.fused_at: dict[str, float] = {}

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.newest.pop(key, None)
            self.seen_at.pop(key, None)
            self.last_tick.pop(key, None)
            self.in_flight.pop(key, None)
            self.fused_to.pop(key, None)
            self.fused_at.pop(key, None)
            for newest in self.kinds.values():
                newest.pop(key, None)

    def behind(self, key: str) -> float | None:
        """The event time every telemetry kind of ``key`` seen here has reached (the
        slowest kind's newest); None if none was seen."""
        times = [newest[key] for newest in self.kinds.values() if key in newest]
        return min(times) if times else None

    def sent(self, found: Iterable[Outgoing]) -> None:
        """Count the node findings a step sends to the findings topic."""
        in_flight = self.in_flight
        for f in found:
            if isinstance(f, Finding) and f.node is not None:
                in_flight[f.node] = in_flight.get(f.node, 0) + 1

    def fused(self, key: str) -> None:
        """One finding of node ``key`` came back off the findings topic (one sent by
        another worker, or anyone, can only make the count reach 0 early)."""
        left = self.in_flight.get(key, 0) - 1
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)

    def fused_through(self, key: str, wall: float) -> tuple[float | None, float]:
        """The event time through which node ``key``'s own telemetry has been read here
        *and* the findings it made have been fused (none in flight on the findings topic,
        whose round trip a job finding fused meanwhile must not overtake; None: no
        telemetry of the node here, -inf: its findings have been in flight ever since), and
        when, on the runner's clock, that time was last seen to advance (-inf: never)."""
        now = self.behind(key)
        if now is None:
            return None, -math.inf
        if key not in self.in_flight:
            if now > self.fused_to.get(key, -math.inf):
                self.fused_at[key] = wall
            self.fused_to[key] = now
        return self.fused_to.get(key, -math.inf), self.fused_at.get(key, -math.inf)


#: The longest a job finding waits for its node's partitions to be read up to where they
#: stood when it came (seconds of the runner's clock): a bound for a runner that never catches up.
READ_MAX_S = 600.0


class _ReadBarriers:
    """How far a live runner has read each node-telemetry partition, and the read barrier of
    each node with a job finding waiting: the end offsets its partitions had when the finding
    came. Until the runner has read up to them, the node's stream is *behind*, not quiet: the
    telemetry that may explain the finding is on the broker, unread (behind a flood of dead
    letters, or a partition of the other kind consumed faster), and fusion waits for it however
    long that takes (up to :data:`READ_MAX_S`). A partition whose reading position the runner
    has not told (nothing read of it, and no start given when it was assigned) bars nothing."""

    __slots__ = ("barriers", "cleared", "end", "position")

    def __init__(self) -> None:
        self.position: dict[tuple[str, int], int] = {}
        self.end: dict[tuple[str, int], int] = {}
        #: node -> (when its barrier was set, [((kind, partition), end offset to read to)])
        self.barriers: dict[str, tuple[float, list[tuple[tuple[str, int], int]]]] = {}
        #: node -> when its last barrier was read through (runner's clock)
        self.cleared: dict[str, float] = {}

    def update(self, reads: Reads) -> None:
        for tp, (position, end) in reads.items():
            self.position[tp] = position
            if end >= 0:
                self.end[tp] = end

    def unread(self, partition: int) -> bool:
        """Whether a node-telemetry partition numbered ``partition`` has records unread."""
        for kind in NODE_KINDS:
            read = self.position.get((kind, partition))
            if read is not None and read < self.end.get((kind, partition), -1):
                return True
        return False

    def hold(self, key: str, partition: int, wall: float) -> None:
        """Node ``key`` (of ``partition``) got a finding to wait for it: bar its stream at
        the end offsets its partitions have now (those it has not been read up to)."""
        since, old = self.barriers.get(key, (wall, []))
        targets = dict(old)
        for kind in NODE_KINDS:
            tp = (kind, partition)
            end, read = self.end.get(tp, -1), self.position.get(tp)
            if read is not None and end > read:
                targets[tp] = max(end, targets.get(tp, end))
        if targets:
            self.barriers[key] = (since, list(targets.items()))

    def behind(self, key: str, wall: float) -> tuple[bool, float]:
        """Whether node ``key``'s partitions are still unread up to its barrier; and since
        when (runner's clock) they are not (-inf: never barred)."""
        barrier = self.barriers.get(key)
        if barrier is not None:
            since, targets = barrier
            read = self.position
            if wall - since < READ_MAX_S and any(read.get(tp, end) < end for tp, end in targets):
                return True, since
            del self.barriers[key]
            self.cleared[key] = wall
        return False, self.cleared.get(key, -math.inf)

    def forget(self, keys: Iterable[str], partitions: Iterable[int] = ()) -> None:
        for key in keys:
            self.barriers.pop(key, None)
            self.cleared.pop(key, None)
        gone = set(partitions)
        for table in (self.position, self.end):
            for tp in [tp for tp in table if tp[1] in gone]:
                del table[tp]


@dataclass
class _Gathered:
    """A step's records of one columnar kind, by node (:meth:`DetectionCore._gather`)."""

    nodes: list[NodeDetectors]
    owner: list[int]
    partitions: list[int]
    records: list[tuple[dict[str, Any], list[dict[str, Any]]]]


class DetectionCore:
    """The detection state of a runner's partitions, and the one verb that moves it."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        stores: StoreFactory | None = None,
        counters: CoreCounters | None = None,
        idle_after_s: float = 2.0,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        make = stores or MemoryStore
        self.nodes = make("node-detectors", self._make_node)
        self.jobs = make("job-detectors", partial(_make_job, cfg))
        self.fusion = make("fusion", partial(_make_fusion, cfg))
        self.counters = counters or CoreCounters()
        self.idle_after_s = idle_after_s
        self.tick_s = cfg.tick_s
        self.fabric = cfg.fabric and cfg.node_telemetry
        self.clocks = {"node": _KeyClock(), "job": _KeyClock()}
        self.reads = _ReadBarriers()
        #: fusion keys with job findings waiting for their node's stream (NodeFusion.wait)
        self._waiting: set[str] = set()
        #: the step's records of each columnar kind: (their key's detectors, partition,
        #: common fields, entries)
        self._rows: dict[str, list[tuple[Any, int, Any, list[Any]]]] = {
            kind: [] for kind in _COLUMN_KINDS
        }

    def _make_node(self, key: str) -> Any:
        if key.startswith(FABRIC_KEY):
            return fabric_detector(self.config)
        return NodeDetectors(key, self.config)

    # -- the verb --------------------------------------------------------------------------

    def step(
        self,
        telemetry: Iterable[TelemetryRecord] = (),
        findings: Iterable[FindingRecordIn] = (),
        wall: float = 0.0,
        reads: Reads | None = None,
    ) -> CoreOutput:
        """One batch: telemetry to the detectors, findings to fusion (see the module doc);
        ``reads``: a live runner's read offsets of its node-telemetry partitions, as of the
        end of this batch (fusion's wait, :class:`_ReadBarriers`)."""
        if reads:
            self.reads.update(reads)
        out = CoreOutput()
        out.flags, out.bad_findings, scored = self._fuse(findings, wall)
        out.findings, out.bad = self._detect(telemetry, wall)
        out.findings += scored
        self.clocks["node"].sent(out.findings)
        if self._waiting:
            out.flags += self._release(wall)
        return out

    def idle(self, wall: float) -> list[Finding]:
        """Time-driven checks of keys without input for ``idle_after_s`` on the runner's
        clock, at their event time plus that silence."""
        found: list[Finding] = []
        for level, store in (("node", self.nodes), ("job", self.jobs)):
            clock = self.clocks[level]
            for key, seen in list(clock.seen_at.items()):
                silent = wall - seen
                if silent >= self.idle_after_s and key in store.live:
                    found += self._tick(store, clock, key, clock.newest[key] + silent)
        self.counters.findings += len(found)
        self.clocks["node"].sent(found)
        return found

    def flush(self) -> list[Outgoing]:
        """End of input: what every key still has pending (the job models' windows still
        waiting are :meth:`flush_fusion`'s, once these reached them)."""
        found: list[Outgoing] = []
        for store in (self.nodes, self.jobs):
            for obj, _ in store.live.values():
                found += obj.flush()
        found += _windows(self.parts("nodes").values())
        self.counters.findings += len(found)
        return found

    def flush_fusion(self) -> list[Finding]:
        """End of input, after :meth:`flush`'s records were fused: the windows the jobs'
        river models still wait on."""
        found: list[Finding] = []
        for obj, _ in self.fusion.live.values():
            if isinstance(obj, GpuJobAnomaly):
                found += obj.flush()
        self.counters.findings += len(found)
        return found

    def forget(self, partitions: set[int]) -> None:
        """Checkpoint, then drop, the keys of ``partitions`` (they moved to another worker)."""
        for level, store in (("node", self.nodes), ("job", self.jobs)):
            self.clocks[level].forget(store.forget(partitions))
        self.reads.forget(self.fusion.forget(partitions), partitions)

    def expire(self, idle_s: float) -> int:
        """Drop keys idle for ``idle_s`` (the store says which); returns how many."""
        gone = 0
        for level, store in (("node", self.nodes), ("job", self.jobs)):
            keys = store.expire(idle_s)
            self.clocks[level].forget(keys)
            gone += len(keys)
        fused = self.fusion.expire(idle_s)
        self.reads.forget(fused)
        return gone + len(fused)

    def parts(self, table: str) -> dict[str, Any]:
        """The live state objects of ``"nodes"``, ``"jobs"``, ``"fabric"`` or ``"fusion"``."""
        store = {"nodes": self.nodes, "fabric": self.nodes, "jobs": self.jobs}.get(table)
        if store is None:
            return {k: obj for k, (obj, _) in self.fusion.live.items()}
        fabric = table == "fabric"
        return {k: o for k, (o, _) in store.live.items() if k.startswith(FABRIC_KEY) == fabric}

    def state_bytes(self) -> dict[str, int]:
        """Pickled size of each table's state (and the fabric's apart), for the state budget."""

        def size(objs: dict[str, Any]) -> int:
            return sum(len(pickle.dumps(o, pickle.HIGHEST_PROTOCOL)) for o in objs.values())

        return {table: size(self.parts(table)) for table in ("nodes", "jobs", "fusion", "fabric")}

    # -- detection -------------------------------------------------------------------------

    def _detect(
        self, records: Iterable[TelemetryRecord], wall: float
    ) -> tuple[list[Outgoing], list[tuple[int, SchemaError]]]:
        found: list[Outgoing] = []
        bad: list[tuple[int, SchemaError]] = []
        latest: dict[str, dict[str, float]] = {"node": {}, "job": {}}
        n = -1
        for n, (partition, kind, value) in enumerate(records):
            try:
                if type(value) is tuple:  # a record its runner decoded to fields already
                    record_kind, head, entries = value
                    self._add_rows(record_kind, head, entries, partition)
                elif (columns := _column_decoder(value, kind)) is not None:
                    record_kind, head, entries = columns(value, kind)
                    self._add_rows(record_kind, head, entries, partition)
                else:
                    record_kind, singles = _decode(value, kind)
                    self._route(singles, partition)
            except SchemaError as exc:
                bad.append((n, _detached(exc)))
                continue
            self.counters.kinds[record_kind] += 1
        if self._rows["gpu"]:
            found += self._gpus(latest["node"])
        if self._rows["nic"]:
            found += self._nics(latest["node"])
        if self._rows["step"] or self._rows["collective"]:
            found += self._jobs(latest["job"])
        counters = self.counters
        counters.telemetry += n + 1
        counters.dead_letters += len(bad)
        for level, store in (("node", self.nodes), ("job", self.jobs)):
            newest = latest[level]
            if newest:
                store.checkpoint_due(newest)
                found += self._advance(store, self.clocks[level], newest, wall)
        fusion = self.fusion.live
        for key in latest["node"]:  # a fusion state restored with findings still waiting
            entry = fusion.get(key)
            if entry is not None and getattr(entry[0], "waiting", None):
                self._waiting.add(key)
        counters.findings += len(found)
        return found, bad

    def _route(self, singles: Sequence[GuardMessage], partition: int) -> None:
        """One record's samples decoded already (a backtest's; a batch's share its node and
        job), to the step's columns; other kinds are not telemetry and are dropped."""
        kind = singles[0].kind
        if kind in _COLUMN_KINDS:
            entries = [s.__dict__ for s in singles] if kind == "nic" else structs_of(singles)
            self._add_rows(kind, entries[0], entries, partition)

    def _add_rows(self, record_kind: str, head: Any, entries: list[Any], partition: int) -> None:
        """A record kept for the step's columns: a GPU, step or collective record (Structs:
        :func:`decode_structs`) or a NIC record (dicts: :func:`decode_rows`)."""
        self.counters.samples += len(entries)
        kind = record_kind.removesuffix("_batch")
        if kind in JOB_KINDS:
            self._rows[kind].append((self.jobs.get(head.job, partition), partition, head, entries))
            return
        if not self.config.node_telemetry:
            return
        node = head.node if kind == "gpu" else head["node"]
        self._rows[kind].append((self.nodes.get(node, partition), partition, head, entries))

    def _gather(self, kind: str) -> _Gathered:
        """The step's records of ``kind``: their nodes (each once), each sample's node (a
        position in that list) and partition."""
        pending, self._rows[kind] = self._rows[kind], []
        index: dict[int, int] = {}  # id of a node's detectors -> its position
        out = _Gathered([], [], [], [])
        for detectors, partition, head, entries in pending:
            k = index.get(id(detectors))
            if k is None:
                k = index[id(detectors)] = len(out.nodes)
                out.nodes.append(detectors)
            n = len(entries)
            out.owner += [k] * n
            out.partitions += [partition] * n
            out.records.append((head, entries))
        return out

    def _newest(
        self,
        latest: dict[str, float],
        kind: str,
        keys: Sequence[str],
        owner: np.ndarray,
        ts: np.ndarray,
    ) -> None:
        """Each key's newest event time, from the step's samples of ``kind`` (``owner``:
        their key); and the newest of that kind, which fusion's wait reads."""
        top = np.full(len(keys), -np.inf)
        np.maximum.at(top, owner, ts)
        of_kind = self.clocks["node"].kinds.setdefault(kind, {})
        for key, t in zip(keys, top.tolist(), strict=True):
            latest[key] = max(latest.get(key, 0.0), t)
            if t > of_kind.get(key, -np.inf):
                of_kind[key] = t

    def _gpus(self, latest: dict[str, float]) -> list[Outgoing]:
        """The step's GPU samples, every node's at once (:func:`~.gpu_step.update_gpus`),
        and the windows they closed for the jobs' river models."""
        got = self._gather("gpu")
        owner = np.array(got.owner, dtype=np.intp)
        cols = GpuColumns.of_structs(got.records)
        self._newest(latest, "gpu", [d.node for d in got.nodes], owner, cols.ts)
        found: list[Outgoing] = []
        found += update_gpus(got.nodes, owner, cols)
        return found + _windows(got.nodes)

    def _jobs(self, latest: dict[str, float]) -> list[Finding]:
        """The step's step and collective records, each job's as columns (steps first: C4D
        groups a collective's ranks by the stages the steps report)."""
        found: list[Finding] = []
        for job, (detectors, records) in self._by_job("step").items():
            steps = StepColumns.of_records(records)
            found += detectors.add_steps(steps)
            latest[job] = max(latest.get(job, 0.0), float(steps.ts.max()))
        for job, (detectors, records) in self._by_job("collective").items():
            ops = CollectiveColumns.of_records(records)
            found += detectors.add_collectives(ops)
            latest[job] = max(latest.get(job, 0.0), float(ops.ts.max()))
        return found

    def _by_job(self, kind: str) -> dict[str, tuple[JobDetectors, list[tuple[Any, list[Any]]]]]:
        """The step's records of ``kind`` by job, in the order they came."""
        pending, self._rows[kind] = self._rows[kind], []
        by_job: dict[str, tuple[JobDetectors, list[tuple[Any, list[Any]]]]] = {}
        for detectors, _, head, entries in pending:
            got = by_job.get(head.job)
            if got is None:
                got = by_job[head.job] = (detectors, [])
            got[1].append((head, entries))
        return by_job

    def _nics(self, latest: dict[str, float]) -> list[Outgoing]:
        """The step's NIC samples, every node's at once (:func:`~.nic.update_nics`), then
        the fabric detector of each partition with the increases they added; the river
        feed's windows that the NIC samples made ready."""
        got = self._gather("nic")
        owner = np.array(got.owner, dtype=np.intp)
        cols = NicColumns.of_records(got.records)
        self._newest(latest, "nic", [d.node for d in got.nodes], owner, cols.ts)
        nic_found, inc = update_nics([d.nic for d in got.nodes], owner, cols)
        found: list[Outgoing] = list(nic_found)
        _nic_windows(got.nodes, owner, cols.ts, inc)
        if self.fabric:
            found += self._fabric(cols, inc, np.array(got.partitions), latest)
        return found + _windows(got.nodes)

    def _fabric(
        self, cols: NicColumns, inc: NicIncreases, partitions: np.ndarray, latest: dict[str, float]
    ) -> list[Finding]:
        """NIC samples to their partition's fabric detector, with the increases their node's
        NIC detector read from them."""
        found: list[Finding] = []
        for partition in np.unique(partitions).tolist():
            at = np.flatnonzero(partitions == partition)
            key = f"{FABRIC_KEY}{partition}"
            detector = self.nodes.get(key, partition)
            if detector.topology is None:  # not pickled with it: a restored one gets it back
                detector.topology = self.config.topology
            part = cols.take(at) if len(at) < len(cols) else cols
            found += detector.add_columns(
                part.node,
                part.device,
                part.job,
                part.ts,
                inc.valid[at],
                inc.wait[at],
                inc.marks[at],
                inc.ports[at],
            )
            latest[key] = max(latest.get(key, 0.0), float(part.ts.max()))
        return found

    def _advance(
        self, store: PartStore, clock: _KeyClock, latest: dict[str, float], wall: float
    ) -> list[Finding]:
        """Move each key's event time to the newest it saw; tick those due."""
        found: list[Finding] = []
        for key, ts in latest.items():
            if ts <= clock.newest.get(key, 0.0):
                continue
            clock.newest[key] = ts
            clock.seen_at[key] = wall
            if ts - clock.last_tick.get(key, 0.0) >= self.tick_s:
                found += self._tick(store, clock, key, ts)
        return found

    def _release(self, wall: float, every: bool = False) -> list[Flag]:
        """The flags of job findings whose node's stream caught up (or that waited long
        enough, or ``every``: all of them), see :meth:`NodeFusion.wait`."""
        flags: list[Flag] = []
        clock = self.clocks["node"]
        for key in sorted(self._waiting):
            entry = self.fusion.live.get(key)
            if entry is not None:
                behind, read_at = self.reads.behind(key, wall)
                flags += entry[0].release(
                    *clock.fused_through(key, wall), wall, every, behind, read_at
                )
                if entry[0].waiting:
                    continue
            self._waiting.discard(key)
        if flags:
            self.fusion.checkpoint_due({f.node for f in flags if f.node is not None})
            self.counters.flags += len(flags)
            self.counters.flag_classes.update((f.category, f.severity) for f in flags)
        return flags

    def release_waiting(self, wall: float) -> list[Flag]:
        """End of input: the flags of every job finding still waiting for its node."""
        return self._release(wall, every=True)

    def _node_time(self, key: str, partition: int, wall: float) -> float | None:
        """The event time node ``key``'s stream has reached for fusion (``fused_through``);
        -inf for a node with no telemetry read here yet while its partitions hold records
        unread (it may be behind them, not absent)."""
        t = self.clocks["node"].fused_through(key, wall)[0]
        return -math.inf if t is None and self.reads.unread(partition) else t

    @staticmethod
    def _tick(store: PartStore, clock: _KeyClock, key: str, now: float) -> list[Finding]:
        clock.last_tick[key] = now
        entry = store.live.get(key)
        return entry[0].tick(now) if entry is not None else []

    # -- fusion ----------------------------------------------------------------------------

    def _fuse(
        self, records: Iterable[FindingRecordIn], wall: float
    ) -> tuple[list[Flag], list[tuple[int, SchemaError]], list[Finding]]:
        """Records off the findings topic, in event-time order, through their key's state:
        findings through fusion (flags), window features through their job's river model
        (findings, for the findings topic)."""
        decoded: list[tuple[Finding | WindowFeatures, str, int]] = []
        bad: list[tuple[int, SchemaError]] = []
        for n, (partition, raw_key, value) in enumerate(records):
            try:
                key = raw_key.decode()
                decoded.append((_decode_fusion_record(value, key), key, partition))
            except (SchemaError, UnicodeDecodeError) as exc:
                error = exc if isinstance(exc, SchemaError) else SchemaError(str(exc))
                bad.append((n, _detached(error)))
        decoded.sort(key=lambda item: item[0].ts)
        flags: list[Flag] = []
        scored: list[Finding] = []
        node_clock = self.clocks["node"]
        for record, key, _ in decoded:  # back off the topic: no longer in flight
            if isinstance(record, Finding) and record.node == key:
                node_clock.fused(key)
        for record, key, partition in decoded:
            state = self.fusion.get(key, partition)
            if isinstance(record, WindowFeatures):
                scored += state.add(
                    record.node, record.ts, record.window, record.gpus, record.features
                )
            elif isinstance(state, NodeFusion) and state.wait(
                record, self._node_time(key, partition, wall), wall
            ):
                self._waiting.add(key)
                if record.category in EXPLAINABLE:  # not a node finding queued behind one
                    self.reads.hold(key, partition, wall)
            elif (flag := state.update(record)) is not None:
                flags.append(flag)
        if decoded:
            self.fusion.checkpoint_due({key for _, key, _ in decoded})
        counters = self.counters
        counters.flags += len(flags)
        counters.flag_classes.update((f.category, f.severity) for f in flags)
        counters.dead_letters += len(bad)
        counters.findings += len(scored)
        return flags, bad, scored


#: kinds whose records the core decodes straight into columns (:func:`decode_structs`,
#: :func:`decode_rows`)
_COLUMN_KINDS = frozenset({"gpu", "nic", "step", "collective"})
_COLUMN_DECODERS: dict[str | bytes, Callable[[bytes, str | None], Rows]] = {
    **{k: decode_structs for k in ("gpu", "step", "collective")},
    **{
        f"{k}{b}".encode(): decode_structs
        for k in ("gpu", "step", "collective")
        for b in ("", "_batch")
    },
    "nic": decode_rows,
    b"nic": decode_rows,
    b"nic_batch": decode_rows,
}


def _detached(error: SchemaError) -> SchemaError:
    """``error`` without its traceback and context, to be kept in a batch's output. With them
    it would hold the frames that raised it, and through them the batch and the list it is
    in: a reference cycle per batch with a bad record, left to the cyclic collector (which the
    workers run seldom: a flood of bad records held ~1 GB)."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error


def _column_decoder(value: Any, kind: str | None) -> Callable[[bytes, str | None], Rows] | None:
    """The decoder of a record for the columns: bytes of a column kind's topic, or a line
    naming one (None: not such a record)."""
    if type(value) is not bytes:
        return None
    return _COLUMN_DECODERS.get(kind if kind is not None else leading_kind(value) or b"")


def _decode(value: Any, kind: str | None) -> tuple[str, Sequence[GuardMessage]]:
    """A telemetry record's kind and samples; ``kind`` None: any kind (a line of a file).
    A record its runner decoded already (a backtest that merged files) is its samples."""
    if isinstance(value, list) or kind is None:
        singles = value if isinstance(value, list) else parse_samples(value or b"")
        if not singles:
            raise SchemaError("not a telemetry record", kind=None)
        first = singles[0].kind
        return (first if len(singles) == 1 else f"{first}_batch"), singles
    found: tuple[str, Sequence[GuardMessage]] = decode_samples(value or b"", kind)
    return found


def _make_job(config: EngineConfig, key: str) -> JobDetectors:
    return JobDetectors(key, config)


def _make_fusion(config: EngineConfig, key: str) -> NodeFusion | JobFusion | GpuJobAnomaly:
    if key.startswith(ANOMALY_KEY):
        args = config.detector_args.get("peer_anomaly", {})
        return GpuJobAnomaly(key[len(ANOMALY_KEY) :], **args)  # type: ignore[arg-type]
    return JobFusion(key[4:]) if key.startswith("job:") else NodeFusion(key)


#: Key prefix of a job's river model over its nodes' GPU windows, in the fusion table.
ANOMALY_KEY = "anomaly:"


def _nic_windows(
    nodes: Sequence[NodeDetectors], owner: np.ndarray, ts: np.ndarray, inc: NicIncreases
) -> None:
    """The step's NIC samples to their nodes' river feeds: each sample's port, time and
    errors per second, where it had an interval."""
    if all(det.anomaly is None for det in nodes):
        return
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(len(nodes) + 1))
    for k, det in enumerate(nodes):
        mine = order[bounds[k] : bounds[k + 1]]
        if det.anomaly is not None and len(mine):
            det.anomaly.add_nic(inc.local[mine], ts[mine], inc.errors[mine], inc.valid[mine])


def _windows(nodes: Iterable[NodeDetectors]) -> list[Outgoing]:
    """The windows ``nodes`` closed, as records for their jobs' river models."""
    out: list[Outgoing] = []
    for det in nodes:
        feed = det.anomaly
        if feed is not None and feed.closed:
            for ts, window, job, gpus, features in feed.closed:
                out.append(
                    WindowFeatures(
                        ts=ts,
                        node=det.node,
                        job=job,
                        window=window,
                        window_s=feed.window_s,
                        gpus=gpus,
                        features=features,
                    )
                )
            feed.closed = []
    return out


def _decode_fusion_record(raw: bytes, key: str) -> Finding | WindowFeatures:
    """A record of the findings topic: a finding (key: a node, or ``job:<id>``), or a node's
    window features (key ``anomaly:<job>``, its job); anything else is a SchemaError."""
    if key.startswith(ANOMALY_KEY):
        features = decode(raw, "window_features")
        if key != ANOMALY_KEY + features.job:
            raise SchemaError(f"window_features of job {features.job!r} under key {key!r}")
        return features
    return decode_finding(raw)


def finding_key(finding: Outgoing) -> str:
    """Findings are repartitioned by the node they are about (``job:<id>`` for job-level);
    a node's window features by their job (``anomaly:<job>``)."""
    if isinstance(finding, WindowFeatures):
        job: str = finding.job
        return ANOMALY_KEY + job
    return finding.node if finding.node is not None else f"job:{finding.job or ''}"


#: the fields a finding and its record share (all of the finding's)
_FINDING_FIELDS = tuple(f.name for f in fields(Finding))


def encode_finding(finding: Outgoing) -> bytes:
    """The record of ``finding`` on the findings topic (the ``finding`` kind of the schema,
    or ``window_features``)."""
    if isinstance(finding, WindowFeatures):
        features: bytes = encode(finding)
        return features
    record = FindingRecord(**{name: getattr(finding, name) for name in _FINDING_FIELDS})
    raw: bytes = encode(record)
    return raw


def encode_findings(findings: Iterable[Outgoing], partition: int = 0) -> list[FindingRecordIn]:
    """``findings`` as records of the findings topic (what a backtest hands to fusion)."""
    return [(partition, finding_key(f).encode(), encode_finding(f)) for f in findings]


def decode_finding(raw: bytes) -> Finding:
    """A finding off the findings topic, which anyone who can produce can write to: anything
    but a valid ``finding`` record is a :class:`~guard.schemas.SchemaError`."""
    record = decode(raw, "finding")
    return Finding(**{name: getattr(record, name) for name in _FINDING_FIELDS})


class MessageFeed:
    """Decoded messages through a :class:`DetectionCore`, ``step_s`` of event time a step.

    What tests, benchmarks and ``guard backtest`` use to run the core over messages in
    event-time order: ``update(message)`` returns the flags of the steps it completed,
    ``flush()`` those of the rest. The runner's clock is the messages' event-time watermark
    (a live run at real-time pace); each step's findings are fused at once, as a worker's
    come back from the findings topic. A step of 10 s (at most ``max_records`` records) is
    what a worker's poll holds when it catches up; the flags are the same as with 1 s steps
    (the regression fixture and ``benchmarks/detection_quality.py``, line for line), and
    the core's per-step work is spread over ten times the records.

    >>> from guard.schemas import GpuSample
    >>> feed = MessageFeed()
    >>> flags = [f for t in range(6) for g in range(8) for f in feed.update(GpuSample(
    ...     ts=100.0 + 10 * t, node="n1", gpu=g, xid=48 if (g == 3 and t == 2) else None))]
    >>> [(f.gpu, f.category) for f in flags + feed.flush()]
    [(3, 'gpu_error')]
    """

    def __init__(
        self, config: EngineConfig | None = None, step_s: float = 10.0, max_records: int = 4096
    ) -> None:
        self.core = DetectionCore(config)
        self.step_s = step_s
        self.max_records = max_records
        self.batch: list[TelemetryRecord] = []
        self.batch_start = 0.0
        self.watermark = 0.0
        self.last_idle = 0.0

    @property
    def nodes(self) -> dict[str, NodeDetectors]:
        return self.core.parts("nodes")

    @property
    def jobs(self) -> dict[str, JobDetectors]:
        return self.core.parts("jobs")

    @property
    def fabric(self) -> Any:
        """The fabric detector (None: off, or no NIC sample yet and fabric off)."""
        found = self.core.parts("fabric")
        if found:
            return next(iter(found.values()))
        return fabric_detector(self.core.config) if self.core.fabric else None

    def node(self, key: str) -> NodeDetectors:
        return self.core.nodes.get(key, 0)  # type: ignore[no-any-return]

    def job(self, key: str) -> JobDetectors:
        return self.core.jobs.get(key, 0)  # type: ignore[no-any-return]

    def state_bytes(self) -> dict[str, int]:
        return self.core.state_bytes()

    def update(self, message: GuardMessage | Rows) -> list[Flag]:
        """Add one message (a single sample), or a GPU or NIC record decoded to its fields
        (:func:`~guard.schemas.sample_decoder.decode_rows`: what ``guard backtest`` reads
        those as); the flags of the step it closed, if any."""
        if type(message) is tuple:
            _, head, entries = message
            ts = record_ts(head) or 0.0
            # an entry's own time, where it has one (None or absent: the record's)
            stamps = (
                [e.get("ts") for e in entries] if type(head) is dict else [e.ts for e in entries]
            )
            newest = max(ts, max(filter(None, stamps), default=0.0))
            return self._add(ts, newest, message)
        return self.add([message])

    def add(self, samples: list[GuardMessage]) -> list[Flag]:
        """Add one record's samples (a batch's share their node and job)."""
        return self._add(samples[0].ts, max(s.ts for s in samples), samples)

    def _add(self, ts: float, newest: float, record: Any) -> list[Flag]:
        flags: list[Flag] = []
        full = len(self.batch) >= self.max_records
        if self.batch and (full or ts >= self.batch_start + self.step_s):
            flags = self._step()
        if not self.batch:
            self.batch_start = ts
        self.batch.append((0, None, record))
        self.watermark = max(self.watermark, newest)
        return flags

    def flush(self) -> list[Flag]:
        """End of input: the last step, then what every key still has pending."""
        flags = self._step() if self.batch else []
        flags += self._fuse(self.core.flush())
        flags += self._fuse(self.core.flush_fusion())
        return flags + self.core.release_waiting(self.watermark)

    def _step(self) -> list[Flag]:
        core, wall = self.core, self.watermark
        out = core.step(self.batch, (), wall)  # its flags: findings that waited for a node
        found = out.findings
        self.batch = []
        if wall - self.last_idle >= 1.0:
            self.last_idle = wall
            found += core.idle(wall)
        return out.flags + self._fuse(found)

    def _fuse(self, found: Sequence[Outgoing]) -> list[Flag]:
        """``found`` through the findings topic's path, and what that finds in turn (the
        jobs' river models' findings), until nothing is left."""
        flags: list[Flag] = []
        while found:
            out = self.core.step((), encode_findings(found), self.watermark)
            flags += out.flags
            found = out.findings
        return flags

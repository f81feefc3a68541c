"""The faust app: Guard's detectors as stream processors.

Three agents, each a thin loop over a stream that calls into ``guard.detectors``:

* ``node_telemetry`` — ``guard.gpu`` + ``guard.nic`` (key = node): per-node detectors
  (:class:`~guard.detectors.engine.NodeDetectors`).
* ``job_telemetry`` — ``guard.steps`` + ``guard.collectives`` (key = job): per-job peer
  comparisons (:class:`~guard.detectors.engine.JobDetectors`).
* ``fusion`` — the internal ``guard.findings`` topic, repartitioned by the node a finding
  is about (a straggler found by a job's detectors is fused with that node's own thermal
  or NIC findings): one suspicion per node → :class:`~guard.schemas.Flag` on
  ``guard.remediation``.

Detector state lives in memory and is checkpointed per key, every ``checkpoint_s`` seconds,
into faust tables backed by changelog topics: a restarted or rebalanced worker resumes from
the last checkpoint instead of a cold start. A malformed record goes to ``guard.dlq`` with
the reason; the worker carries on. Time-driven checks (hangs, lost GPUs) run on event time;
when input stops, a timer advances event time with the wall clock.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import faust
import orjson

from guard.config import Settings
from guard.detectors.engine import EngineConfig, JobDetectors, NodeDetectors
from guard.detectors.findings import Finding
from guard.detectors.fusion import JobFusion, NodeFusion
from guard.kafka import DLQ_ERROR_HEADER, DLQ_SOURCE_HEADER
from guard.schemas import Flag, SchemaError, decode, encode

__all__ = ["StreamsCounters", "create_app"]

log = logging.getLogger("guard.streams")


class StreamsCounters:
    """What a worker did, for progress lines and benchmarks."""

    def __init__(self) -> None:
        self.telemetry = 0
        self.findings = 0
        self.flags = 0
        self.dead_letters = 0
        self.restored = 0


class KeyedState:
    """Live detector objects per key, checkpointed into a faust table every ``every_s``."""

    def __init__(self, table: Any, make: Callable[[str], Any], every_s: float) -> None:
        self.table = table
        self.make = make
        self.every_s = every_s
        self.live: dict[str, tuple[Any, int]] = {}  # key -> (object, partition)
        self.saved_at: dict[str, float] = {}
        self.restored = 0

    def get(self, key: str, partition: int) -> Any:
        entry = self.live.get(key)
        if entry is not None and entry[1] == partition:
            return entry[0]
        blob = self.table.get(key)
        if blob is not None:
            obj = pickle.loads(blob)
            self.restored += 1
        else:
            obj = self.make(key)
        self.live[key] = (obj, partition)
        self.saved_at[key] = time.monotonic()
        return obj

    def maybe_checkpoint(self, key: str) -> None:
        """Write the key's state to the table and its changelog if it is due."""
        now = time.monotonic()
        if now - self.saved_at.get(key, 0.0) >= self.every_s:
            obj, partition = self.live[key]
            blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            # Batched processing has no current event: write the store and the changelog
            # partition (the key's partition) directly.
            self.table.data[key] = blob
            self.table.send_changelog(partition, key, blob)
            self.saved_at[key] = now

    def forget(self, partitions: set[int]) -> None:
        for key in [k for k, (_, p) in self.live.items() if p in partitions]:
            del self.live[key]
            self.saved_at.pop(key, None)


class EventClock:
    """One agent's event time: drives the time-based checks (hangs, lost GPUs) of its keys.

    When the agent's input stops for a while, event time follows the wall clock, so that a
    job that stopped sending (a hang) is still noticed.
    """

    def __init__(self, state: KeyedState, tick_s: float, emit: Callable[[list[Finding]], Any]):
        self.state = state
        self.tick_s = tick_s
        self.emit = emit
        self.watermark = 0.0
        self.last_tick = 0.0
        self.wall = time.monotonic()

    async def advance(self, ts: float) -> None:
        if ts > self.watermark:
            self.watermark = ts
            self.wall = time.monotonic()
            if ts - self.last_tick >= self.tick_s:
                await self.tick(ts)

    async def idle(self, after_s: float = 2.0) -> None:
        idle = time.monotonic() - self.wall
        if self.watermark and idle >= after_s:
            await self.tick(self.watermark + idle)

    async def tick(self, now: float) -> None:
        self.last_tick = now
        found: list[Finding] = []
        for obj, _ in list(self.state.live.values()):
            found += obj.tick(now)
        if found:
            await self.emit(found)


def encode_finding(finding: Finding) -> bytes:
    return orjson.dumps(asdict(finding))


def decode_finding(raw: bytes) -> Finding:
    return Finding(**orjson.loads(raw))


def create_app(settings: Settings, engine_config: EngineConfig | None = None) -> faust.App:
    """The streams app for ``settings`` (broker, topics, partitions, app id)."""
    cfg = engine_config or EngineConfig()
    k = settings.kafka
    streams = settings.streams
    datadir = settings.home / "faust" / streams.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        streams.app_id,
        broker=[f"kafka://{b.strip()}" for b in k.bootstrap.split(",")],
        store="memory://",
        topic_partitions=k.telemetry_partitions,
        topic_replication_factor=k.replication_factor,
        broker_session_timeout=k.session_timeout_ms / 1000,
        broker_heartbeat_interval=max(0.5, k.session_timeout_ms / 4000),
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        datadir=str(datadir),
        table_cleanup_interval=30.0,
        producer_compression_type="gzip",
        broker_max_poll_records=5000,
        stream_buffer_maxsize=20000,
        broker_commit_every=20000,
        consumer_max_fetch_size=16 * 1024 * 1024,
        logging_config=None,
    )
    raw = {
        "key_type": bytes,
        "value_type": bytes,
        "key_serializer": "raw",
        "value_serializer": "raw",
    }
    node_topic = app.topic(settings.topic("gpu"), settings.topic("nic"), **raw)
    job_topic = app.topic(settings.topic("steps"), settings.topic("collectives"), **raw)
    findings_topic = app.topic(
        settings.topic("findings"), partitions=k.telemetry_partitions, internal=True, **raw
    )
    remediation = app.topic(settings.topic("remediation"), **raw)
    dlq = app.topic(settings.topic("dlq"), **raw)
    kind_of = {
        settings.topic("gpu"): "gpu",
        settings.topic("nic"): "nic",
        settings.topic("steps"): "step",
        settings.topic("collectives"): "collective",
    }
    table_args = {
        "default": None,
        "schema": faust.Schema(
            key_type=str, value_type=bytes, key_serializer="raw", value_serializer="raw"
        ),
        "partitions": k.telemetry_partitions,
    }
    node_state = KeyedState(
        app.Table("node-detectors", **table_args),
        lambda key: NodeDetectors(key, cfg),
        streams.checkpoint_s,
    )
    job_state = KeyedState(
        app.Table("job-detectors", **table_args),
        lambda key: JobDetectors(key, cfg),
        streams.checkpoint_s,
    )
    fusion_state = KeyedState(
        app.Table("fusion", **table_args),
        lambda key: JobFusion(key[4:]) if key.startswith("job:") else NodeFusion(key),
        streams.checkpoint_s,
    )
    counters = StreamsCounters()
    app.guard_counters = counters  # type: ignore[attr-defined]

    async def send_findings(findings: list[Finding]) -> None:
        for f in findings:
            key = f.node if f.node is not None else f"job:{f.job or ''}"
            await findings_topic.send(key=key.encode(), value=encode_finding(f), timestamp=f.ts)
        counters.findings += len(findings)

    async def dead_letter(event: Any, error: Exception) -> None:
        msg = event.message
        counters.dead_letters += 1
        await dlq.send(
            key=event.key,
            value=event.value,
            headers=[
                (DLQ_ERROR_HEADER, str(error).encode()[:4096]),
                (DLQ_SOURCE_HEADER, f"{msg.topic}/{msg.partition}/{msg.offset}".encode()),
            ],
        )

    clocks: list[EventClock] = []

    def make_agent(topic: Any, state: KeyedState, key_of: Callable[[Any], str | None]) -> None:
        # Each agent keeps its own event time: node telemetry may run ahead of job telemetry
        # (separate topics, separate lags), and a job must only be judged on its own clock.
        clock = EventClock(state, cfg.tick_s, send_findings)
        clocks.append(clock)

        async def telemetry(stream: Any) -> None:
            # Batches keep faust's per-event cost off the hot path.
            async for events in stream.take_events(
                streams.batch_max, within=streams.batch_within_s
            ):
                counters.telemetry += len(events)
                found: list[Finding] = []
                touched: set[str] = set()
                latest = 0.0
                for event in events:
                    try:
                        message = decode(event.value, kind_of[event.message.topic])
                    except SchemaError as exc:
                        await dead_letter(event, exc)
                        continue
                    key = key_of(message)
                    if key is None:
                        continue
                    found += state.get(key, event.message.partition).process(message)
                    touched.add(key)
                    latest = max(latest, message.ts)
                if found:
                    await send_findings(found)
                for key in touched:
                    state.maybe_checkpoint(key)
                await clock.advance(latest)

        telemetry.__name__ = f"{topic.topics[0].rsplit('.', 1)[-1]}_telemetry"
        app.agent(topic, name=telemetry.__name__)(telemetry)

    make_agent(node_topic, node_state, lambda m: m.node)
    make_agent(job_topic, job_state, lambda m: m.job)

    @app.agent(findings_topic, name="fusion")
    async def fusion(stream: Any) -> None:
        async for event in stream.events():
            finding = decode_finding(event.value)
            key = event.key.decode()
            obj = fusion_state.get(key, event.message.partition)
            flag: Flag | None = obj.update(finding)
            if flag is not None:
                counters.flags += 1
                await remediation.send(key=flag.kafka_key(), value=encode(flag), timestamp=flag.ts)
            fusion_state.maybe_checkpoint(key)

    @app.timer(interval=1.0)
    async def idle_clock() -> None:
        for clock in clocks:
            await clock.idle()

    @app.on_partitions_revoked.connect
    async def on_revoked(app: Any, revoked: set[Any], **kwargs: Any) -> None:
        parts = {tp.partition for tp in revoked}
        for state in (node_state, job_state, fusion_state):
            state.forget(parts)

    def restored() -> int:
        return node_state.restored + job_state.restored + fusion_state.restored

    app.guard_restored = restored  # type: ignore[attr-defined]
    return app

"""The faust transport of ``guard streams``: Guard's detectors as faust agents.

Three agents, each a thin loop over a stream that hands batches to
:mod:`guard.streams.processing`:

* ``gpu_telemetry`` — ``guard.gpu`` + ``guard.nic`` (key = node): per-node detectors.
* ``steps_telemetry`` — ``guard.steps`` + ``guard.collectives`` (key = job): per-job peer
  comparisons.
* ``fusion`` — the internal ``guard.findings`` topic, repartitioned by the node a finding
  is about (a straggler found by a job's detectors meets that node's own thermal or NIC
  findings): one suspicion per node → :class:`~guard.schemas.Flag` on ``guard.remediation``.

Detector state lives in memory and is checkpointed per key every ``checkpoint_s`` seconds
into faust tables backed by changelog topics: a restarted or rebalanced worker resumes from
the last checkpoint instead of a cold start. A malformed record goes to ``guard.dlq`` with
the reason; the worker carries on.
"""

from __future__ import annotations

from typing import Any

import faust

from guard.config import Settings
from guard.detectors.engine import EngineConfig
from guard.detectors.findings import Finding
from guard.kafka import DLQ_ERROR_HEADER, DLQ_SOURCE_HEADER
from guard.schemas import SchemaError, encode

from .processing import (
    FusionProcessor,
    KeyedState,
    StreamsCounters,
    TelemetryProcessor,
    encode_finding,
    finding_key,
)

__all__ = ["create_app"]


def _backed_by(state: KeyedState, table: Any) -> None:
    # Keys and values are bytes end to end (key_type = value_type = bytes: raw serializers).
    # faust derives a table's changelog serializers from those types, not from a schema, and
    # falls back on json: with str keys the checkpoints were written raw but read back as
    # json, so recovery failed and a rebalanced worker hung in it.
    state.load = lambda key: table.get(key.encode())

    def save(key: str, partition: int, blob: bytes) -> None:
        # Batches have no current event: write the store and the key's changelog partition.
        raw = key.encode()
        table.data[raw] = blob
        table.send_changelog(partition, raw, blob)

    state.save = save


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
    findings_topic = app.topic(
        settings.topic("findings"), partitions=k.telemetry_partitions, internal=True, **raw
    )
    remediation = app.topic(settings.topic("remediation"), **raw)
    dlq = app.topic(settings.topic("dlq"), **raw)
    table_args = {
        "default": None,
        "key_type": bytes,
        "value_type": bytes,
        "partitions": k.telemetry_partitions,
    }
    counters = StreamsCounters()
    app.guard_counters = counters  # type: ignore[attr-defined]
    processors: list[TelemetryProcessor] = []

    async def send_findings(findings: list[Finding]) -> None:
        for f in findings:
            await findings_topic.send(
                key=finding_key(f).encode(), value=encode_finding(f), timestamp=f.ts
            )

    async def dead_letter(event: Any, error: SchemaError) -> None:
        msg = event.message
        await dlq.send(
            key=event.key,
            value=event.value,
            headers=[
                (DLQ_ERROR_HEADER, str(error).encode()[:4096]),
                (DLQ_SOURCE_HEADER, f"{msg.topic}/{msg.partition}/{msg.offset}".encode()),
            ],
        )

    def telemetry_agent(level: str, topics: dict[str, str], table: str) -> None:
        processor = TelemetryProcessor(level, topics, cfg, streams.checkpoint_s, counters)
        _backed_by(processor.state, app.Table(table, **table_args))
        processors.append(processor)

        async def agent(stream: Any) -> None:
            async for events in stream.take_events(streams.batch_max, streams.batch_within_s):
                found, bad = processor.process(
                    (e.message.topic, e.message.partition, e.value) for e in events
                )
                for index, error in bad:
                    await dead_letter(events[index], error)
                await send_findings(found)

        name = f"{level}_telemetry"
        app.agent(app.topic(*topics, **raw), name=name)(agent)

    telemetry_agent(
        "node", {settings.topic("gpu"): "gpu", settings.topic("nic"): "nic"}, "node-detectors"
    )
    telemetry_agent(
        "job",
        {settings.topic("steps"): "step", settings.topic("collectives"): "collective"},
        "job-detectors",
    )
    fusion_processor = FusionProcessor(streams.checkpoint_s, counters)
    _backed_by(fusion_processor.state, app.Table("fusion", **table_args))

    @app.agent(findings_topic, name="fusion")
    async def fusion(stream: Any) -> None:
        async for events in stream.take_events(streams.batch_max, streams.batch_within_s):
            flags = fusion_processor.process((e.key, e.message.partition, e.value) for e in events)
            for flag in flags:
                await remediation.send(key=flag.kafka_key(), value=encode(flag), timestamp=flag.ts)

    @app.timer(interval=1.0)
    async def idle_clock() -> None:
        for processor in processors:
            await send_findings(processor.clock.idle())

    @app.on_partitions_revoked.connect
    async def on_revoked(app: Any, revoked: set[Any], **kwargs: Any) -> None:
        parts = {tp.partition for tp in revoked}
        for processor in processors:
            processor.forget(parts)
        fusion_processor.state.forget(parts)

    def restored() -> int:
        return sum(p.state.restored for p in processors) + fusion_processor.state.restored

    app.guard_restored = restored  # type: ignore[attr-defined]
    return app

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

import asyncio
from typing import Any

import faust

from guard.config import Settings, streams_state_key
from guard.detectors.engine import EngineConfig
from guard.detectors.findings import Finding
from guard.kafka import DLQ_ERROR_HEADER, DLQ_SOURCE_HEADER, faust_broker_settings
from guard.schemas import SchemaError, encode

from .faust_transport import LeanTransport, QuietMonitor
from .processing import (
    FusionProcessor,
    KeyedState,
    StreamsCounters,
    TelemetryProcessor,
    encode_finding,
    engine_config_of,
    finding_key,
    topic_kinds,
)

__all__ = ["create_app"]


def _backed_by(state: KeyedState, table: Any, secret: bytes) -> None:
    # Keys and values are bytes end to end (key_type = value_type = bytes: raw serializers).
    # faust derives a table's changelog serializers from those types, not from a schema, and
    # falls back on json: with str keys the checkpoints were written raw but read back as
    # json, so recovery failed and a rebalanced worker hung in it.
    state.load = lambda key: table.get(key.encode())
    state.secret = secret

    def save(key: str, partition: int, blob: bytes) -> None:
        # Batches have no current event: write the store and the key's changelog partition.
        raw = key.encode()
        table.data[raw] = blob
        table.send_changelog(partition, raw, blob)

    def delete(key: str, partition: int) -> None:
        raw = key.encode()
        table.data.pop(raw, None)
        table.send_changelog(partition, raw, None, value_serializer="raw")  # a tombstone

    state.save = save
    state.delete = delete


RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}


def _use_uvloop() -> bool:
    """uvloop's event loop for the worker, where installed: the loop's own cost per record
    (futures, callbacks, selector) is a large share of a faust worker's time."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class _App(faust.App):
    """faust's app over :class:`~guard.streams.faust_transport.LeanTransport` (faust's
    aiokafka transport with a leaner record hand-off)."""

    def _new_transport(self) -> Any:
        return LeanTransport(self.conf.broker_consumer, self)


def _faust_app(settings: Settings) -> faust.App:
    k = settings.kafka
    datadir = settings.home / "faust" / settings.streams.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return _App(
        settings.streams.app_id,
        **faust_broker_settings(settings),  # brokers and SASL/TLS, as every other client
        store="memory://",
        topic_partitions=k.telemetry_partitions,
        topic_replication_factor=k.replication_factor,
        broker_session_timeout=k.session_timeout_ms / 1000,
        broker_heartbeat_interval=max(0.5, k.session_timeout_ms / 4000),
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        datadir=str(datadir),
        table_cleanup_interval=30.0,
        producer_compression_type="lz4",  # gzip cost the worker's one core ~4x as much
        broker_max_poll_records=5000,
        stream_buffer_maxsize=20000,
        broker_commit_every=20000,
        consumer_max_fetch_size=16 * 1024 * 1024,
        logging_config=None,
        # faust's Cython stream iterator takes what is queued without a wait per event
        # (faust >= 0.14; off by default there only because it is new)
        cython_optimizations=True,
        Monitor=QuietMonitor,  # no bookkeeping per event: Guard's counters report it
    )


class _Wiring:
    """The app's topics, tables and processors, and the agents that join them."""

    def __init__(self, app: faust.App, settings: Settings) -> None:
        partitions = settings.kafka.telemetry_partitions
        self.app = app
        self.settings = settings
        self.state_key = streams_state_key(settings)
        self.findings = app.topic(
            settings.topic("findings"), partitions=partitions, internal=True, **RAW
        )
        self.remediation = app.topic(settings.topic("remediation"), **RAW)
        self.dlq = app.topic(settings.topic("dlq"), **RAW)
        self.table_args = {
            "default": None,
            "key_type": bytes,
            "value_type": bytes,
            "partitions": partitions,
        }
        self.counters = StreamsCounters()
        self.processors: list[TelemetryProcessor] = []
        self.fusion = FusionProcessor(settings.streams.checkpoint_s, self.counters)

    async def send_findings(self, findings: list[Finding]) -> None:
        for f in findings:
            await self.findings.send(
                key=finding_key(f).encode(), value=encode_finding(f), timestamp=f.ts
            )

    async def dead_letter(self, event: Any, error: SchemaError) -> None:
        msg = event.message
        await self.dlq.send(
            key=event.key,
            value=event.value,
            headers=[
                (DLQ_ERROR_HEADER, str(error).encode()[:4096]),
                (DLQ_SOURCE_HEADER, f"{msg.topic}/{msg.partition}/{msg.offset}".encode()),
            ],
        )

    def telemetry_agent(
        self, level: str, topics: dict[str, str], table: str, cfg: EngineConfig
    ) -> None:
        st = self.settings.streams
        processor = TelemetryProcessor(level, topics, cfg, st.checkpoint_s, self.counters)
        _backed_by(processor.state, self.app.Table(table, **self.table_args), self.state_key)
        self.processors.append(processor)

        async def agent(stream: Any) -> None:
            async for events in stream.take_events(st.batch_max, st.batch_within_s):
                found, bad = processor.process(
                    (e.message.topic, e.message.partition, e.value) for e in events
                )
                for index, error in bad:
                    await self.dead_letter(events[index], error)
                await self.send_findings(found)

        self.app.agent(self.app.topic(*topics, **RAW), name=f"{level}_telemetry")(agent)

    def fusion_agent(self) -> None:
        st = self.settings.streams
        _backed_by(self.fusion.state, self.app.Table("fusion", **self.table_args), self.state_key)

        async def fusion(stream: Any) -> None:
            async for events in stream.take_events(st.batch_max, st.batch_within_s):
                flags, bad = self.fusion.process(
                    (e.key or b"", e.message.partition, e.value or b"") for e in events
                )
                for index, error in bad:
                    await self.dead_letter(events[index], error)
                for flag in flags:
                    await self.remediation.send(
                        key=flag.kafka_key(), value=encode(flag), timestamp=flag.ts
                    )

        self.app.agent(self.findings, name="fusion")(fusion)

    def housekeeping(self) -> None:
        """The idle clock (findings of quiet streams) and forgetting revoked partitions."""

        @self.app.timer(interval=1.0)
        async def idle_clock() -> None:
            for processor in self.processors:
                await self.send_findings(processor.clock.idle())

        @self.app.timer(interval=10.0)
        async def expire_idle_keys() -> None:
            for processor in self.processors:
                processor.expire(self.settings.streams.key_idle_s)
            self.fusion.state.expire(self.settings.streams.key_idle_s)

        @self.app.on_partitions_revoked.connect
        async def on_revoked(app: Any, revoked: set[Any], **kwargs: Any) -> None:
            parts = {tp.partition for tp in revoked}
            for processor in self.processors:
                processor.forget(parts)
            self.fusion.state.forget(parts)

    def checkpoint_totals(self) -> dict[str, int]:
        return KeyedState.totals([*(p.state for p in self.processors), self.fusion.state])


def create_app(settings: Settings, engine_config: EngineConfig | None = None) -> faust.App:
    """The streams app for ``settings`` (broker, topics, partitions, app id)."""
    cfg = engine_config or engine_config_of(settings)
    _use_uvloop()
    app = _faust_app(settings)
    wiring = _Wiring(app, settings)
    wiring.telemetry_agent("node", topic_kinds(settings.topic, "node"), "node-detectors", cfg)
    wiring.telemetry_agent("job", topic_kinds(settings.topic, "job"), "job-detectors", cfg)
    wiring.fusion_agent()
    wiring.housekeeping()
    app.guard_counters = wiring.counters  # type: ignore[attr-defined]
    app.guard_checkpoint_totals = wiring.checkpoint_totals  # type: ignore[attr-defined]
    return app

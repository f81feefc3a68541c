"""The faust transport of ``guard streams``: Guard's detection core in faust agents.

The app runs one :class:`~guard.detectors.core.DetectionCore`, as the native worker does,
and two thin agents hand it faust-native batches (``stream.take_events(max, within)``):

* ``telemetry`` — ``guard.gpu``, ``guard.nic`` (key = node), ``guard.steps`` and
  ``guard.collectives`` (key = job): ``core.step(telemetry, (), wall)``, the findings to
  the internal ``guard.findings`` topic;
* ``fusion`` — ``guard.findings``, repartitioned by the node a finding is about (a
  straggler found by a job's detectors meets that node's own thermal or NIC findings):
  ``core.step((), findings, wall)``, one suspicion per node → :class:`~guard.schemas.Flag`
  on ``guard.remediation``.

The core's tables live in memory and are checkpointed per key every ``checkpoint_s`` seconds
into faust tables backed by changelog topics: a restarted or rebalanced worker resumes from
the last checkpoint instead of a cold start. A malformed record goes to ``guard.dlq`` with
the reason; the worker carries on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import faust
from faust.sensors import Monitor
from faust.types import TP

from guard.config import Settings, streams_state_key
from guard.detectors.core import (
    TABLES,
    DetectionCore,
    Outgoing,
    encode_finding,
    finding_key,
)
from guard.detectors.engine import EngineConfig
from guard.kafka import DLQ_ERROR_HEADER, DLQ_SOURCE_HEADER, faust_broker_settings
from guard.metrics import dead_letter_reason
from guard.schemas import Flag, SchemaError, encode

from .metrics import flags_sent
from .processing import KeyedState, StreamsCounters, engine_config_of, node_reads, topic_kinds

__all__ = ["create_app"]


class QuietMonitor(Monitor):
    """faust's Monitor without its bookkeeping per record and per event (counters by topic
    and stream, timings of each event): the web views that show them are off in Guard's
    workers, whose own counters and ``/metrics`` report what they do. Commits, offsets,
    rebalances and producer errors are still recorded."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        pass

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_send_initiated(
        self, producer: Any, topic: str, message: Any, keysize: int, valsize: int
    ) -> None:
        return None

    def on_send_completed(self, producer: Any, state: Any, metadata: Any) -> None:
        pass

    def on_table_get(self, table: Any, key: Any) -> None:
        pass

    def on_table_set(self, table: Any, key: Any, value: Any) -> None:
        pass


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


RAW: dict[str, Any] = {
    "key_type": bytes,
    "value_type": bytes,
    "key_serializer": "raw",
    "value_serializer": "raw",
}


def _use_uvloop() -> bool:
    """uvloop's event loop for the worker, where installed: the loop's own cost per record
    (futures, callbacks, selector) is a large share of a faust worker's time."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def _faust_app(settings: Settings) -> faust.App:
    k = settings.kafka
    datadir = settings.home / "faust" / settings.streams.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return faust.App(
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
    """The app's topics, tables and core, and the agents that feed it."""

    def __init__(self, app: faust.App, settings: Settings, cfg: EngineConfig) -> None:
        partitions = settings.kafka.telemetry_partitions
        self.app = app
        self.settings = settings
        self.state_key = streams_state_key(settings)
        self.findings = app.topic(
            settings.topic("findings"), partitions=partitions, internal=True, **RAW
        )
        self.remediation = app.topic(settings.topic("remediation"), **RAW)
        self.dlq = app.topic(settings.topic("dlq"), **RAW)
        self.table_args: dict[str, Any] = {
            "default": None,
            "key_type": bytes,
            "value_type": bytes,
            "partitions": partitions,
        }
        self.counters = StreamsCounters()
        self.states: dict[str, KeyedState] = {}
        self.core = DetectionCore(cfg, stores=self._table, counters=self.counters)

    def _table(self, table: str, make: Callable[[str], Any]) -> KeyedState:
        state = self.states[table] = KeyedState(make, self.settings.streams.checkpoint_s)
        _backed_by(state, self.app.Table(table, **self.table_args), self.state_key)
        return state

    async def send_flags(self, flags: list[Flag]) -> None:
        for flag in flags:
            await self.remediation.send(key=flag.kafka_key(), value=encode(flag), timestamp=flag.ts)
        flags_sent(flags, "faust")

    async def send_findings(self, findings: Sequence[Outgoing]) -> None:
        for f in findings:
            await self.findings.send(
                key=finding_key(f).encode(), value=encode_finding(f), timestamp=f.ts
            )

    async def dead_letter(self, event: Any, error: SchemaError) -> None:
        self.counters.dead_reasons[dead_letter_reason(error)] += 1
        msg = event.message
        await self.dlq.send(
            key=event.key,
            value=event.value,
            headers=[
                (DLQ_ERROR_HEADER, str(error).encode()[:4096]),
                (DLQ_SOURCE_HEADER, f"{msg.topic}/{msg.partition}/{msg.offset}".encode()),
            ],
        )

    def telemetry_agent(self) -> None:
        st = self.settings.streams
        kinds = topic_kinds(self.settings.topic)
        core = self.core

        async def telemetry(stream: Any) -> None:
            async for events in stream.take_events(st.batch_max, st.batch_within_s):
                out = core.step(
                    [(e.message.partition, kinds[e.message.topic], e.value) for e in events],
                    (),
                    time.monotonic(),
                    node_reads(
                        {
                            (e.message.topic, e.message.partition): e.message.offset + 1
                            for e in events
                        },
                        kinds,
                        lambda topic, partition: self.app.consumer.highwater(TP(topic, partition)),
                    ),
                )
                for index, error in out.bad:
                    await self.dead_letter(events[index], error)
                await self.send_findings(out.findings)
                await self.send_flags(out.flags)  # job findings that waited for their node

        self.app.agent(self.app.topic(*kinds, **RAW), name="telemetry")(telemetry)

    def fusion_agent(self) -> None:
        st = self.settings.streams
        core = self.core

        async def fusion(stream: Any) -> None:
            async for events in stream.take_events(st.batch_max, st.batch_within_s):
                out = core.step(
                    (),
                    [(e.message.partition, e.key or b"", e.value or b"") for e in events],
                    time.monotonic(),
                )
                for index, error in out.bad_findings:
                    await self.dead_letter(events[index], error)
                await self.send_findings(out.findings)  # the jobs' river models' findings
                await self.send_flags(out.flags)

        self.app.agent(self.findings, name="fusion")(fusion)

    def housekeeping(self) -> None:
        """The idle clock (findings of quiet keys) and forgetting revoked partitions."""

        @self.app.timer(interval=1.0)  # type: ignore[untyped-decorator]  # faust's is untyped
        async def idle_clock() -> None:
            await self.send_findings(self.core.idle(time.monotonic()))

        @self.app.timer(interval=10.0)  # type: ignore[untyped-decorator]
        async def expire_idle_keys() -> None:
            self.core.expire(self.settings.streams.key_idle_s)

        # faust sends the set as its first positional argument; its stub wants *args
        @self.app.on_partitions_revoked.connect  # type: ignore[arg-type]
        async def on_revoked(app: Any, revoked: set[Any], **kwargs: Any) -> None:
            self.core.forget({tp.partition for tp in revoked})

    def checkpoint_totals(self) -> dict[str, int]:
        return KeyedState.totals(self.states.values())


def create_app(settings: Settings, engine_config: EngineConfig | None = None) -> faust.App:
    """The streams app for ``settings`` (broker, topics, partitions, app id)."""
    cfg = engine_config or engine_config_of(settings)
    _use_uvloop()
    app = _faust_app(settings)
    wiring = _Wiring(app, settings, cfg)
    assert set(wiring.states) == set(TABLES)
    wiring.telemetry_agent()
    wiring.fusion_agent()
    wiring.housekeeping()
    app.guard_counters = wiring.counters  # type: ignore[attr-defined]
    app.guard_checkpoint_totals = wiring.checkpoint_totals  # type: ignore[attr-defined]
    return app

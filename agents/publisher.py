"""The agent's publisher: messages → Kafka, through a bounded on-disk spool when Kafka is away.

States:

``online``
    Messages go straight to the producer (batched by librdkafka: ``linger.ms``). A failed
    delivery (the broker is gone: ``message.timeout.ms`` = ``agent.delivery_timeout_s``
    expires) moves to ``draining``.
``draining``
    New messages are held in memory while the producer reports the fate of what it still
    had in flight; failures are appended to the spool in the order the producer reports
    them, then the held messages, so the spool keeps the original order. Then ``offline``.
``offline``
    Messages are appended to the spool. Every ``probe_s`` the broker is asked (in the
    background) for the metadata of the topics; when it answers with all of them, a fresh
    producer is made and the state is ``replaying``.
``replaying``
    New messages are appended to the spool behind the backlog; the backlog is sent in order,
    in batches, and each batch is committed (cursor moved, segments deleted) only once it is
    delivered. When the spool is empty the state is ``online`` again. A failure mid-replay
    goes back to ``offline`` with nothing committed past the first undelivered record:
    delivery is at-least-once (a record may be sent twice, never lost below the bound).

A record the broker can never take (larger than allowed, a topic we may not write, an
invalid record) is dropped, counted in ``stats["rejected"]`` and logged, rather than
spooled: retrying it would block the backlog behind it forever.

Nothing here blocks the caller for long: ``publish`` never waits for the broker, broker
probes run in a thread of their own, and ``poll`` does at most one replay batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from guard.config import Settings
from guard.kafka import TELEMETRY_TOPICS, make_producer, to_record
from guard.schemas import GuardMessage

from .spool import Spool, SpoolRecord

__all__ = ["Publisher"]

log = logging.getLogger(__name__)


class Publisher:
    """Publishes wire messages for the agent; see the module docstring for the states."""

    def __init__(
        self,
        settings: Settings,
        spool_dir: str | Path | None = None,
        producer_factory: Callable[..., Any] | None = None,
        probe_s: float = 2.0,
        replay_batch: int = 5000,
    ) -> None:
        self.settings = settings
        agent = settings.agent
        directory = spool_dir or agent.spool_dir or (settings.home / "spool")
        self.spool = Spool(directory, agent.spool_max_bytes)
        self._factory = producer_factory or self._make_producer
        self.probe_s = probe_s
        self.replay_batch = replay_batch
        self.topics = [settings.topic(name) for name in TELEMETRY_TOPICS]
        self.stats = {
            "published": 0,
            "delivered": 0,
            "spooled": 0,
            "replayed": 0,
            "failed": 0,
            "rejected": 0,
            # refused by the broker for their timestamps (this host's clock far ahead)
            "refused_timestamp": 0,
            "refused_invalid": 0,  # refused as invalid records (a refused record's batch-mates)
        }
        #: how far ahead of this host's clock the first refused record was stamped, s; and
        #: the newest Kafka timestamp the broker accepted from us (ms), for stamping notices
        self.refused_ahead_s: float | None = None
        self._rejected_codes: dict[Any, int] = {}
        self.last_accepted_ms: int | None = None
        self._held: list[SpoolRecord] = []
        self._next_probe = 0.0
        self._probe: _Probe | None = None
        self._producer: Any = None
        self.state = "offline" if len(self.spool) else "online"
        if self.state == "online":
            self._producer = self._factory()
        else:
            log.info("%d spooled records from an earlier run wait for the broker", len(self.spool))

    @property
    def dropped(self) -> int:
        """Records lost because the spool was full."""
        return self.spool.dropped

    def _make_producer(self) -> Any:
        # librdkafka's log: guard.kafka's, as every service's (formatted, demoted, de-duplicated)
        return make_producer(
            self.settings,
            **{"message.timeout.ms": int(self.settings.agent.delivery_timeout_s * 1000)},
        )

    # --- API -------------------------------------------------------------------------------

    def publish(self, message: GuardMessage, timestamp_ms: int | None = None) -> None:
        """Queue ``message``; its Kafka timestamp is its event time unless ``timestamp_ms``."""
        record = to_record(self.settings, message)
        self.stats["published"] += 1
        stamp = record.timestamp_ms if timestamp_ms is None else timestamp_ms
        self._send(SpoolRecord(record.topic, record.key, record.value, stamp))

    def poll(self) -> None:
        """Serve delivery reports, move between states, replay one batch when it is time."""
        if self._producer is not None:
            self._producer.poll(0)
        if self.state == "draining" and (self._producer is None or len(self._producer) == 0):
            for record in self._held:
                self._spool(record)
            self._held = []
            self._producer = None
            self.state = "offline"
            self._next_probe = time.monotonic() + self.probe_s
        if self.state == "offline" and self._probed_ready():
            log.info("broker is back; replaying %d spooled records", len(self.spool))
            self._producer = self._factory()
            self.state = "replaying"
        if self.state == "replaying":
            self._replay_one_batch()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (up to ``timeout_s``) until what was handed to the producer is delivered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            if self.state == "online" and self._producer is not None and len(self._producer) == 0:
                return
            if self.state == "offline":
                return
            if self._producer is not None:
                self._producer.flush(min(0.2, max(0.0, deadline - time.monotonic())))
            else:
                time.sleep(0.05)

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        if self._producer is not None:
            # What is still in flight is spooled by its delivery report (a purge fails it).
            self._producer.purge()
            self._producer.poll(0)
            self._producer.flush(1.0)
        for record in self._held:
            self._spool(record)
        self._held = []
        self.spool.close()

    # --- internals -------------------------------------------------------------------------

    def _send(self, record: SpoolRecord) -> None:
        if self.state == "online":
            try:
                self._produce(record)
                return
            except KafkaException as exc:  # refused before sending (e.g. larger than allowed)
                self._reject(record, exc.args[0] if exc.args else exc)
                return
            except BufferError:
                self._producer.poll(0.05)
                try:
                    self._produce(record)
                    return
                except BufferError:
                    log.warning("the producer queue is full; spooling")
                    self._go_draining()
        if self.state == "draining":
            self._held.append(record)
        else:
            self._spool(record)

    def _produce(self, record: SpoolRecord) -> None:
        def report(err: Any, msg: Any) -> None:
            if err is None:
                self.stats["delivered"] += 1
                self.last_accepted_ms = max(self.last_accepted_ms or 0, record.timestamp_ms)
                return
            if _permanent(err):
                self._reject(record, err)
                return
            self.stats["failed"] += 1
            self._spool(record)
            if self.state == "online":
                log.warning(
                    "delivery to %s failed (%s); spooling until the broker is back",
                    record.topic,
                    err,
                )
                self._go_draining()

        self._producer.produce(
            record.topic,
            record.value,
            record.key,
            timestamp=record.timestamp_ms,
            on_delivery=report,
        )

    def _reject(self, record: SpoolRecord, err: Any) -> None:
        self.stats["rejected"] += 1
        code = getattr(err, "code", lambda: None)()
        if code in (KafkaError.INVALID_TIMESTAMP, KafkaError.INVALID_RECORD):
            self._refused_timestamp(record, code == KafkaError.INVALID_TIMESTAMP)
            return
        # The same error on every record (the batch-mates of a refused record come back as
        # INVALID_RECORD) is logged on its first time and every 1000th, not per record.
        seen = self._rejected_codes[code] = self._rejected_codes.get(code, 0) + 1
        if seen == 1 or seen % 1000 == 0:
            log.error(
                "the broker rejected a record for %s for good (%s); dropped it (%d so far, "
                "%d with this error)",
                record.topic,
                err,
                self.stats["rejected"],
                seen,
            )

    def _refused_timestamp(self, record: SpoolRecord, for_timestamp: bool) -> None:
        """Counted every time, said once: a clock far ahead makes every record refused.

        Kafka refuses a record stamped beyond ``log.message.timestamp.after.max.ms`` (1 h)
        with INVALID_TIMESTAMP, and its batch (an idempotent producer's, here: all of them)
        with INVALID_RECORD, which says no more than that the broker failed to validate it.
        """
        self.stats["refused_timestamp" if for_timestamp else "refused_invalid"] += 1
        if self.refused_ahead_s is not None:
            return
        self.refused_ahead_s = record.timestamp_ms / 1000 - time.time()
        log.error(
            "the broker refused a record for %s (stamped %.0f s from this host's clock) as %s: "
            "most likely this host's clock is more than an hour ahead of the broker's (Kafka "
            "refuses records stamped beyond log.message.timestamp.after.max.ms, 1 h by "
            "default, and the rest of their batch). Check the clock (NTP/chrony); refused "
            "records are counted (refused_timestamp, refused_invalid) and the node is flagged",
            record.topic,
            self.refused_ahead_s,
            "an invalid timestamp" if for_timestamp else "an invalid record",
        )

    def _go_draining(self) -> None:
        if self.state == "online":
            self.state = "draining"

    def _spool(self, record: SpoolRecord) -> None:
        self.spool.append(record)
        self.stats["spooled"] += 1

    def _probed_ready(self) -> bool:
        """True once a probe found the broker ready. Probes run in a thread of their own,
        one at a time, every ``probe_s``: a probe of a broker that is away waits for its
        timeout, and the agent's collection loop must not wait with it."""
        probe = self._probe
        if probe is not None and not probe.is_alive():
            self._probe = None
            if probe.ready:
                return True
        if self._probe is None and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.probe_s
            self._probe = _Probe(self._broker_ready)
        return False

    def _broker_ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        from guard.kafka import client_config

        try:
            metadata = AdminClient(client_config(self.settings)).list_topics(timeout=1.0)
        except Exception as exc:  # KafkaException and transport errors: still away
            log.debug("broker probe: %s", exc)
            return False
        return all(
            topic in metadata.topics
            and not metadata.topics[topic].error
            and metadata.topics[topic].partitions
            for topic in self.topics
        )

    def _replay_one_batch(self) -> None:
        batch = self.spool.peek(self.replay_batch)
        if not batch:
            self.state = "online"
            log.info("spool replayed; publishing directly again")
            return
        results: list[bool | None] = [None] * len(batch)

        def reporter(i: int, record: SpoolRecord) -> Callable[[Any, Any], None]:
            def report(err: Any, msg: Any) -> None:
                if err is not None and _permanent(err):
                    self._reject(record, err)  # never deliverable: do not block the backlog
                    results[i] = True
                else:
                    results[i] = err is None

            return report

        producer = self._producer
        for i, (_, record) in enumerate(batch):
            while True:
                try:
                    producer.produce(
                        record.topic,
                        record.value,
                        record.key,
                        timestamp=record.timestamp_ms,
                        on_delivery=reporter(i, record),
                    )
                    break
                except KafkaException as exc:
                    self._reject(record, exc.args[0] if exc.args else exc)
                    results[i] = True
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.flush(self.settings.agent.delivery_timeout_s + 5)
        delivered = 0
        for ok in results:
            if not ok:
                break
            delivered += 1
        if delivered:
            self.spool.commit(batch[delivered - 1][0], delivered)
            self.stats["replayed"] += delivered
        if delivered < len(batch):
            log.warning("replay stopped after %d of %d records; will retry", delivered, len(batch))
            self._producer = None
            self.state = "offline"
            self._next_probe = time.monotonic() + self.probe_s
        elif not len(self.spool):
            # Caught up: from here on publish directly (new records no longer queue behind).
            self.state = "online"
            log.info("spool replayed; publishing directly again")


class _Probe(threading.Thread):
    """One broker probe in the background; ``ready`` is its answer once it has ended."""

    def __init__(self, check: Callable[[], bool]) -> None:
        super().__init__(name="guard-broker-probe", daemon=True)
        self.check, self.ready = check, False
        self.start()

    def run(self) -> None:
        self.ready = self.check()


def _permanent(err: Any) -> bool:
    """A delivery error that retrying later cannot fix (a record too large, a topic we may
    not write, a corrupt record); everything else (timeouts, transport, leadership, a topic
    not there yet, purges) is the broker being away and goes to the spool."""
    code = err.code() if hasattr(err, "code") else None
    if code in _TRANSIENT_CODES or getattr(err, "retriable", lambda: False)():
        return False
    return code in _PERMANENT_CODES


_TRANSIENT_CODES = {
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
    KafkaError._TIMED_OUT,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
}
_PERMANENT_CODES = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.INVALID_RECORD,
    KafkaError._INVALID_ARG,
    KafkaError.INVALID_TIMESTAMP,
}

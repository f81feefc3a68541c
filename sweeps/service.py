"""The orchestrator on Kafka, and the reads and requests behind ``guard node``.

:class:`KafkaOrchestrator` runs :class:`~guard.sweeps.orchestrator.Orchestrator` as a
service: at start it reads ``guard.node-state`` (compacted) to its end and recovers every
node's state, then consumes flags from ``guard.remediation`` (offsets committed after the
resulting states are on the broker) and operator requests from ``guard.node-state``.

Operator requests travel on the node-state topic itself: a :class:`~guard.schemas.NodeState`
whose ``actor`` is ``operator:<name>`` and whose ``state`` is the wish (``healthy`` to
release, ``repair``). The orchestrator applies it and answers with its own state for the
node, so the compacted topic always ends, per node, in the orchestrator's word — or in a
request it has not applied yet (then a restarted orchestrator applies it).

Only one orchestrator may run per cluster; it reads every partition itself (``assign``, no
consumer-group rebalancing), which also starts it without a group-join wait.

In-process use (``guard demo``)::

    orch = KafkaOrchestrator(settings, scheduler=DryRunScheduler(nodes),
                             executor=SimulatedSweepExecutor.from_truth(truth),
                             clock=SimulatedClock(truth.start_ts, speed), nodes=nodes,
                             listeners=[progress.on_message])
    orch.start(); orch.ready.wait(30)
    ...
    orch.stop()
"""

from __future__ import annotations

import collections
import getpass
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from guard.config import Settings
from guard.kafka import dead_letter, make_consumer, make_producer, produce
from guard.metrics import Metrics, dead_letter_reason
from guard.schemas import Flag, GuardMessage, NodeState, SchemaError, SweepResult, decode

from .executors import SweepExecutor, make_executor
from .orchestrator import Orchestrator
from .scheduler import SchedulerAdapter, make_scheduler
from .states import NodeView, is_operator, recover_views
from .webhook import WebhookNotifier, open_episodes

__all__ = [
    "KafkaOrchestrator",
    "read_node_states",
    "read_sweeps",
    "request_operator_action",
    "wait_for_answer",
]

log = logging.getLogger(__name__)

#: Consumers that must know where a partition ends get an event there.
_EOF: dict[str, Any] = {"enable.partition.eof": True}


def _partitions(consumer: Consumer, topic: str, timeout_s: float) -> list[int]:
    metadata = consumer.list_topics(topic, timeout=timeout_s)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise RuntimeError(
            f"topic {topic} does not exist; create Guard's topics with `guard topics create`"
        )
    return sorted(found.partitions)


def _read_to_end(
    settings: Settings, topic: str, timeout_s: float, consumer: Consumer | None = None
) -> Iterator[Message]:
    """Every record of ``topic`` from the beginning to the end as of now (partition EOF).

    The end is found with partition-EOF events rather than watermarks (the embedded Tansu
    broker reports stale high watermarks). ``consumer``, if given, keeps its assignment.
    """
    own = consumer is None
    if consumer is None:
        consumer = make_consumer(settings, f"{settings.orchestrator.group_id}-reader", **_EOF)
    try:
        parts = _partitions(consumer, topic, timeout_s)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(parts):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reading {topic} to its end took over {timeout_s:g} s "
                    f"({len(at_end)} of {len(parts)} partitions done)"
                )
            for record in consumer.consume(500, 0.2):
                error = record.error()
                if error is None:
                    at_end.discard(record.partition())
                    yield record
                elif error.code() == KafkaError._PARTITION_EOF:
                    if (partition := record.partition()) is not None:
                        at_end.add(partition)
                else:
                    log.warning("reading %s: %s", topic, error)
    finally:
        if own:
            consumer.close()


def _decode_all(records: Iterable[Message], kind: str) -> Iterator[Any]:
    for record in records:
        try:
            yield decode(record.value() or b"", kind)
        except SchemaError as exc:
            log.warning(
                "skipping a bad %s record at %s/%d: %s", kind, record.topic(), record.offset(), exc
            )


def read_node_states(
    settings: Settings, timeout_s: float = 15.0, keep_history: bool = False
) -> dict[str, NodeView]:
    """Each node's latest state (and pending operator request) from the compacted topic."""
    records = _read_to_end(settings, settings.topic("node-state"), timeout_s)
    return recover_views(_decode_all(records, "node_state"), keep_history=keep_history)


def read_sweeps(
    settings: Settings, node: str | None = None, timeout_s: float = 15.0
) -> list[SweepResult]:
    """Sweep results still retained on the sweeps topic (of ``node`` if given), oldest first."""
    records = _read_to_end(settings, settings.topic("sweeps"), timeout_s)
    sweeps = [s for s in _decode_all(records, "sweep") if node is None or s.node == node]
    return sorted(sweeps, key=lambda s: s.ts)


def request_operator_action(
    settings: Settings,
    node: str,
    state: str,
    reason: str = "",
    user: str | None = None,
    prev: str | None = None,
) -> NodeState:
    """Publish an operator's request (``healthy``: release, ``repair``) for the orchestrator."""
    if state not in ("healthy", "repair"):
        raise ValueError(f"operators may request healthy (release) or repair, not {state!r}")
    try:
        who = user or getpass.getuser()
    except (KeyError, OSError):
        who = "unknown"
    request = NodeState(
        ts=time.time(),
        node=node,
        state=state,
        prev=prev,
        reason=reason,
        actor=f"operator:{who}",
    )
    producer = make_producer(settings)
    produce(producer, settings, request)
    if producer.flush(30) != 0:
        raise RuntimeError(
            f"the request for {node} was not delivered to {settings.kafka.bootstrap}"
        )
    return request


def wait_for_answer(settings: Settings, request: NodeState, timeout_s: float) -> NodeState | None:
    """The orchestrator's state for the request's node published after the request, if any
    arrives within ``timeout_s``."""
    topic = settings.topic("node-state")
    deadline = time.monotonic() + timeout_s
    while True:
        seen_request = False
        answer: NodeState | None = None
        try:
            records = _read_to_end(settings, topic, max(1.0, deadline - time.monotonic()))
            for state in _decode_all(records, "node_state"):
                if state.node != request.node:
                    continue
                if is_operator(state.actor):
                    seen_request = seen_request or (
                        state.ts == request.ts and state.actor == request.actor
                    )
                elif seen_request:
                    answer = state
        except TimeoutError:
            return None
        if answer is not None:
            return answer
        if time.monotonic() > deadline:
            return None
        time.sleep(0.3)


class KafkaOrchestrator:
    """The orchestrator service: Kafka in and out around an :class:`Orchestrator`.

    Everything but ``settings`` is optional and built from the settings when left out
    (``make_scheduler``, ``make_executor``, a webhook notifier when ``webhook_url`` is set).
    ``listeners`` are called with every node state and sweep result published, from the
    orchestrator's thread. ``ready`` is set once the persisted states are recovered (and
    ``error`` holds what stopped it, if anything). One run per instance: to restart, build a
    new one — it recovers from the topic, as after a crash.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        scheduler: SchedulerAdapter | None = None,
        executor: SweepExecutor | None = None,
        clock: Callable[[], float] = time.time,
        nodes: Sequence[str] | None = None,
        listeners: Iterable[Callable[[GuardMessage], None]] = (),
        poll_s: float = 0.2,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.dead_reasons: collections.Counter[str] = collections.Counter()
        o = settings.orchestrator
        self.webhook: WebhookNotifier | None = None
        listeners = list(listeners)
        stop_listeners = []
        urls = [u for u in (o.webhook_url, *o.webhook_urls) if u]
        if urls:
            basic = None
            if o.webhook_username is not None:
                password = o.webhook_password.get_secret_value() if o.webhook_password else ""
                basic = (o.webhook_username, password)
            self.webhook = WebhookNotifier(
                urls,
                o.webhook_secret.get_secret_value() if o.webhook_secret else None,
                retries=o.webhook_retries,
                backoff_s=o.webhook_backoff_s,
                timeout_s=o.webhook_timeout_s,
                max_queue=o.webhook_queue,
                mode=o.webhook_mode,
                generator_url=o.grafana_node_url,
                resend_s=o.webhook_resend_s,
                bearer_token=(
                    o.webhook_bearer_token.get_secret_value() if o.webhook_bearer_token else None
                ),
                basic_auth=basic,
                ca_file=o.webhook_ca_file,
            )
            listeners.append(self.webhook)
            stop_listeners.append(self.webhook.sweeps_stopped)
        self._producer = make_producer(settings)
        self.core = Orchestrator(
            o,
            scheduler=scheduler or make_scheduler(settings),
            executor=executor or make_executor(settings),
            publish=self._publish,
            clock=clock,
            nodes=nodes,
            listeners=listeners,
            stop_listeners=stop_listeners,
        )
        self.poll_s = poll_s
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> KafkaOrchestrator:
        """Run in a background thread (see :meth:`stop`)."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run_logged, name="guard-orchestrator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run_logged(self) -> None:
        try:
            self.run(self._stop)
        except BaseException as exc:
            self.error = exc
            self.ready.set()  # wake whoever waits for start-up: it must look at `error`
            log.exception("the orchestrator stopped on an error")

    def run(self, stop: threading.Event) -> None:
        """Recover, then consume until ``stop`` is set."""
        s = self.settings
        if self.webhook is not None:
            self.webhook.start()
        states = make_consumer(s, f"{s.orchestrator.group_id}-state", **_EOF)
        flags = make_consumer(
            s, s.orchestrator.group_id, **(self.metrics.kafka_conf() if self.metrics else {})
        )
        try:
            self._recover(states)
            self._assign_committed(flags, s.topic("remediation"))
            self.ready.set()
            while not stop.is_set():
                handled = self._consume_flags(flags)
                self._consume_requests(states)
                self.core.tick()
                self._producer.poll(0)
                if self.metrics is not None:
                    self.metrics.beat()
                if handled:
                    # States caused by these flags reach the broker before their offsets do.
                    self._producer.flush(30)
                    flags.commit(offsets=handled, asynchronous=False)
        finally:
            self.core.close()
            self._producer.flush(10)
            flags.close()
            states.close()
            if self.webhook is not None:
                self.webhook.stop()

    # --- parts --------------------------------------------------------------------------------

    def _publish(self, message: GuardMessage) -> None:
        produce(self._producer, self.settings, message)

    def _recover(self, states: Consumer) -> None:
        topic = self.settings.topic("node-state")
        good = []
        for record in _read_to_end(self.settings, topic, 60.0, consumer=states):
            try:
                good.append(decode(record.value() or b"", "node_state"))
            except SchemaError as exc:
                self._dead_letter(record, exc)
        if self.webhook is not None:  # a node still out keeps its alert (and its resends)
            self.webhook.restore(open_episodes(good))
        pending = self.core.recover(good)
        log.info(
            "recovered %d node states, %d operator requests pending",
            len(self.core.records),
            len(pending),
        )
        self.core.resume(pending)
        self._producer.flush(30)

    def _assign_committed(self, consumer: Consumer, topic: str) -> None:
        parts = [TopicPartition(topic, p) for p in _partitions(consumer, topic, 30.0)]
        committed = consumer.committed(parts, timeout=30.0)
        consumer.assign(
            [
                TopicPartition(
                    topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                )
                for tp in committed
            ]
        )

    def _consume_flags(self, consumer: Consumer) -> list[TopicPartition]:
        positions: dict[int, TopicPartition] = {}
        for record in consumer.consume(500, self.poll_s):
            error = record.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("remediation consumer: %s", error)
                continue
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            if topic is not None and partition is not None and offset is not None:  # a record's
                positions[partition] = TopicPartition(topic, partition, offset + 1)
            try:
                flag = decode(record.value() or b"", "flag")
            except SchemaError as exc:
                self._dead_letter(record, exc)
                continue
            self.core.handle_flag(cast(Flag, flag))
        return list(positions.values())

    def _consume_requests(self, consumer: Consumer) -> None:
        for record in consumer.consume(100, 0):
            if record.error() is not None:
                continue
            try:
                state = decode(record.value() or b"", "node_state")
            except SchemaError as exc:
                self._dead_letter(record, exc)
                continue
            if is_operator(cast(NodeState, state).actor):
                self.core.handle_operator(cast(NodeState, state))

    def _dead_letter(self, record: Message, error: Exception) -> None:
        source = f"{record.topic()}/{record.partition()}/{record.offset()}"
        log.warning("dead-lettering %s: %s", source, error)
        self.dead_reasons[dead_letter_reason(error)] += 1
        dead_letter(self._producer, self.settings, record.value(), error, source, record.key())

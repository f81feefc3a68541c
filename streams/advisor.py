"""The live C4P advice producer behind ``guard advise``: collectives in, ``advice`` out.

It reads the step and collective topics (job membership, the rings' per-connection
``peers`` and their durations, the all-reduce sizes: :class:`~guard.planning.advice.
JobPatterns`), and every ``[fabric] advise_every_s`` of event time, when a job's pattern or
its slow connections changed since the last plan, plans the concurrent jobs together on the
topology (``[fabric] topology``, else inferred over the nodes the jobs run on) with
:func:`~guard.planning.advice.advise`. A job's advice is published on ``guard.advice``
only when it differs from the one last sent for that job (plan, hot links, actions), so a
steady cluster sends each job's advice once. A job silent for ``[fabric] job_idle_s`` of
event time has ended and is forgotten.

It also reads ``guard.nic`` and runs the fabric hot-spot detector
(:class:`~guard.detectors.fabric.FabricHotSpotDetector`, the detection engine's own code, on
the same topology) over it: the leaves it reports hot, until it withdraws them, go to
:func:`~guard.planning.advice.advise` as ``hot_leaves`` (a degraded uplink of a hot leaf is
advised drained; a hot leaf with none known is to be inspected), and a change in that set
re-plans, so advice is re-issued when the hot set changes. ``[fabric] steering`` adds
``route_flow`` (a QP-steering collective library only).

Observed slow connections (an inter-node connection whose averaged all-reduce transfer time
is 1.5x the job's median) are appended to the advice's ``hot_links`` as ``observed
<node>-><node> x<ratio>``, after the model's links: what the fabric does to the job today.

A producer assigned partitions that hold a backlog plans nothing until it has read each of
them up to where it ended at assignment (:class:`Backlog`): the topics are read at their own
paces, and a plan made with one job's steps read and its collectives not yet would advise on
half the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from guard.config import FabricSettings, Settings
from guard.detectors.fabric import FabricHotSpotDetector
from guard.detectors.findings import Finding
from guard.kafka import dead_letter, make_consumer, make_producer, produce, read_spans
from guard.planning.advice import JobPatterns, advise
from guard.schemas import Advice, GuardMessage, NicSample, SchemaError
from guard.schemas.sample_decoder import decode_samples
from guard.schemas.topics import TOPIC_BY_KIND
from guard.schemas.topology import Topology, TopologyError

__all__ = ["AdviceProducer", "Advisor", "AdvisorStats", "Backlog"]

log = logging.getLogger("guard.advise")

#: most observed slow connections listed in one advice (hot_links holds 64)
MAX_OBSERVED = 16


def _signature(advice: Advice) -> tuple[Any, ...]:
    """What makes a job's advice different: its plan, its hot links and its actions."""
    return (
        advice.id,
        tuple(advice.hot_links),
        tuple((a.action, a.target, a.value) for a in advice.actions),
    )


class Advisor:
    """Jobs' patterns from their messages; the advice that changed, when planning is due.

    Plain state, no I/O: :meth:`update` with each step or collective message, then
    :meth:`due` (after each batch) returns the advice to publish, if any.
    """

    def __init__(self, fabric: FabricSettings, topology: Topology | None = None) -> None:
        self.fabric = fabric
        self.topology = topology
        self.patterns = JobPatterns(default_bytes=fabric.message_bytes)
        self.watermark = 0.0
        self.planned_at: float | None = None
        self._planned_wall = 0.0
        self.plans = 0
        self._inputs: tuple[Any, ...] | None = None
        self._sent: dict[str, tuple[Any, ...]] = {}
        self._unplaced: set[str] = set()
        #: the hot-spot detector's own code, fed the NIC samples: its hot leaves (raised,
        #: then withdrawn when they cool) drive drain_uplink / inspect_leaf and re-planning
        self.hot_spots = FabricHotSpotDetector(
            topology=topology, nodes_per_leaf=None if topology else fabric.nodes_per_leaf
        )
        self.hot_leaves: set[str] = set()

    def update(self, message: GuardMessage) -> None:
        if isinstance(message, NicSample):
            for finding in self.hot_spots.update(message):
                self._hot_spot(finding)
        else:
            self.patterns.update(message)
        self.watermark = max(self.watermark, message.ts)

    def _hot_spot(self, finding: Finding) -> None:
        evidence = finding.evidence
        if evidence.get("observation") != "hot_spot" or evidence.get("level") != "leaf":
            return
        if finding.device is None:
            return
        if finding.clear:
            self.hot_leaves.discard(finding.device)
        else:
            self.hot_leaves.add(finding.device)

    def due(self, wall: float | None = None) -> list[Advice]:
        """The changed advice, when ``advise_every_s`` passed since the last plan — of event
        time, or of ``wall`` time (monotonic s, when given: a backlog read out of event-time
        order, or input that stopped, is still planned) — and the jobs' patterns or slow
        connections changed; else nothing."""
        now, every = self.watermark, self.fabric.advise_every_s
        recent = self.planned_at is not None and now - self.planned_at < every
        if recent and (wall is None or wall - self._planned_wall < every):
            return []
        self.planned_at = now
        self._planned_wall = wall if wall is not None else self._planned_wall
        for job, last in list(self.patterns.last_ts.items()):
            if now - last > self.fabric.job_idle_s:
                self.patterns.forget(job)
                self._sent.pop(job, None)
        jobs = [p for p in self.patterns.patterns() if len(p.nodes) > 1]
        slow = {p.job: self.patterns.slow_connections(p.job) for p in jobs}
        inputs = (
            tuple(jobs),
            tuple(sorted((j, tuple(s.items())) for j, s in slow.items())),
            tuple(sorted(self.hot_leaves)),
        )
        if inputs == self._inputs or not jobs:
            return []
        self._inputs = inputs
        topology = self.topology or self.fabric.fabric(sorted({n for p in jobs for n in p.nodes}))
        placed = [p for p in jobs if self._placed(topology, p.job, p.nodes)]
        self.plans += 1
        out = []
        plans = advise(
            topology, placed, ts=now, hot_leaves=self.hot_leaves, steering=self.fabric.steering
        )
        for planned in plans:
            observed = [
                f"observed {a}->{b} x{ratio:g}"
                for (a, b), ratio in list(slow[planned.job].items())[:MAX_OBSERVED]
            ]
            hot = [*planned.hot_links, *observed][:64]
            advice = planned.model_copy(update={"hot_links": hot}) if observed else planned
            signature = _signature(advice)
            if self._sent.get(advice.job) != signature:
                self._sent[advice.job] = signature
                out.append(advice)
        return out

    def _placed(self, topology: Topology, job: str, nodes: Iterable[str]) -> bool:
        try:
            for node in nodes:
                topology.node(node)
        except TopologyError as exc:
            if job not in self._unplaced:
                self._unplaced.add(job)
                log.warning("job %s is not planned: %s", job, exc)
            return False
        self._unplaced.discard(job)
        return True


class Backlog:
    """The partitions assigned with records unread, and the offset each ended at then.

    ``assigned`` with (topic, partition) -> (first offset to read, end offset) at assignment;
    :attr:`behind` while a partition's read position (the next offset to read) is below the
    end it had then. Records produced after the assignment do not hold it back."""

    def __init__(self) -> None:
        self.ends: dict[tuple[str, int], int] = {}

    def assigned(self, positions: dict[tuple[str, int], tuple[int, int]]) -> None:
        for key, (start, end) in positions.items():
            if start < end:
                self.ends[key] = end

    def revoked(self, keys: Iterable[tuple[str, int]]) -> None:
        for key in keys:
            self.ends.pop(key, None)

    def read(self, positions: dict[tuple[str, int], int]) -> None:
        """The next offset to read of partitions (a negative one: not known yet)."""
        for key, position in positions.items():
            if key in self.ends and position >= self.ends[key]:
                del self.ends[key]

    @property
    def behind(self) -> bool:
        return bool(self.ends)


@dataclass
class AdvisorStats:
    consumed: int = 0
    dead_letters: int = 0
    advice: int = 0
    plans: int = 0


class AdviceProducer:
    """The Kafka side: consume steps and collectives, publish what :class:`Advisor` says."""

    def __init__(self, settings: Settings, group_id: str = "guard-advise") -> None:
        self.settings = settings
        self.advisor = Advisor(settings.fabric, settings.fabric.load())
        self.kinds = {settings.topic(TOPIC_BY_KIND[k]): k for k in ("step", "collective", "nic")}
        self.backlog = Backlog()
        self.consumer = make_consumer(
            settings, group_id, self.kinds, on_assign=self._on_assign, on_revoke=self._on_revoke
        )
        self.producer = make_producer(settings)
        self.stats = AdvisorStats()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Where each partition assigned starts (its committed offset, or the first) and
        ends: a backlog to read before the first plan."""
        try:
            self.backlog.assigned(read_spans(consumer, partitions))
        except KafkaException as exc:  # then it plans as the records come
            log.warning("offsets of the assigned partitions unknown: %s", exc)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.backlog.revoked((tp.topic, tp.partition) for tp in partitions)

    def step(self, timeout_s: float = 1.0) -> list[Advice]:
        """One poll of up to 500 records; returns the advice published."""
        records = self.consumer.consume(500, timeout_s)
        for record in records:
            if record.error() is not None:
                log.warning("consumer: %s", record.error())
                continue
            self.stats.consumed += 1
            try:
                _, singles = decode_samples(record.value() or b"", self.kinds[record.topic() or ""])
            except SchemaError as exc:
                source = f"{record.topic()}/{record.partition()}/{record.offset()}"
                dead_letter(self.producer, self.settings, record.value(), exc, source)
                self.stats.dead_letters += 1
                continue
            for single in singles:
                self.advisor.update(single)
        if self.backlog.behind:
            pending = [TopicPartition(t, p) for t, p in self.backlog.ends]
            self.backlog.read(
                {(tp.topic, tp.partition): tp.offset for tp in self.consumer.position(pending)}
            )
        sent = [] if self.backlog.behind else self.advisor.due(time.monotonic())
        for advice in sent:
            produce(self.producer, self.settings, advice)
        if sent or self.stats.dead_letters:
            self.producer.flush(30)
        if records:
            self.consumer.commit(asynchronous=True)
        self.stats.advice += len(sent)
        self.stats.plans = self.advisor.plans
        return sent

    def run(
        self, stop: threading.Event, on_progress: Callable[[AdvisorStats], None] | None = None
    ) -> AdvisorStats:
        try:
            while not stop.is_set():
                self.step()
                if on_progress is not None:
                    on_progress(self.stats)
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        self.producer.flush(30)
        self.consumer.close()

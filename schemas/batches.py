"""Batched telemetry: one record per node per sampling interval, or per node per step.

A single-sample record carries one GPU sample or one rank's report, so a stream processor
pays its per-record cost (a Kafka record, a framework event, a JSON document) for every GPU
every second. A batch carries what one node produces at once: all its GPUs (``gpu_batch``),
all its NIC ports (``nic_batch``), its ranks' reports of one step (``step_batch``) or of one
collective (``collective_batch``). Batches travel on the same topics as their single kinds,
keyed the same way (node for node telemetry, job for rank telemetry); the single kinds stay
valid. The common fields (``ts``, ``node``, ``job``) are the batch's; an entry may carry its
own ``ts`` (a rank's step ends at its own time), else it has the batch's.

Every consumer expands a batch into the single-sample messages it stands for
(:meth:`TelemetryBatch.samples`), so detectors, tables and flags are the same either way.

Example
-------
>>> from guard.schemas import GpuSample
>>> singles = [GpuSample(ts=10.0, node="n1", gpu=i, temp_c=60.0 + i) for i in range(2)]
>>> [batch] = batch_messages(singles)
>>> batch.kind, len(batch.gpus)
('gpu_batch', 2)
>>> [m.model_dump() for m in batch.samples()] == [m.model_dump() for m in singles]
True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from .fast import fast_builder
from .messages import (
    CollectiveTiming,
    EpochSeconds,
    GpuSample,
    GuardMessage,
    Name,
    NicSample,
    StepTiming,
)

__all__ = [
    "BATCH_MODELS",
    "BATCH_MODEL_OF_KIND",
    "BATCH_OF",
    "SINGLE_OF",
    "CollectiveBatch",
    "GpuBatch",
    "NicBatch",
    "StepBatch",
    "TelemetryBatch",
    "batch_messages",
    "expand",
]

_COMMON = frozenset(GuardMessage.model_fields)
_ENTRY_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False, str_max_length=4096)
#: Most entries in one batch: a node has at most a few dozen GPUs, ports or ranks.
MAX_ENTRIES = 4096


def _entry_model(single: type[GuardMessage]) -> type[BaseModel]:
    """The per-entry model of ``single``'s batch: its own fields (not the common ones, which
    the batch carries) plus an optional ``ts`` of the entry's own."""
    fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in single.model_fields.items()
        if name not in _COMMON
    }
    fields["ts"] = (
        EpochSeconds | None,
        Field(None, description="the entry's own event time; null: the batch's ts"),
    )
    name = single.__name__.replace("Sample", "").replace("Timing", "") + "Entry"
    return create_model(name, __config__=_ENTRY_CONFIG, **fields)


GpuEntry = _entry_model(GpuSample)
NicEntry = _entry_model(NicSample)
StepEntry = _entry_model(StepTiming)
CollectiveEntry = _entry_model(CollectiveTiming)


class TelemetryBatch(GuardMessage):
    """Common behaviour of the batch kinds: which single kind, and which field holds it."""

    single: ClassVar[type[GuardMessage]]
    entries_field: ClassVar[str]

    def entries(self) -> list[BaseModel]:
        return getattr(self, self.entries_field)  # type: ignore[no-any-return]

    def samples(self) -> list[GuardMessage]:
        """The single-sample messages this batch stands for, in entry order."""
        build = _BUILDERS[self.kind]
        head = {
            "kind": SINGLE_OF[self.kind],
            "v": 1,
            "ts": None,
            "node": self.node,
            "job": self.job,
        }
        ts = self.ts
        out: list[GuardMessage] = []
        append = out.append
        for entry in self.entries():
            # key order is the field order (pydantic serialises a model's dict in its order)
            data = {**head, **entry.__dict__}
            if data["ts"] is None:
                data["ts"] = ts
            append(build(data))
        return out


class GpuBatch(TelemetryBatch):
    """All GPUs of one node at one sampling instant."""

    kind: Literal["gpu_batch"] = "gpu_batch"
    single: ClassVar[type[GuardMessage]] = GpuSample
    entries_field: ClassVar[str] = "gpus"
    gpus: list[GpuEntry] = Field(min_length=1, max_length=MAX_ENTRIES)  # type: ignore[valid-type]


class NicBatch(TelemetryBatch):
    """All NIC ports of one node at one sampling instant."""

    kind: Literal["nic_batch"] = "nic_batch"
    single: ClassVar[type[GuardMessage]] = NicSample
    entries_field: ClassVar[str] = "ports"
    ports: list[NicEntry] = Field(min_length=1, max_length=MAX_ENTRIES)  # type: ignore[valid-type]


class StepBatch(TelemetryBatch):
    """The reports of one step by the ranks on one node (key = job)."""

    kind: Literal["step_batch"] = "step_batch"
    key_field: ClassVar[str] = "job"
    single: ClassVar[type[GuardMessage]] = StepTiming
    entries_field: ClassVar[str] = "ranks"
    job: Name = Field(description="training job id")
    ranks: list[StepEntry] = Field(min_length=1, max_length=MAX_ENTRIES)  # type: ignore[valid-type]


class CollectiveBatch(TelemetryBatch):
    """One collective operation as seen by the ranks on one node (key = job)."""

    kind: Literal["collective_batch"] = "collective_batch"
    key_field: ClassVar[str] = "job"
    single: ClassVar[type[GuardMessage]] = CollectiveTiming
    entries_field: ClassVar[str] = "ranks"
    job: Name = Field(description="training job id")
    ranks: list[CollectiveEntry] = Field(min_length=1, max_length=MAX_ENTRIES)  # type: ignore[valid-type]


BATCH_MODELS: tuple[type[TelemetryBatch], ...] = (GpuBatch, NicBatch, StepBatch, CollectiveBatch)
#: single kind -> its batch kind
BATCH_OF: dict[str, str] = {
    m.single.model_fields["kind"].default: m.model_fields["kind"].default for m in BATCH_MODELS
}
#: batch kind -> its single kind
SINGLE_OF: dict[str, str] = {batch: single for single, batch in BATCH_OF.items()}
#: batch kind -> its model
BATCH_MODEL_OF_KIND: dict[str, type[TelemetryBatch]] = {
    m.model_fields["kind"].default: m for m in BATCH_MODELS
}
_BATCH_MODEL_OF: dict[str, type[TelemetryBatch]] = {
    m.single.model_fields["kind"].default: m for m in BATCH_MODELS
}
_BUILDERS = {m.model_fields["kind"].default: fast_builder(m.single) for m in BATCH_MODELS}
_ENTRY_BUILDERS = {
    kind: fast_builder(m.model_fields[m.entries_field].annotation.__args__[0])  # type: ignore[union-attr]
    for kind, m in _BATCH_MODEL_OF.items()
}


def expand(message: GuardMessage) -> list[GuardMessage]:
    """``message`` as single-sample messages: a batch's samples, else ``[message]``."""
    if isinstance(message, TelemetryBatch):
        return message.samples()
    return [message]


def _group_key(message: GuardMessage) -> tuple[Any, ...] | None:
    kind = message.kind
    if kind in ("gpu", "nic"):
        return (kind, message.node, message.job, message.ts)
    if kind == "step":
        return (kind, message.job, message.node, message.step)  # type: ignore[attr-defined]
    if kind == "collective":
        m: Any = message
        return (kind, m.job, m.node, m.comm, m.seq)
    return None


def batch_messages(messages: Iterable[GuardMessage]) -> list[GuardMessage]:
    """Group the single samples of ``messages`` (one sampling interval's worth) into
    batches: per node and instant for gpu and nic, per node and step for step, per node
    and operation for collective. Other kinds pass through. A batch takes the place of its
    last entry (its ``ts`` is the latest of its entries), so it is never sent before all
    its entries exist."""
    groups: dict[tuple[Any, ...], list[GuardMessage]] = {}
    last: dict[tuple[Any, ...], int] = {}
    out: list[tuple[int, GuardMessage | None]] = []
    for position, message in enumerate(messages):
        key = _group_key(message)
        if key is None:
            out.append((position, message))
            continue
        groups.setdefault(key, []).append(message)
        last[key] = position
    out += [(position, _make_batch(groups[key])) for key, position in last.items()]
    out.sort(key=lambda item: item[0])
    return [message for _, message in out if message is not None]


def _make_batch(group: list[GuardMessage]) -> GuardMessage:
    if len(group) == 1:
        return group[0]
    first = group[0]
    kind = first.kind
    ts = max(m.ts for m in group)
    entry = _ENTRY_BUILDERS[kind]
    entries = []
    for m in group:
        data = {k: v for k, v in m.__dict__.items() if k not in _COMMON}
        data["ts"] = None if m.ts == ts else m.ts
        entries.append(entry(data))
    model = _BATCH_MODEL_OF[kind]
    fields: dict[str, Any] = {"ts": ts, "node": first.node, "job": first.job}
    fields[model.entries_field] = entries
    return model.model_construct(**fields)

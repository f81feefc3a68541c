"""Wire contract v1: one pydantic model per message kind.

Every message is one JSON object with the common fields ``kind``, ``v``, ``ts``, ``node``
and ``job``. Unknown fields are ignored so that newer producers can add fields without
breaking older consumers; limits on strings and collections keep a hostile or broken
producer from making a worker allocate without bound.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

__all__ = [
    "ADVICE_ACTIONS",
    "ADVICE_MAX_PLAN",
    "CATEGORIES",
    "NODE_STATES",
    "SEVERITIES",
    "SEVERITY_RANK",
    "Advice",
    "AdviceAction",
    "CollectiveTiming",
    "ConnectionStat",
    "Finding",
    "Flag",
    "GpuSample",
    "GuardMessage",
    "NicSample",
    "NodeState",
    "PathAssignment",
    "StepTiming",
    "SweepCheck",
    "SweepResult",
    "WindowFeatures",
    "stable_id",
]

# Hostnames are at most 253 characters; jobs, devices and communicators get the same bound.
Name = Annotated[str, Field(min_length=1, max_length=253)]
ShortText = Annotated[str, Field(max_length=4096)]
Count = Annotated[int, Field(ge=0, le=2**64 - 1)]
Index = Annotated[int, Field(ge=0, le=1_000_000)]
Seconds = Annotated[float, Field(ge=0.0)]
EpochSeconds = Annotated[float, Field(ge=0.0, le=32503680000.0)]  # up to year 3000

Category = Literal[
    "straggler",
    "thermal",
    "power",
    "clock",
    "nic",
    "link",
    "comm_slow",
    "comm_hang",
    "gpu_error",
    "imbalance",
    "anomaly",
]
Severity = Literal["info", "warning", "critical"]
NodeStateName = Literal["healthy", "suspect", "cordoned", "sweeping", "failed", "repair"]
AdviceActionName = Literal[
    "nccl_env", "drain_uplink", "drain_rail", "route_flow", "place_ranks", "inspect_leaf"
]

# The same vocabularies as tuples, for code that iterates them.
CATEGORIES: tuple[str, ...] = get_args(Category)
SEVERITIES: tuple[str, ...] = get_args(Severity)
NODE_STATES: tuple[str, ...] = get_args(NodeStateName)
ADVICE_ACTIONS: tuple[str, ...] = get_args(AdviceActionName)
#: Planned flows listed in one advice message (~100 bytes each, well under the 1 MiB limit).
ADVICE_MAX_PLAN = 4096
#: Severity order: a higher rank is a stronger claim.
SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}


class GuardMessage(BaseModel):
    """Fields every message carries."""

    model_config = ConfigDict(
        extra="ignore",
        allow_inf_nan=False,
        frozen=False,
        str_max_length=4096,
        validate_default=False,
    )

    kind: str
    v: int = Field(1, ge=1, le=1000, description="contract version")
    ts: EpochSeconds = Field(description="event time, UNIX epoch seconds (UTC)")
    node: Name = Field(description="host name of the node the message is about")
    job: Name | None = Field(None, description="training job id, null when not known")

    #: Kafka record key field for this kind (docs/wire-contract.md).
    key_field: ClassVar[str] = "node"

    def kafka_key(self) -> bytes | None:
        value = getattr(self, self.key_field, None)
        if value is None:  # a job-level flag has no node: key it by its job
            value = self.job
        return value.encode() if value is not None else None


class GpuSample(GuardMessage):
    """One NVML sample of one GPU (all metrics optional: not every GPU supports every one)."""

    kind: Literal["gpu"] = "gpu"
    gpu: Index = Field(description="GPU index on the node")
    uuid: Name | None = None
    temp_c: float | None = Field(None, ge=-273.15, le=1000, description="core temperature, deg C")
    temp_slowdown_c: float | None = Field(
        None, ge=-273.15, le=1000, description="slowdown temperature threshold (NVML), deg C"
    )
    power_w: float | None = Field(None, ge=0, le=100_000, description="power draw, W")
    power_limit_w: float | None = Field(None, ge=0, le=100_000, description="enforced limit, W")
    sm_clock_mhz: float | None = Field(None, ge=0, le=100_000, description="SM clock, MHz")
    sm_clock_max_mhz: float | None = Field(None, ge=0, le=100_000, description="max SM clock, MHz")
    mem_clock_mhz: float | None = Field(None, ge=0, le=100_000, description="memory clock, MHz")
    util_pct: float | None = Field(None, ge=0, le=100, description="GPU utilisation, %")
    mem_util_pct: float | None = Field(None, ge=0, le=100, description="memory utilisation, %")
    clock_event_reasons: Count | None = Field(
        None,
        description="NVML clocks-event bitmask: 0x1 idle, 0x4 sw power cap, 0x8 hw slowdown, "
        "0x20 sw thermal, 0x40 hw thermal, 0x80 hw power brake",
    )
    ecc_sbe_total: Count | None = Field(None, description="cumulative single-bit ECC errors")
    ecc_dbe_total: Count | None = Field(None, description="cumulative double-bit ECC errors")
    xid: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        None, description="last Xid error in the interval"
    )
    pcie_replay_total: Count | None = Field(None, description="cumulative PCIe replays")


class NicSample(GuardMessage):
    """Cumulative counters of one NIC port, under their sysfs / ethtool names."""

    kind: Literal["nic"] = "nic"
    device: Name = Field(description="RDMA device, e.g. mlx5_0")
    port: Index = Field(description="port number on the device")
    netdev: Name | None = Field(None, description="network interface, e.g. ib0 or eth2")
    link_up: bool | None = None
    speed_gbps: float | None = Field(None, ge=0, le=100_000, description="link rate, Gb/s")
    counters: dict[Annotated[str, Field(max_length=128)], Count] = Field(
        default_factory=dict, max_length=512, description="cumulative counters"
    )


class StepTiming(GuardMessage):
    """One training iteration of one rank."""

    kind: Literal["step"] = "step"
    key_field: ClassVar[str] = "job"
    job: Name = Field(description="training job id")
    rank: Index = Field(description="global rank")
    gpu: Index | None = Field(None, description="local GPU index")
    step: Annotated[int, Field(ge=0)] = Field(description="iteration number")
    step_s: Seconds = Field(description="wall time of the iteration, s")
    compute_s: Seconds | None = Field(
        None, description="busy time before entering the step's synchronising collective(s), s"
    )
    pp_stage: Index | None = Field(None, description="pipeline stage")
    dp_rank: Index | None = Field(None, description="data-parallel rank")
    tokens: Count | None = Field(None, description="tokens processed in the iteration")


class ConnectionStat(BaseModel):
    """Transfer statistics of one connection of a collective."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    rank: Index = Field(description="peer rank")
    bytes: Count = Field(description="bytes moved on this connection")
    duration_s: Seconds = Field(description="transfer time on this connection, s")


class CollectiveTiming(GuardMessage):
    """One rank's view of one collective operation."""

    kind: Literal["collective"] = "collective"
    key_field: ClassVar[str] = "job"
    job: Name = Field(description="training job id")
    rank: Index = Field(description="global rank")
    comm: Name = Field(description="communicator id")
    op: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        description="allreduce, allgather, reducescatter, broadcast, send, recv, ..."
    )
    seq: Annotated[int, Field(ge=0)] = Field(description="sequence number within the communicator")
    bytes: Count = Field(description="payload size, bytes")
    arrive_ts: EpochSeconds = Field(description="when this rank entered the op, epoch s")
    end_ts: EpochSeconds | None = Field(None, description="when it left; null while running")
    peers: list[ConnectionStat] | None = Field(None, max_length=65_536)


class Flag(GuardMessage):
    """A detector's finding. ``node`` null: about the job as a whole; never triggers a sweep."""

    kind: Literal["flag"] = "flag"
    node: Name | None = None  # type: ignore[assignment]
    id: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        description="stable id: the same evidence gives the same id"
    )
    gpu: Index | None = None
    device: Name | None = None
    rank: Index | None = None
    detector: Annotated[str, Field(min_length=1, max_length=128)]
    category: Category
    severity: Severity
    score: float = Field(description="detector-specific strength of the finding")
    evidence: dict[str, JsonValue] = Field(default_factory=dict, max_length=256)
    window_s: Seconds | None = Field(None, description="length of the evidence window, s")

    @property
    def is_claim(self) -> bool:
        """Warning and critical flags claim a node (or link) is at fault; info flags observe."""
        return self.severity != "info"


class Finding(GuardMessage):
    """A detector's raw finding on its way to fusion (internal topic ``guard.findings``).

    Job-level detectors find stragglers on nodes that another partition's fusion owns, so
    findings cross partitions: keyed by the node they are about (``job:<id>`` when ``node``
    is null). ``since`` is when the evidence began (part of the flag's stable id); ``clear``
    withdraws an earlier finding on the same component. Anyone who can produce to the topic
    can write to it: it is validated like any other kind.
    """

    kind: Literal["finding"] = "finding"
    node: Name | None = None  # type: ignore[assignment]
    detector: Annotated[str, Field(min_length=1, max_length=128)]
    category: Category
    severity: Severity
    since: EpochSeconds = Field(description="event time at which the evidence began")
    score: float = Field(description="detector-specific strength")
    gpu: Index | None = None
    device: Name | None = None
    rank: Index | None = None
    window_s: Seconds | None = Field(None, description="length of the evidence window, s")
    evidence: dict[str, JsonValue] = Field(default_factory=dict, max_length=256)
    clear: bool = Field(False, description="withdraws an earlier finding on the component")

    def kafka_key(self) -> bytes | None:
        return (self.node if self.node is not None else f"job:{self.job or ''}").encode()


#: GPUs in one ``window_features`` message: a node has at most a few dozen.
WINDOW_MAX_GPUS = 4096
#: Features of one window (the GPU feed has four).
WINDOW_MAX_FEATURES = 32


class WindowFeatures(GuardMessage):
    """A node's GPUs over one event-time window, as its job's river model reads them (internal
    topic ``guard.findings``, key ``anomaly:<job>``).

    Each feature is a GPU's window mean against its siblings on the node (a difference in
    degrees, a ratio for power and clocks) or a node-level rate, one value per GPU in the order
    of ``gpus``. The job's model scores the windows of all its nodes. ``ts`` is
    the newest sample in the window; the window is ``[window * window_s, (window + 1) *
    window_s)``.
    """

    kind: Literal["window_features"] = "window_features"
    job: Name = Field(description="the job whose model scores the window")
    window: Annotated[int, Field(ge=0, le=2**40)] = Field(
        description="window number: its start is window * window_s"
    )
    window_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(description="window length, s")
    gpus: list[Index] = Field(max_length=WINDOW_MAX_GPUS, description="the GPUs, in order")
    features: dict[Annotated[str, Field(min_length=1, max_length=64)], list[float]] = Field(
        max_length=WINDOW_MAX_FEATURES, description="feature -> one value per GPU of gpus"
    )

    key_field: ClassVar[str] = "job"

    @field_validator("features")
    @classmethod
    def _one_value_per_gpu(cls, value: dict[str, list[float]], info: Any) -> dict[str, list[float]]:
        gpus = info.data.get("gpus")
        if gpus is not None and any(len(v) != len(gpus) for v in value.values()):
            raise ValueError("every feature needs one value per GPU of gpus")
        return value

    def kafka_key(self) -> bytes | None:
        return f"anomaly:{self.job}".encode()


class SweepCheck(BaseModel):
    """One check of a sweep, with its verdict."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    value: float | None = None
    unit: Annotated[str, Field(max_length=32)] = ""
    baseline: float | None = None
    passed: bool
    detail: ShortText = ""


class SweepResult(GuardMessage):
    """Outcome of a single-node or multi-node sweep of ``node``."""

    kind: Literal["sweep"] = "sweep"
    id: Annotated[str, Field(min_length=1, max_length=128)]
    sweep: Literal["single", "multi"]
    peers: list[Name] = Field(default_factory=list, max_length=1024)
    checks: list[SweepCheck] = Field(default_factory=list, max_length=1024)
    passed: bool


class NodeState(GuardMessage):
    """A node-health state transition (compacted topic: the latest per node wins)."""

    kind: Literal["node_state"] = "node_state"
    state: NodeStateName
    prev: NodeStateName | None = None
    reason: ShortText = ""
    actor: Annotated[str, Field(max_length=128)] = ""

    @field_validator("reason", mode="before")
    @classmethod
    def _null_reason_is_empty(cls, value: Any) -> Any:
        return "" if value is None else value


class PathAssignment(BaseModel):
    """One planned flow: a queue pair of a connection on a rail, and the spine it should use."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    src: Name
    dst: Name
    rail: Index
    qp: Index = 0
    spine: Name | None = Field(None, description="null: the flow stays on its leaf")
    ecmp_spine: Name | None = Field(None, description="the spine ECMP hashing picks")


class AdviceAction(BaseModel):
    """Something an operator can apply today, with the reason."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    action: AdviceActionName
    target: Annotated[str, Field(max_length=512)] = Field(
        description="what it applies to: the job, an uplink `leaf->spine`, a node's NIC"
    )
    value: ShortText = Field("", description="e.g. an environment setting `NAME=value`")
    why: ShortText = ""


class Advice(GuardMessage):
    """Traffic-engineering advice for a job: its path plan against ECMP and what to apply."""

    kind: Literal["advice"] = "advice"
    key_field: ClassVar[str] = "job"
    node: Name | None = None  # type: ignore[assignment]
    job: Name = Field(description="training job id")
    id: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        description="stable id: the same plan gives the same id"
    )
    topology: Name = Field(description="name of the topology the plan was made on")
    flows: Count = Field(description="inter-node flows of the job's collective pattern")
    ecmp_allreduce_s: Seconds = Field(description="modelled all-reduce time under ECMP, s")
    planned_allreduce_s: Seconds = Field(description="modelled all-reduce time planned, s")
    expected_gain_pct: float = Field(
        ge=-100, le=10_000, description="all-reduce speed-up of the plan over ECMP, %"
    )
    hot_links: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=64, description="most loaded links under ECMP"
    )
    moved_flows: Count = Field(0, description="flows the plan moves off their ECMP spine")
    plan: list[PathAssignment] = Field(
        default_factory=list,
        max_length=ADVICE_MAX_PLAN,
        description=f"the moved flows (the first {ADVICE_MAX_PLAN} when there are more)",
    )
    actions: list[AdviceAction] = Field(default_factory=list, max_length=256)


def stable_id(*parts: object) -> str:
    """A short, stable id from evidence parts: the same parts always give the same id.

    >>> stable_id("peer_straggler", "node-7", 3, 1700000000.0) == stable_id(
    ...     "peer_straggler", "node-7", 3, 1700000000.0)
    True
    >>> len(stable_id("thermal", "node-7"))
    24
    """
    text = "\x1f".join("" if p is None else _canonical(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _canonical(part: object) -> str:
    if isinstance(part, float):
        return repr(part) if math.isfinite(part) else "nan"
    return str(part)

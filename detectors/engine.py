"""The detectors of one key: what the core (:mod:`~guard.detectors.core`) keeps per node and job.

State is partitioned the way Kafka partitions the telemetry (docs/architecture.md):

* :class:`NodeDetectors` — one per **node** (``gpu`` and ``nic`` messages, key ``node``):
  GPU sampling rounds (:class:`~guard.detectors.gpu_round.GpuRound`), thermal, power, clock,
  GPU-error and NIC rules, and the node's half of the river feed: its GPUs' window features
  against their siblings (:class:`~guard.detectors.peer_anomaly.GpuWindows`), which the core
  sends to the job's model (:class:`~guard.detectors.peer_anomaly.GpuJobAnomaly`, in the
  fusion table under ``anomaly:<job>``);
* :class:`JobDetectors` — one per **job** (``step`` and ``collective`` messages, key
  ``job``): peer straggler, C4D collective homogeneity, step-time regression, and the job's
  river model per stage (:class:`~guard.detectors.peer_anomaly.RankPeerAnomaly`);
* the **fabric** (:class:`~guard.detectors.fabric.FabricHotSpotDetector`, ``fabric`` on):
  ``nic`` samples of many nodes, compared with their rail's and leaf's peers; hot spots are
  ``info`` observations (never a claim). The core keeps one per input partition (key
  :func:`fabric_key`), so it compares the nodes of that partition.

Each is a small, picklable object with the detectors' three verbs
(:class:`~guard.detectors.findings.Detector`): ``update(message)``, ``tick(now)`` and
``flush()`` return findings. :class:`~guard.detectors.core.DetectionCore` routes messages to
them, keeps their clocks and fuses their findings; every runner goes through it.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.engine import NodeDetectors
>>> node = NodeDetectors("n1")
>>> found = []
>>> for t in range(6):
...     for g in range(8):
...         found += node.update(GpuSample(ts=100.0 + 10 * t + 0.01 * g, node="n1", gpu=g,
...                                        temp_c=60.0, xid=48 if (g == 3 and t == 2) else None))
>>> [(f.node, f.gpu, f.category, f.severity) for f in found]
[('n1', 3, 'gpu_error', 'critical')]

"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from guard.schemas import CollectiveTiming, GpuSample, GuardMessage, NicSample, StepTiming
from guard.schemas.topology import Topology

from .clocks import ClockDetector
from .collective import CollectiveHomogeneityDetector
from .fabric import FabricHotSpotDetector
from .findings import Detector, Finding
from .gpu_errors import GpuErrorDetector
from .gpu_round import GpuColumns, Rounds
from .gpu_step import judge_rounds, update_gpus
from .job_columns import CollectiveColumns, StepColumns
from .nic import NicColumns, NicDetector, update_nics
from .peer_anomaly import GpuJobAnomaly, GpuWindows, PeerAnomalyDetector, RankPeerAnomaly
from .peer_straggler import PeerStragglerDetector
from .power import PowerDetector
from .step_regression import StepRegressionDetector
from .thermal import ThermalDetector

__all__ = [
    "FABRIC_KEY",
    "EngineConfig",
    "JobDetectors",
    "NodeDetectors",
    "fabric_detector",
    "fabric_key",
]

#: Key prefix of a streams worker's fabric partition (``fabric_key(partition)``); a control
#: character, so no node name the agents send looks like it.
FABRIC_KEY = "\x1dfabric:"


@dataclass(frozen=True)
class EngineConfig:
    """Switches of the engine (detector thresholds live in each detector's defaults)."""

    tick_s: float = 5.0
    node_telemetry: bool = True
    stragglers: bool = True
    collectives: bool = True
    step_regression: bool = True
    #: the river models (info findings only: corroboration, never a claim)
    peer_anomaly: bool = True
    #: fabric hot spots (info only) over the NIC congestion counters of many nodes
    fabric: bool = True
    detector_args: dict[str, dict[str, object]] = field(default_factory=dict)
    #: the ``[fabric] topology`` file's fabric; None: leaves inferred (``nodes_per_leaf``)
    topology: Topology | None = field(default=None, compare=False)
    nodes_per_leaf: int = 32

    @classmethod
    def from_mapping(
        cls,
        settings: Mapping[str, Any],
        topology: Topology | None = None,
        nodes_per_leaf: int = 32,
    ) -> EngineConfig:
        """The engine's configuration from the ``[detectors]`` settings (switches,
        ``ignore_xids``, ``info_xids`` and ``args``: detector name -> keyword arguments)
        and the ``[fabric]`` topology (None: inferred with ``nodes_per_leaf``).

        >>> cfg = EngineConfig.from_mapping({"ignore_xids": [94],
        ...                                  "args": {"thermal": {"limit_c": 88}}})
        >>> cfg.detector_args
        {'thermal': {'limit_c': 88}, 'gpu_errors': {'ignore_xids': [94]}}
        >>> EngineConfig.from_mapping({"args": {"thermal": {"limit": 88}}})
        Traceback (most recent call last):
        ValueError: detectors.args.thermal: no setting 'limit'; it has clear_after, critical_c, ...
        """
        data = dict(settings)
        args = {name: dict(values) for name, values in (data.pop("args", None) or {}).items()}
        for key in ("ignore_xids", "info_xids"):
            if data.get(key) is not None:
                args.setdefault("gpu_errors", {})[key] = data.pop(key)
            data.pop(key, None)
        for name, values in args.items():
            targets = _SETTABLE.get(name)
            if targets is None:
                raise ValueError(
                    f"detectors.args.{name}: no such detector; choose from {', '.join(_SETTABLE)}"
                )
            known = {p for t in targets for p in inspect.signature(t).parameters} - _FIXED
            for key in values:
                if key not in known:
                    raise ValueError(
                        f"detectors.args.{name}: no setting {key!r}; it has "
                        f"{', '.join(sorted(known))}"
                    )
        return cls(**data, detector_args=args, topology=topology, nodes_per_leaf=nodes_per_leaf)


#: ``[detectors.args.<name>]`` -> the classes that take those keyword arguments
_SETTABLE: dict[str, tuple[Any, ...]] = {
    "thermal": (ThermalDetector,),
    "power": (PowerDetector,),
    "clocks": (ClockDetector,),
    "gpu_errors": (GpuErrorDetector,),
    "nic": (NicDetector,),
    "peer_straggler": (PeerStragglerDetector,),
    "c4d": (CollectiveHomogeneityDetector,),
    "step_regression": (StepRegressionDetector,),
    "peer_anomaly": (GpuWindows, GpuJobAnomaly, RankPeerAnomaly, PeerAnomalyDetector),
    "fabric": (FabricHotSpotDetector,),
}
_FIXED = {  # set by the engine
    "self",
    "node",
    "job",
    "args",
    "features",
    "rule",
    "nic",
    "topology",
    "nodes_per_leaf",
}


def fabric_key(partition: int) -> str:
    """The key of a streams worker's fabric state for one input partition."""
    return f"{FABRIC_KEY}{partition}"


def fabric_detector(config: EngineConfig) -> FabricHotSpotDetector:
    """The fabric hot-spot detector of ``config`` (its topology, else inferred leaves)."""
    return FabricHotSpotDetector(
        config.topology,
        nodes_per_leaf=None if config.topology is not None else config.nodes_per_leaf,
        **config.detector_args.get("fabric", {}),  # type: ignore[arg-type]
    )


class _DetectorSet:
    """A partition's detectors, ticked and flushed together in a fixed order."""

    __slots__ = ()

    def _detectors(self) -> Sequence[Any]:
        raise NotImplementedError

    def tick(self, now: float) -> list[Finding]:
        found: list[Finding] = []
        for det in self._detectors():
            found += det.tick(now)
        return found

    def flush(self) -> list[Finding]:
        found: list[Finding] = []
        for det in self._detectors():
            found += det.flush()
        return found


class NodeDetectors(_DetectorSet):
    """Node-keyed state: everything computed from one node's ``gpu`` and ``nic`` samples.

    Its GPUs' state is a few small arrays (a row per GPU: the error rules' in
    :attr:`errors`, the round rules' holds in :attr:`holds`) and the open round's samples
    as columns; the core hands a step's samples of many nodes to
    :func:`~guard.detectors.gpu_step.update_gpus` at once."""

    __slots__ = (
        "anomaly",
        "clocks",
        "errors",
        "holds",
        "job",
        "nic",
        "node",
        "open_round",
        "power",
        "thermal",
    )

    def __init__(self, node: str, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        args = cfg.detector_args
        self.node = node
        #: the job the node's GPU samples last named: a GPU sample without one is that job's
        #: (its NIC samples' jobs do not enter: which topic was read last would decide)
        self.job: str | None = None
        self.open_round = GpuColumns.empty()  # the latest sample of each GPU, not yet judged
        self.thermal = ThermalDetector(**args.get("thermal", {}))  # type: ignore[arg-type]
        self.power = PowerDetector(**args.get("power", {}))  # type: ignore[arg-type]
        self.clocks = ClockDetector(**args.get("clocks", {}))  # type: ignore[arg-type]
        self.errors = GpuErrorDetector(node, **args.get("gpu_errors", {}))  # type: ignore[arg-type]
        #: the round rules' holds of the GPUs that have any going (rows of :attr:`errors`, and
        #: their ``(HOLD_SLOTS, HOLD_FIELDS)`` states; None: none): a healthy node keeps none
        self.holds: tuple[np.ndarray, np.ndarray] | None = None
        self.nic = NicDetector(**args.get("nic", {}))  # type: ignore[arg-type]
        self.anomaly = (
            GpuWindows(**args.get("peer_anomaly", {}))  # type: ignore[arg-type]
            if cfg.peer_anomaly
            else None
        )

    def update(self, message: GuardMessage) -> list[Finding]:
        """A sample of this node (what tests and single-node tools use; the core hands in
        columns); a GPU that reports again closes the open round."""
        if message.kind == "gpu":
            if TYPE_CHECKING:
                assert isinstance(message, GpuSample)
            return update_gpus([self], np.zeros(1, dtype=np.intp), GpuColumns.of_samples([message]))
        if message.kind == "nic":
            if TYPE_CHECKING:
                assert isinstance(message, NicSample)
            found, inc = update_nics(
                [self.nic], np.zeros(1, dtype=np.intp), NicColumns.of_samples([message])
            )
            if self.anomaly is not None:
                self.anomaly.add_nic(inc.local, np.array([message.ts]), inc.errors, inc.valid)
            return found
        return []

    def flush(self) -> list[Finding]:
        """Close the open round, then flush the detectors."""
        closed, self.open_round = self.open_round, GpuColumns.empty()
        found: list[Finding] = []
        if len(closed):
            rounds = Rounds.of(closed, [list(range(len(closed)))], [0], [self.job])
            found = [f for *_, f in sorted(judge_rounds([self], rounds), key=lambda i: i[:5])]
        return found + super().flush()

    def _detectors(self) -> tuple[Any, ...]:
        """What ticks and flushes (the round rules keep nothing pending between rounds)."""
        dets: tuple[Any, ...] = (self.errors, self.nic)
        return dets if self.anomaly is None else (*dets, self.anomaly)


class JobDetectors(_DetectorSet):
    """Job-keyed state: everything computed from one job's ``step`` and ``collective`` messages."""

    __slots__ = ("anomaly", "collectives", "job", "regression", "stragglers")

    def __init__(self, job: str, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        args = cfg.detector_args
        self.job = job
        self.stragglers = (
            PeerStragglerDetector(job, **args.get("peer_straggler", {}))  # type: ignore[arg-type]
            if cfg.stragglers
            else None
        )
        self.collectives = (
            CollectiveHomogeneityDetector(job, **args.get("c4d", {}))  # type: ignore[arg-type]
            if cfg.collectives
            else None
        )
        self.regression = (
            StepRegressionDetector(job, **args.get("step_regression", {}))  # type: ignore[arg-type]
            if cfg.step_regression
            else None
        )
        self.anomaly = (
            RankPeerAnomaly(job, **args.get("peer_anomaly", {}))  # type: ignore[arg-type]
            if cfg.peer_anomaly
            else None
        )

    def update(self, message: GuardMessage) -> list[Finding]:
        """A step or collective timing of this job (what tests and single-job tools use;
        the core hands in a poll's records as columns)."""
        if isinstance(message, StepTiming):
            return self.add_steps(StepColumns.of_records([(message, [message])]))
        if isinstance(message, CollectiveTiming):
            return self.add_collectives(CollectiveColumns.of_records([(message, [message])]))
        return []

    def add_steps(self, cols: StepColumns) -> list[Finding]:
        """A poll's step reports of this job, to the detectors that read them."""
        found: list[Finding] = []
        if self.collectives is not None:
            self.collectives.observe_steps(cols)  # ranks' stages: C4D compares within them
        if self.stragglers is not None:
            found += self.stragglers.add_steps(cols)
        if self.regression is not None:
            found += self.regression.add_steps(cols)
        if self.anomaly is not None:
            found += self.anomaly.add_steps(cols)
        return found

    def add_collectives(self, cols: CollectiveColumns) -> list[Finding]:
        """A poll's collective reports of this job, to C4D."""
        return [] if self.collectives is None else self.collectives.add_collectives(cols)

    def _detectors(self) -> list[Detector[Any]]:
        dets = (self.stragglers, self.collectives, self.regression, self.anomaly)
        return [det for det in dets if det is not None]

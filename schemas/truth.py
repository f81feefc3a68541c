"""The simulator's ground truth (``guard simulate --truth TRUTH.json``) as one model.

The format is described in ``docs/simulator-truth.md``: the simulator writes it, the sweep
executor, ``guard eval``, the demo and the benchmarks read it through :class:`Truth`.

Example
-------
>>> truth = Truth(seed=1, start_ts=0.0, end_ts=3600.0, nodes=["node-000"], faults=[
...     Fault(id="f-0001", node="node-000", gpu=3, kind="slow_gpu", category="straggler",
...           onset=600.0, slowdown=0.2, pattern="degrading", detail={"ramp_s": 1200})])
>>> fault = truth.faults[0]
>>> fault.slowdown_at(0.0), fault.slowdown_at(1200.0), fault.slowdown_at(3000.0)
(0.0, 0.1, 0.2)
>>> fault.reached(truth.end_ts)  # the level it reached before the run ended
0.2
>>> fault.reaches_at(0.05)  # when it first slows its rank by 5 %
900.0
>>> Truth.model_validate_json(truth.model_dump_json()) == truth
True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

__all__ = ["Confounder", "Fault", "Job", "Remediation", "Truth", "ramped_slowdown"]


def ramped_slowdown(slowdown: float, onset: float, ramp_s: float | None, ts: float) -> float:
    """A fault's slowdown at ``ts``: ``slowdown``, or for a degrading fault (``ramp_s`` set)
    the level it has ramped up to linearly since ``onset``.

    >>> ramped_slowdown(0.2, 100.0, None, 150.0), ramped_slowdown(0.2, 100.0, 200.0, 150.0)
    (0.2, 0.05)
    """
    if not ramp_s or ramp_s <= 0:
        return slowdown
    return slowdown * min(1.0, max(0.0, ts - onset) / ramp_s)


class Fault(BaseModel):
    """One injected fault. ``end`` None: it lasts to the end of the run. ``slowdown`` is the
    fractional slowdown of the affected rank's compute or connections (0: no performance
    effect); a ``degrading`` fault reaches it after ``detail["ramp_s"]`` seconds."""

    id: str
    node: str
    gpu: int | None = None
    device: str | None = None  # NIC faults: "mlx5_<n>"
    kind: str
    category: str
    onset: float
    end: float | None = None
    slowdown: float = 0.0
    pattern: str = "steady"
    detail: dict[str, Any] = Field(default_factory=dict)

    def active(self, ts: float) -> bool:
        return self.onset <= ts and (self.end is None or ts < self.end)

    @property
    def ramp_s(self) -> float | None:
        """How long the fault takes to reach its full slowdown: ``detail["ramp_s"]``, which
        the simulator sets on ``degrading`` faults (None: full slowdown from the onset)."""
        ramp = self.detail.get("ramp_s")
        return float(ramp) if ramp else None

    def slowdown_at(self, ts: float) -> float:
        """The slowdown at ``ts`` (a degrading fault ramps up over ``detail["ramp_s"]``)."""
        return ramped_slowdown(self.slowdown, self.onset, self.ramp_s, ts)

    def reached(self, run_end: float) -> float:
        """The largest slowdown the fault reached before it (or the run) ended."""
        return self.slowdown_at(run_end if self.end is None else min(self.end, run_end))

    def reaches_at(self, level: float) -> float:
        """When the slowdown first reaches ``level``: the onset, or later on a ramp."""
        ramp = self.ramp_s
        if ramp is None or self.slowdown <= 0:
            return self.onset
        return self.onset + ramp * min(1.0, level / self.slowdown)


class Confounder(BaseModel):
    """Something that looks like trouble but is not a node fault (a checkpoint, a stall...)."""

    id: str
    kind: str
    node: str | None = None
    job: str | None = None
    start: float
    end: float
    detail: dict[str, Any] = Field(default_factory=dict)


class Job(BaseModel):
    job: str
    nodes: list[str]
    ranks: int
    pp_stages: int = 1
    step_s_nominal: float = 2.0


class Remediation(BaseModel):
    """What the run's remediation hook did: ``replaced_by`` a spare, or None (the job
    continued without the node's ranks)."""

    node: str
    job: str
    ts: float
    replaced_by: str | None = None
    restart_s: float


class Truth(BaseModel):
    """The ground truth of one simulated run (``docs/simulator-truth.md``)."""

    version: int = 1
    seed: int = 0
    start_ts: float
    end_ts: float
    nodes: list[str]
    gpus_per_node: int = 8
    jobs: list[Job] = Field(default_factory=list)
    idle_nodes: list[str] = Field(default_factory=list)
    excluded_nodes: list[str] = Field(default_factory=list)
    faults: list[Fault] = Field(default_factory=list)
    confounders: list[Confounder] = Field(default_factory=list)
    remediations: list[Remediation] = Field(default_factory=list)
    #: Each host's clock offset in seconds, as every timestamp it writes carries it (a run
    #: with ``SimConfig.clock_offset_s``); None: not recorded, and left out of the file.
    clock_offsets: dict[str, float] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A file without clock offsets reads as it did before the field existed."""
        data: dict[str, Any] = handler(self)
        if data.get("clock_offsets", 0) is None:
            del data["clock_offsets"]
        return data

    @classmethod
    def load(cls, path: str | Path) -> Truth:
        """Read a TRUTH.json file."""
        return cls.model_validate_json(Path(path).read_bytes())

    def save(self, path: str | Path) -> None:
        """Write a TRUTH.json file (what ``guard simulate --truth`` writes)."""
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")

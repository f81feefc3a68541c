"""The simulated cluster: planning, hardware and training composed into one run."""

from __future__ import annotations

import bisect
import operator
import threading
import uuid as uuid_module
from collections.abc import Iterator
from typing import Any

import numpy as np

from .config import COUNTER_INDEX as _C
from .config import NIC_COUNTERS, SimConfig
from .hardware import HardwareModel
from .scenario import ScenarioPlanner
from .training import TrainingModel

__all__ = ["ClusterSimulator"]

_first = operator.itemgetter(0)


class ClusterSimulator(ScenarioPlanner, HardwareModel, TrainingModel):
    """Simulated cluster; see :mod:`guard.agents.simulator` for the model and the API."""

    def __init__(self, config: SimConfig) -> None:
        if config.nodes < 1 or config.gpus_per_node < 1:
            raise ValueError("a simulated cluster needs at least one node and one GPU per node")
        if config.duration_s <= 0 or config.sample_interval_s <= 0:
            raise ValueError("duration_s and sample_interval_s must be positive")
        self.config = config
        self.node_names = config.node_names()
        self.start_ts = float(config.start_ts)
        self.end_ts = self.start_ts + float(config.duration_s)
        self._lock = threading.Lock()
        self._busy: np.ndarray | None = None
        self._job_of: dict[int, str] = {}
        self._pending_remediation: list[str] = []
        self._remediations: list[dict[str, Any]] = []
        self._confounders: list[dict[str, Any]] = []
        self._hiccup_ids = 0
        plan = np.random.default_rng([config.seed, 1])
        self._noise = np.random.default_rng([config.seed, 2])
        self._step_noise = np.random.default_rng([config.seed, 3])
        n, g = config.nodes, config.gpus_per_node
        self._gpu_speed = 1.0 + config.gpu_speed_sigma * plan.standard_normal((n, g))
        self._temp_offset = 2.0 * plan.standard_normal((n, g))
        self._power_offset = 1.0 + 0.03 * plan.standard_normal((n, g))
        self._phase = plan.uniform(0.05, 0.9, n)
        self._uuids = [
            [str(uuid_module.UUID(bytes=plan.bytes(16), version=4)) for _ in range(g)]
            for _ in range(n)
        ]
        self._skew = plan.uniform(-0.001, 0.001, n)
        self._jobs = self._place_jobs(plan)
        self._faults = self._plan_faults(plan)
        self._plan_confounders(plan)
        self._counters = np.zeros((n, g, len(NIC_COUNTERS)), dtype=np.int64)
        self._counters[:, :, _C["port_xmit_data"]] = plan.integers(10**9, 10**12, (n, g))
        self._counters[:, :, _C["port_rcv_data"]] = self._counters[:, :, _C["port_xmit_data"]]
        self._ecc_sbe = plan.poisson(0.3, (n, g)).astype(np.int64)
        self._ecc_dbe = np.zeros((n, g), dtype=np.int64)
        self._pcie = plan.poisson(0.5, (n, g)).astype(np.int64)
        self._temp = np.where(self._busy_mask(), 60.0, 32.0) + self._temp_offset
        self._phase_l = self._phase.tolist()
        self._skew_l = self._skew.tolist()
        self._build_steps = True
        self._templates: dict[
            int, tuple[str | None, list[dict[str, Any]], list[dict[str, Any]]]
        ] = {}
        self._rank_cache: dict[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]] = {}
        self._objects: dict[int, tuple[Any, list[Any], list[Any]]] = {}
        self._reuse_samples = False  # set by the JSONL writer only (see _sample_objects)
        self._done = False

    # --- public API ------------------------------------------------------------------------

    def remediate(self, node: str) -> None:
        """Cordon ``node``: at its job's next step a spare takes over its ranks (thread-safe)."""
        if node not in self.node_names:
            raise ValueError(f"unknown node {node!r}")
        with self._lock:
            self._pending_remediation.append(node)

    def step_times(self, job: str) -> list[tuple[float, float]]:
        """``(end_ts, step_s)`` of every step of ``job`` simulated so far."""
        for j in self._jobs:
            if j.name == job:
                return list(j.step_log)
        raise ValueError(f"unknown job {job!r}")

    def messages(self) -> Iterator[Any]:
        """Every message of the run in event-time order (GuardMessage models).

        Single use: a simulator object runs once (make a new one for a second run).
        """
        for batch in self.batches():
            yield from batch

    def batches(
        self, emit_from: float | None = None, emit_until: float | None = None
    ) -> Iterator[list[Any]]:
        """The messages of each sampling tick as one list, in event-time order.

        Simulates the whole run but builds messages only for ticks in ``[emit_from,
        emit_until)`` (default: all), which is what lets :func:`write_jsonl` split a run
        across processes by time and still write exactly the single-process bytes.
        """
        if self._done:
            raise RuntimeError("this simulator has already run; build a new ClusterSimulator")
        self._done = True
        emit_from = self.start_ts if emit_from is None else emit_from
        emit_until = self.end_ts + 1.0 if emit_until is None else emit_until
        dt = float(self.config.sample_interval_s)
        carry: list[tuple[float, Any]] = []
        t = self.start_ts
        for job in self._jobs:
            job.next_start = self.start_ts + float(self._step_noise.uniform(0, job.step_s_nominal))
        # Step messages are built a few steps ahead of the tick that yields them.
        margin = 4 * max(job.step_s_nominal for job in self._jobs) + 60 if self._jobs else 0
        while t < self.end_ts - 1e-9:
            if t >= emit_until:
                return
            tick_end = min(t + dt, self.end_ts)
            out: list[tuple[float, Any]] = []
            state = self._gpu_state(t, dt)
            self._build_steps = emit_from - margin <= t
            for job in self._jobs:
                self._run_steps(job, tick_end, state, out)
            emit = t >= emit_from
            # Out-of-order messages of the ticks just before the window arrive inside it.
            self._samples(t, dt, state, out if t >= emit_from - 10.0 else None)
            if carry:
                out.extend(carry)
                carry = []
            out.sort(key=_first)
            cut = bisect.bisect_left(out, tick_end, key=_first)
            if cut < len(out):
                carry = out[cut:]
                del out[cut:]
            if emit and out:
                yield [message for _, message in out]
            t = tick_end
        # What was still in flight at the end: only what happened before the end.
        late = [message for _, message in carry if message.ts < self.end_ts]
        if late:
            yield late

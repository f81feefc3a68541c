"""The simulated cluster: planning, hardware and training composed into one run."""

from __future__ import annotations

import bisect
import operator
import uuid as uuid_module
from collections.abc import Iterator
from typing import Any

import numpy as np

from guard.schemas.truth import Truth

from .config import GPU_COMPUTE_KINDS, SimConfig, chassis_temp_offsets
from .hardware import HardwareModel
from .scenario import Scenario
from .training import TrainingModel

__all__ = ["ClusterSimulator"]

_first = operator.itemgetter(0)


class ClusterSimulator:
    """Simulated cluster; see :mod:`guard.agents.simulator` for the model and the API.

    Composed of the run's :class:`Scenario` (the plan), a :class:`HardwareModel` (GPU and
    NIC physics, samples) and a :class:`TrainingModel` (steps, collectives, remediation),
    each drawing from its own random stream: planning, noise and step noise.
    """

    def __init__(self, config: SimConfig) -> None:
        if config.nodes < 1 or config.gpus_per_node < 1:
            raise ValueError("a simulated cluster needs at least one node and one GPU per node")
        if config.duration_s <= 0 or config.sample_interval_s <= 0:
            raise ValueError("duration_s and sample_interval_s must be positive")
        if config.job_lifetime_s < 0 or config.job_gap_s < 0 or config.warmup_steps < 0:
            raise ValueError("job_lifetime_s, job_gap_s and warmup_steps must be >= 0")
        if config.hot_idle_nodes < 0:
            raise ValueError("hot_idle_nodes must be >= 0")
        if config.job_lifetime_s > 0 and config.fabric is not None:
            raise ValueError("job churn (job_lifetime_s) does not run with a multi-path fabric")
        if not 0 <= config.clock_offset_s < config.duration_s:
            raise ValueError("clock_offset_s must be >= 0 (and shorter than the run)")
        self.config = config
        plan = np.random.default_rng([config.seed, 1])
        noise = np.random.default_rng([config.seed, 2])
        step_noise = np.random.default_rng([config.seed, 3])
        n, g = config.nodes, config.gpus_per_node
        # The planning stream's draws, in their fixed order (the same seed, the same bytes).
        gpu_speed = 1.0 + config.gpu_speed_sigma * plan.standard_normal((n, g))
        temp_offset = chassis_temp_offsets(plan, n, g)
        power_offset = 1.0 + 0.03 * plan.standard_normal((n, g))
        phase = plan.uniform(0.05, 0.9, n)
        uuids = [
            [str(uuid_module.UUID(bytes=plan.bytes(16), version=4)) for _ in range(g)]
            for _ in range(n)
        ]
        skew = plan.uniform(-0.001, 0.001, n)
        self.scenario = Scenario(config, plan, skew, np.random.default_rng([config.seed, 7]))
        if config.clock_offset_s > 0:  # its own stream: the planning stream draws what it did
            offsets = np.random.default_rng([config.seed, 8]).uniform(
                -config.clock_offset_s, config.clock_offset_s, n
            )
            self.scenario.set_clock_offsets(offsets)
        if config.hot_idle_nodes > 0:  # its own stream, as the clock offsets
            self.scenario.plan_hot_idle(np.random.default_rng([config.seed, 10]))
        self.hardware = HardwareModel(
            self.scenario, plan, noise, (temp_offset, power_offset), phase, uuids
        )
        #: each GPU's own speed factor (nodes x GPUs; 1 + N(0, gpu_speed_sigma)): a fault's
        #: slowdown multiplies its GPU's compute on top of it
        self.gpu_speed = gpu_speed
        self.training = TrainingModel(
            self.scenario, step_noise, gpu_speed, np.random.default_rng([config.seed, 9])
        )
        self.node_names = self.scenario.node_names
        self.start_ts = self.scenario.start_ts
        self.end_ts = self.scenario.end_ts
        self._done = False

    # --- public API ------------------------------------------------------------------------

    def remediate(self, node: str) -> None:
        """Cordon ``node``: at its job's next step a spare takes over its ranks (thread-safe)."""
        self.training.remediate(node)

    def step_times(self, job: str) -> list[tuple[float, float]]:
        """``(end_ts, step_s)`` of every step of ``job`` simulated so far."""
        for j in self.scenario.jobs:
            if j.name == job:
                return list(j.step_log)
        raise ValueError(f"unknown job {job!r}")

    def truth(self) -> Truth:
        """Ground truth in the format of ``docs/simulator-truth.md`` (plus ``remediations``)."""
        return self.scenario.truth(self.training.remediations)

    def slowdowns_seen(self, truth: Truth) -> dict[str, float]:
        """Per fault id, the slowdown its job sees against its peers: for a fault on one
        GPU's compute, that GPU's own speed x ``1 + reached`` - 1 (a fast GPU that turns 6 %
        slower can end up only 3 % behind the fleet's median GPU); any other fault, what it
        reached. The target set of ``guard eval`` is the faults a job sees at >= 5 %.

        >>> from guard.agents.simulator import FaultSpec
        >>> sim = ClusterSimulator(SimConfig(nodes=2, duration_s=60, random_faults=0,
        ...     faults=[FaultSpec("slow_gpu", node="node-000", gpu=1, onset_s=10, slowdown=0.06,
        ...     pattern="steady")]))
        >>> [seen] = sim.slowdowns_seen(sim.truth()).values()
        >>> bool(abs(seen - (sim.gpu_speed[0, 1] * 1.06 - 1)) < 1e-9)
        True
        """
        node_index = {name: i for i, name in enumerate(self.node_names)}
        seen: dict[str, float] = {}
        for fault in truth.faults:
            reached = fault.reached(truth.end_ts)
            if fault.kind in GPU_COMPUTE_KINDS and fault.gpu is not None and reached > 0:
                speed = float(self.gpu_speed[node_index[fault.node], fault.gpu])
                reached = max(0.0, speed * (1.0 + reached) - 1.0)
            seen[fault.id] = reached
        return seen

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
        jobs = self.scenario.jobs
        self.training.start()
        # Step messages are built a few steps ahead of the tick that yields them.
        margin = 4 * max(job.step_s_nominal for job in jobs) + 60 if jobs else 0
        while t < self.end_ts - 1e-9:
            if t >= emit_until:
                return
            tick_end = min(t + dt, self.end_ts)
            out: list[tuple[float, Any]] = []
            state = self.hardware.gpu_state(t, dt)
            self.training.build_steps = emit_from - margin <= t
            for job in jobs:
                self.training.run_steps(job, tick_end, state, out)
            emit = t >= emit_from
            # Out-of-order messages of the ticks just before the window arrive inside it.
            self.hardware.samples(t, dt, state, out if t >= emit_from - 10.0 else None)
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

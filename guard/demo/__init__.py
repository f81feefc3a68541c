"""``guard demo``: the whole pipeline on a simulated cluster, under one command.

An embedded Tansu broker (or the broker ``GUARD_KAFKA_BOOTSTRAP`` names), chDB in this
process, a simulated cluster with injected faults and confounders replayed at a speed-up
through the same producer path as a node agent, ``guard streams`` workers (subprocesses),
the ClickHouse sink and the sweep orchestrator. When the orchestrator cordons a node the
simulator swaps a spare in (the job restarts from its checkpoint), so the run shows the
effect of remediation against a counterfactual run of the same seed without it.

:mod:`~guard.demo.pipeline` runs the parts (also used by the end-to-end test and the
benchmarks); :mod:`~guard.demo.report` summarizes and renders; :mod:`~guard.demo.run` ties
them together with progress.
"""

from __future__ import annotations

from .pipeline import DEFAULT_FAULTS, DemoConfig, Pipeline, worker_env
from .run import run_demo

__all__ = ["DEFAULT_FAULTS", "DemoConfig", "Pipeline", "run_demo", "worker_env"]

"""A chDB database filled by a real pipeline run, for the dashboards' SQL.

A simulated cluster (faults, confounders) goes through the detection engine (what the
streams run), the sweep orchestrator (dry-run scheduler, sweeps answered from the
simulator's truth) and the sink's store code (``guard.store.insert_messages``), so every
table holds what a live run leaves: telemetry, flags, node states, passed and failed sweeps,
and the gpu_1m rollup fed by its materialized view.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.config import Settings, load_settings
from guard.evaluation.backtest import make_detector
from guard.planning.advice import JobPatterns, advise
from guard.schemas import Advice, Flag, GuardMessage
from guard.schemas.topology import infer_topology
from guard.store import insert_messages, migrate
from guard.sweeps import DryRunScheduler, SimulatedSweepExecutor
from guard.sweeps.orchestrator import Orchestrator

DURATION_S = 600.0
TICK_S = 5


@dataclass
class FilledStore:
    client: Any
    settings: Settings
    start_ts: float
    end_ts: float
    messages: list[GuardMessage]

    @property
    def database(self) -> str:
        return self.settings.clickhouse.database


def _orchestrate(settings: Settings, sim: ClusterSimulator, flags: list[Flag]) -> list[Any]:
    """The orchestrator over the flags in event time, ticking every TICK_S simulated seconds."""
    now = [sim.start_ts]
    out: list[Any] = []
    # Nodes in repair hold their places under the cordon cap and no one repairs these: let a
    # third of the 12 nodes be out, so that every fault's sweep (passed and failed) is stored.
    settings.orchestrator.max_cordoned_fraction = 1 / 3
    orchestrator = Orchestrator(
        settings.orchestrator,
        scheduler=DryRunScheduler(sim.node_names),
        executor=SimulatedSweepExecutor.from_truth(sim.truth()),
        publish=out.append,
        clock=lambda: now[0],
        nodes=sim.node_names,
        inline_sweeps=True,
    )
    pending = sorted(flags, key=lambda f: f.ts)
    i = 0
    for tick in range(int(sim.start_ts), int(sim.end_ts) + 600, TICK_S):
        while i < len(pending) and pending[i].ts <= tick:
            orchestrator.handle_flag(pending[i])
            i += 1
        now[0] = float(tick)
        orchestrator.tick()
    orchestrator.close()
    return out


def _advice(telemetry: list[GuardMessage], ts: float) -> list[Advice]:
    """C4P advice for the simulated jobs on an inferred fabric of 4-node pods."""
    seen = JobPatterns()
    for m in telemetry:
        seen.update(m)
    jobs = seen.patterns()
    everyone = sorted({node for job in jobs for node in job.nodes})
    return advise(infer_topology(everyone, rails=8, nodes_per_leaf=4, spines=4), jobs, ts)


@pytest.fixture(scope="module")
def filled_store(chdb_client: Any) -> Iterator[FilledStore]:
    settings = load_settings(clickhouse={"database": f"graf_{uuid.uuid4().hex[:10]}"})
    # Recent event times: the tables' TTL drops rows older than 30 days on insert.
    start = float(int(time.time() - DURATION_S - 300))
    # Faults placed so that both sweep outcomes occur: a GPU slow for 24 s only (claimed, the
    # fault gone by its sweep: passed, released), a steady 15 % straggler and an Xid (failed
    # sweeps, repair), a link flap.
    faults = [
        FaultSpec("slow_gpu", node="node-003", gpu=2, onset_s=120, slowdown=0.15, pattern="steady"),
        FaultSpec("xid", node="node-007", onset_s=200),
        FaultSpec("link_flap", node="node-005", onset_s=150),
        FaultSpec(
            "slow_gpu",
            node="node-009",
            gpu=4,
            onset_s=100,
            end_s=124,
            slowdown=0.2,
            pattern="steady",
        ),
    ]
    config = SimConfig(
        nodes=12,
        duration_s=DURATION_S,
        seed=1,
        start_ts=start,
        sample_interval_s=2.0,
        random_faults=0,
        faults=faults,
    )
    sim = ClusterSimulator(config)
    telemetry = list(sim.messages())
    engine = make_detector("guard")
    flags: list[Flag] = []
    for message in telemetry:
        flags.extend(engine.update(message))
    flags.extend(engine.flush())
    control = _orchestrate(settings, sim, flags)
    migrate(chdb_client, settings)
    messages = [*telemetry, *flags, *control, *_advice(telemetry, sim.end_ts - 60)]
    for offset in range(0, len(messages), 20_000):  # batches, as the sink writes them
        insert_messages(chdb_client, settings, messages[offset : offset + 20_000])
    previous = chdb_client.database
    chdb_client.database = settings.clickhouse.database  # the datasource's defaultDatabase
    try:
        yield FilledStore(chdb_client, settings, sim.start_ts, sim.end_ts, messages)
    finally:
        chdb_client.database = previous
        chdb_client.command(f"DROP DATABASE IF EXISTS `{settings.clickhouse.database}`")

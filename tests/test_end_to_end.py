"""The whole loop against the real broker of the session (Apache Kafka in CI).

A simulated cluster with three faults and all the confounders goes through the streams
worker, the sink and the orchestrator; the orchestrator is stopped and replaced mid-run
and must resume from the node-state topic. Exactly the faulty nodes are flagged, swept
and sent to repair; healthy nodes stay healthy; everything is queryable in ClickHouse.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from guard.agents.simulator import FaultSpec
from guard.config import Settings
from guard.demo import DemoConfig, Pipeline


@pytest.mark.slow
def test_faults_are_flagged_swept_and_repaired_across_an_orchestrator_restart(
    settings: Settings, kafka_bootstrap: str, chdb_client: object, tmp_path: Path
) -> None:
    duration = 240.0
    config = DemoConfig(
        nodes=12,
        duration_s=duration,
        seed=11,
        faults=[
            FaultSpec("thermal_throttle", onset_s=40, slowdown=0.15),
            FaultSpec("degraded_nic", onset_s=70, slowdown=0.3),
            FaultSpec("xid", onset_s=150),
        ],
        bootstrap=kafka_bootstrap,
        home=tmp_path,
    )
    settings.clickhouse.dsn = None
    # its own database: other tests of the session write flags into the session's chDB too
    settings.clickhouse.database = f"e2e_{uuid.uuid4().hex[:10]}"
    settings.streams.app_id = "e2e-streams"
    settings.clickhouse.batch_seconds = 0.5
    # The three faulty nodes stay in repair (no one repairs them) and hold their places under
    # the cordon cap: 3 of 12 must fit.
    settings.orchestrator.max_cordoned_fraction = 0.25
    pipe = Pipeline(settings, config)
    pipe.client_override = chdb_client  # one chDB engine per test process
    try:
        pipe.start()
        pipe.publish(until_sim_s=duration / 2)
        pipe.restart_orchestrator()  # mid-run: the new one recovers from the topic
        pipe.publish()
        assert pipe.drain(timeout_s=180), "the streams worker did not catch up"
        pipe.finish_sink()
        assert pipe.sim is not None and pipe.flag_reader is not None
        assert pipe.orchestrator is not None
        truth = pipe.sim.truth()
        faulty = {f.node for f in truth.faults}
        assert len(faulty) == 3
        claims = [f for f in pipe.flag_reader.flags if f.severity != "info" and f.node]
        assert {f.node for f in claims} == faulty, [
            (f.node, f.category, f.detector, round(f.ts - truth.start_ts)) for f in claims
        ]
        final = {node: s.state for node, s in pipe.orchestrator.core.snapshot().items()}
        assert {n for n, s in final.items() if s == "repair"} == faulty, final
        assert all(final.get(n, "healthy") == "healthy" for n in truth.nodes if n not in faulty)
        swept = {s.node for s in pipe.sweeps}
        assert swept == faulty
        assert all(not s.passed for s in pipe.sweeps if s.node in faulty)
        assert "orchestrator restarted; state recovered from the node-state topic" in pipe.events
        # The restarted orchestrator knew the nodes handled before the restart.
        before = {n for n, s in final.items() if s == "repair"}
        assert before == faulty

        client, db = pipe.client, settings.clickhouse.database

        def count(sql: str) -> int:
            return int(client.query(sql).result_rows[0][0])

        assert count(f"SELECT count() FROM `{db}`.gpu_samples") > 10_000
        assert count(f"SELECT count() FROM `{db}`.step_timings FINAL") > 1_000
        assert (
            # node claims ('' is a job-level flag, as the claims check above leaves out)
            count(
                f"SELECT countDistinct(node) FROM `{db}`.flags FINAL "
                "WHERE severity != 'info' AND node != ''"
            )
            == 3
        )
        assert count(f"SELECT countDistinct(node) FROM `{db}`.sweeps FINAL") == 3
        assert count(f"SELECT count() FROM `{db}`.node_states FINAL WHERE state = 'repair'") >= 3
        # the rollup is fed too
        assert count(f"SELECT countMerge(samples) FROM `{db}`.gpu_1m") == count(
            f"SELECT count() FROM `{db}`.gpu_samples"
        )
    finally:
        pipe.stop()

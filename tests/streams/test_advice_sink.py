"""C4P advice end to end: planned → guard.advice (real broker) → sink → chDB → dashboard panel."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.detectors.path_advice import JobPattern, advise
from guard.kafka import make_producer, produce
from guard.schemas.topology import infer_topology
from guard.streams.sink import ClickHouseSink

from ..deploy.grafana_sql import TimeRange, panel_sql

JOB_DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "dashboards" / "job.json"


def _advice_panel_sql() -> str:
    board = json.loads(JOB_DASHBOARD.read_text())
    panel = next(p for p in board["panels"] if p.get("title") == "Traffic-engineering advice (C4P)")
    return str(panel["targets"][0]["rawSql"])


def test_advice_flows_from_the_topic_to_clickhouse_and_the_panel(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.3
    nodes = [f"node-{i:02d}" for i in range(16)]
    # four pods of four nodes, four spines; two jobs striped across the pods collide under ECMP
    topology = infer_topology(nodes, rails=8, nodes_per_leaf=4, spines=4).with_capacity(
        {"pod0-rail0->spine0": 0.5}
    )
    jobs = [
        JobPattern("job-a", tuple(nodes[0::2]), 1e9),
        JobPattern("job-b", tuple(nodes[1::2]), 1e9),
    ]
    now = time.time()
    advice = advise(topology, jobs, ts=now)
    assert len(advice) == 2
    producer = make_producer(settings)
    for message in advice:
        produce(producer, settings, message)
    assert producer.flush(30) == 0

    sink = ClickHouseSink(settings, client, group_id="sink-advice")
    deadline = time.monotonic() + 60
    try:
        while (sink.stats.stored < len(advice) or sink.sealed) and time.monotonic() < deadline:
            sink.step(0.2)
    finally:
        sink.close()
    assert sink.stats.dead_letters == 0
    db = settings.clickhouse.database
    rows = client.query(
        f"SELECT job, id, flows, expected_gain_pct, length(plan), actions FROM {db}.advice FINAL "
        "ORDER BY job"
    ).result_rows
    assert [(r[0], r[1], r[2]) for r in rows] == [(a.job, a.id, a.flows) for a in advice]
    for row, sent in zip(rows, advice, strict=True):
        assert row[3] == sent.expected_gain_pct and row[4] == len(sent.plan)
        assert [a["action"] for a in row[5]] == [a.action for a in sent.actions]

    previous = client.database
    client.database = db  # the Grafana datasource's default database
    try:
        sql = panel_sql(
            _advice_panel_sql(),
            {"job": ["job-a", "job-b"]},
            TimeRange(int(now) - 60, int(now) + 60, 10),
        )
        shown = client.query(sql)
    finally:
        client.database = previous
    cols = shown.column_names
    by_job = {r[cols.index("job")]: r for r in shown.result_rows}
    assert set(by_job) == {"job-a", "job-b"}
    best = max(advice, key=lambda a: a.expected_gain_pct)
    assert best.expected_gain_pct > 0
    assert by_job[best.job][cols.index("gain_pct")] == round(best.expected_gain_pct, 1)
    assert "route_flow" in by_job[best.job][cols.index("apply")]

"""C4P advice end to end: planned (or live from collectives, ``guard advise``) → guard.advice
(real broker) → sink → chDB → dashboard panel."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.kafka import make_producer, produce
from guard.planning.advice import JobPattern, advise
from guard.schemas import Advice, CollectiveTiming, ConnectionStat, StepTiming
from guard.schemas.topology import infer_topology
from guard.streams.advisor import AdviceProducer
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
    assert "nccl_env" in by_job[best.job][cols.index("apply")]  # settable on stock NCCL


def _ring_step(job: str, ring: list[str], t: float, slow: tuple[str, str] | None) -> list[Any]:
    """Each rank's step and all-reduce of one step; rank r on ring[r], peers its neighbours."""
    out: list[Any] = []
    n = len(ring)
    for r, node in enumerate(ring):
        peers = []
        for other in ((r + 1) % n, (r - 1) % n):
            pair = {node, ring[other]}
            duration = 0.3 if slow is not None and pair == set(slow) else 0.1
            peers.append(ConnectionStat(rank=other, bytes=2.5e8, duration_s=duration))
        out.append(StepTiming(ts=t, node=node, job=job, rank=r, step=int(t), step_s=2.0))
        out.append(
            CollectiveTiming(
                ts=t, node=node, job=job, rank=r, comm=f"{job}/dp", op="allreduce",
                seq=int(t), bytes=1e9, arrive_ts=t - 0.2, end_ts=t, peers=peers,
            )
        )  # fmt: skip
    return out


def _drain(producer: AdviceProducer, want: int, sent: list[Advice]) -> None:
    deadline = time.monotonic() + 60
    while producer.stats.consumed < want and time.monotonic() < deadline:
        sent += producer.step(0.2)
    assert producer.stats.consumed == want


def test_guard_advise_turns_live_collectives_into_advice_sent_only_when_it_changes(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    """Collectives on the real broker → AdviceProducer (``guard advise``) → guard.advice →
    ClickHouseSink → chDB → the panel. A steady cluster sends each job's advice once; a
    connection turning slow re-sends that job's advice, not the other's."""
    client, settings = store
    settings.kafka = kafka_settings.kafka
    settings.clickhouse.batch_seconds = 0.3
    settings.fabric.nodes_per_leaf, settings.fabric.spines = 4, 4  # 4 pods of 4 nodes
    settings.fabric.advise_every_s = 30.0
    nodes = [f"node-{i:02d}" for i in range(16)]
    rings = {"job-a": nodes[0::2], "job-b": nodes[1::2][::-1]}  # job-b's ring runs backwards
    start = time.time() - 600
    feed = make_producer(settings)
    advisor = AdviceProducer(settings, group_id="advise-test")

    def publish(t0: float, t1: float, slow: tuple[str, str] | None = None) -> int:
        messages = [
            m
            for t in range(int(t0), int(t1), 10)
            for job, ring in rings.items()
            for m in _ring_step(job, ring, start + t, slow if job == "job-b" else None)
        ]
        for m in messages:
            produce(feed, settings, m)
        assert feed.flush(30) == 0
        return len(messages)

    sent: list[Advice] = []
    try:
        total = publish(0, 200)
        _drain(advisor, total, sent)
        # one plan, once the backlog there was at assignment had been read to its end (the
        # topics are read at their own paces: a plan before would see half a job)
        first = {a.job: a for a in sent}
        assert len(sent) == 2 and set(first) == {"job-a", "job-b"} and advisor.stats.plans == 1
        assert all(a.flows == 8 * 8 and a.topology == "inferred" for a in first.values())
        steady = len(sent)
        total += publish(200, 400)  # the same patterns: nothing new to say
        _drain(advisor, total, sent)
        assert len(sent) == steady
        total += publish(400, 600, slow=("node-05", "node-07"))
        _drain(advisor, total, sent)
        changed = sent[steady:]
        assert [a.job for a in changed] == ["job-b"]
        # the slow link's averaged ratio climbs towards 3 (0.3 s against 0.1 s) with each of
        # its updates; how many the last plan saw depends on where it fell among the consumer's
        # batches (the plan follows the watermark of both jobs' partitions; job-b's can lag)
        ratios = [
            float(h.rsplit(" x", 1)[1])
            for h in changed[-1].hot_links
            if h.startswith("observed node-05->node-07 x")
        ]
        assert len(ratios) == 1 and 1.5 <= ratios[0] <= 3.0, changed[-1].hot_links
    finally:
        advisor.close()

    sink = ClickHouseSink(settings, client, group_id="sink-advise")
    ids = {a.id for a in sent}
    deadline = time.monotonic() + 120  # a sink's first group join on a loaded machine is slow
    try:
        while (sink.stats.stored < len(sent) or sink.sealed) and time.monotonic() < deadline:
            sink.step(0.2)
    finally:
        sink.close()
    db = settings.clickhouse.database
    stored = client.query(f"SELECT id FROM {db}.advice").result_rows
    assert {r[0] for r in stored} == ids
    previous = client.database
    client.database = db
    try:
        shown = client.query(
            panel_sql(
                _advice_panel_sql(),
                {"job": ["job-a", "job-b"]},
                TimeRange(int(start), int(start) + 700, 10),
            )
        )
    finally:
        client.database = previous
    jobs = shown.column_names.index("job")
    assert {r[jobs] for r in shown.result_rows} == {"job-a", "job-b"}

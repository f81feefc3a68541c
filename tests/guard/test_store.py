"""Migrations, inserts and queries on a real ClickHouse engine (chDB, in-process)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from guard.schemas import Flag, GpuSample, NicSample, NodeState, StepTiming
from guard.store import insert_messages, migrate

from ..schemas.strategies import STRATEGIES


def test_migrate_twice_creates_every_table(store: Any) -> None:
    client, settings = store
    migrate(client, settings)  # the fixture migrated once already: idempotent
    created = migrate(client, settings)
    tables = {
        r[0]
        for r in client.query(
            "SELECT name FROM system.tables WHERE database = {db:String}",
            parameters={"db": settings.clickhouse.database},
        ).result_rows
    }
    assert set(created) <= tables
    ddl = client.command(f"SHOW CREATE TABLE {settings.clickhouse.database}.gpu_samples")
    assert "PARTITION BY toDate(ts)" in ddl and "TTL" in ddl and "DoubleDelta" in ddl


def test_every_kind_inserts_and_reads_back(store: Any) -> None:
    client, settings = store
    drawn: list = []

    @hsettings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        for strategy in STRATEGIES.values():
            drawn.extend(data.draw(strategy) for _ in range(3))

    draw()
    # Recent event times: rows older than the TTL (30 days) are dropped on insert.
    now = time.time()
    drawn = [
        m.model_copy(update={"ts": now - i, "node": f"rt-{m.kind}-{i}", "job": f"rt-job-{i}"})
        for i, m in enumerate(drawn)
    ]
    written = insert_messages(client, settings, drawn)
    assert sum(written.values()) == len(drawn)
    db = settings.clickhouse.database
    for table, n in written.items():
        count = client.query(
            f"SELECT count() FROM {db}.{table} FINAL WHERE startsWith(node, 'rt-')"
        ).result_rows[0][0]
        assert count == n, table
    gpu = next(m for m in drawn if m.kind == "gpu")
    [row] = client.query(
        "SELECT node, gpu, temp_c, ecc_dbe_total, toUnixTimestamp64Micro(ts) "
        f"FROM {db}.gpu_samples "
        "WHERE node = {node:String}",
        parameters={"node": gpu.node},
    ).result_rows
    assert row[:2] == (gpu.node, gpu.gpu)
    assert row[2] == (None if gpu.temp_c is None else pytest.approx(gpu.temp_c, rel=1e-6))
    assert row[3] == gpu.ecc_dbe_total
    assert row[4] == round(gpu.ts * 1_000_000)


def test_query_values_and_rollup(store: Any) -> None:
    client, settings = store
    db = settings.clickhouse.database
    t0 = float(int(time.time()) // 3600 * 3600 - 3600)  # within the TTL
    samples = [
        GpuSample(
            ts=t0 + s,
            node="rollup-node",
            job="j1",
            gpu=g,
            temp_c=60.0 + g,
            power_w=500.0,
            sm_clock_mhz=1980.0 - 10 * s,
            clock_event_reasons=0x20 if s == 5 else 0,
        )
        for s in range(60)
        for g in range(2)
    ]
    insert_messages(client, settings, samples)
    rows = client.query(
        f"SELECT gpu, countMerge(samples), avgMerge(temp_c_avg), min(sm_clock_mhz_min), "
        f"groupBitOr(clock_event_reasons_any) FROM {db}.gpu_1m WHERE node = 'rollup-node' "
        "GROUP BY gpu ORDER BY gpu"
    ).result_rows
    assert rows == [(0, 60, 60.0, 1980.0 - 590, 0x20), (1, 60, 61.0, 1980.0 - 590, 0x20)]
    ts = client.query(
        f"SELECT toUnixTimestamp64Micro(min(ts)) FROM {db}.gpu_samples WHERE node='rollup-node'"
    ).result_rows[0][0]
    assert ts == int(t0 * 1_000_000)


def test_duplicates_collapse_by_design(store: Any) -> None:
    client, settings = store
    db = settings.clickhouse.database
    flag = Flag(
        ts=time.time(),
        node="dup-node",
        id="flag-1",
        detector="thermal",
        category="thermal",
        severity="warning",
        score=3.0,
        evidence={"temp_c": 91},
    )
    step = StepTiming(ts=time.time(), node="dup-node", job="dup-job", rank=0, step=7, step_s=1.0)
    insert_messages(client, settings, [flag, step])
    insert_messages(client, settings, [flag, step])  # at-least-once redelivery
    assert (
        client.query(f"SELECT count() FROM {db}.flags FINAL WHERE id='flag-1'").result_rows[0][0]
        == 1
    )
    assert (
        client.query(
            f"SELECT count() FROM {db}.step_timings FINAL WHERE job='dup-job'"
        ).result_rows[0][0]
        == 1
    )
    # A retried batch with the same token is not even written twice (rollups stay right).
    nic = NicSample(
        ts=time.time(), node="dup-node", device="mlx5_0", port=1, counters={"symbol_error": 3}
    )
    state = NodeState(ts=time.time(), node="dup-node", state="cordoned", prev="suspect")
    for _ in range(2):
        insert_messages(client, settings, [nic, state], dedup_token="guard.nic/0/100-101")
    assert (
        client.query(f"SELECT count() FROM {db}.nic_samples WHERE node='dup-node'").result_rows[0][
            0
        ]
        == 1
    )
    assert (
        client.query(
            f"SELECT counters['symbol_error'] FROM {db}.nic_samples WHERE node='dup-node'"
        ).result_rows[0][0]
        == 3
    )

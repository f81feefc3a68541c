"""ClickHouse tables of Guard and the mapping from wire models to their rows.

The DDL is plain ClickHouse SQL that runs the same on chDB and on a ClickHouse server over
HTTP. Raw tables are ReplacingMergeTree keyed so that a message delivered twice (the sink
is at-least-once) collapses to one row; flags and sweeps collapse on their stable ids.
``non_replicated_deduplication_window`` lets the sink retry a batch with the same insert
deduplication token without doubling it (or the rollup fed from it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .messages import (
    GuardMessage,
)

__all__ = [
    "TABLES",
    "TABLE_BY_KIND",
    "Column",
    "Table",
    "columns_by_table",
    "ddl_statements",
    "rows_by_table",
]

TS = "DateTime64(6, 'UTC') CODEC(DoubleDelta, ZSTD(1))"
F32 = "Nullable(Float32) CODEC(ZSTD(1))"
U64 = "Nullable(UInt64) CODEC(T64, ZSTD(1))"
NAME = "LowCardinality(String)"
OPT_NAME = "LowCardinality(Nullable(String))"


def micros(ts: float | None) -> int | None:
    """Epoch seconds to DateTime64(6) ticks (clickhouse-connect writes ints as raw ticks)."""
    return None if ts is None else round(ts * 1_000_000)


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True, eq=False)  # identity hash: rows are grouped by table per message
class Table:
    name: str
    kind: str
    columns: tuple[Column, ...]
    engine: str
    order_by: str
    partition_by: str = "toDate(ts)"
    indexes: tuple[str, ...] = ()
    row: Callable[[GuardMessage], tuple[Any, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # attrgetter reads every column in one C call; only the few converted columns
        # (timestamps, nested lists, JSON) go through Python afterwards. The sink's rows/s
        # depend on this: it runs once per stored message.
        names = [c.name for c in self.columns]
        get = operator.attrgetter(*names) if len(names) > 1 else (lambda m: (getattr(m, names[0]),))
        converts = tuple((i, c.convert) for i, c in enumerate(self.columns) if c.convert)

        def row(message: GuardMessage) -> tuple[Any, ...]:
            values = get(message)
            if not converts:
                return values
            out = list(values)
            for i, conv in converts:
                out[i] = conv(out[i])
            return tuple(out)

        object.__setattr__(self, "row", row)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def column_type_names(self) -> list[str]:
        """The columns' ClickHouse types without their codecs (what an insert needs)."""
        return [c.type.split(" CODEC(")[0] for c in self.columns]

    def column_data(self, messages: list[GuardMessage]) -> list[list[Any]]:
        """``messages`` as columns in the table's column order: the same values as their
        :attr:`row` s, pivoted. Each column is one ``map`` of C getters (and the column's
        conversion), with no tuple per row and no pivot afterwards: the sink's inserts."""
        out = []
        for column in self.columns:
            values = list(map(operator.attrgetter(column.name), messages))
            if column.convert is not None:
                values = list(map(column.convert, values))
            out.append(values)
        return out

    def ddl(self, database: str, ttl_days: int) -> str:
        cols = ",\n  ".join(f"`{c.name}` {c.type}" for c in self.columns)
        idx = "".join(f",\n  {i}" for i in self.indexes)
        ttl = f"\nTTL toDateTime(ts) + INTERVAL {int(ttl_days)} DAY" if ttl_days > 0 else ""
        return (
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}` (\n  {cols}{idx}\n)\n"
            f"ENGINE = {self.engine}\nPARTITION BY {self.partition_by}\n"
            f"ORDER BY {self.order_by}{ttl}\n"
            "SETTINGS non_replicated_deduplication_window = 1000"
        )


def _common(job_type: str = OPT_NAME) -> tuple[Column, ...]:
    return (
        Column("ts", TS, convert=micros),
        Column("node", NAME),
        Column("job", job_type),
        Column("v", "UInt8"),
    )


GPU_SAMPLES = Table(
    "gpu_samples",
    "gpu",
    (
        *_common(),
        Column("gpu", "UInt16"),
        Column("uuid", OPT_NAME),
        Column("temp_c", F32),
        Column("power_w", F32),
        Column("power_limit_w", F32),
        Column("sm_clock_mhz", F32),
        Column("sm_clock_max_mhz", F32),
        Column("mem_clock_mhz", F32),
        Column("util_pct", F32),
        Column("mem_util_pct", F32),
        Column("clock_event_reasons", U64),
        Column("ecc_sbe_total", U64),
        Column("ecc_dbe_total", U64),
        Column("xid", "Nullable(UInt32)"),
        Column("pcie_replay_total", U64),
    ),
    engine="ReplacingMergeTree",
    order_by="(node, gpu, ts)",
    indexes=("INDEX job_idx job TYPE bloom_filter GRANULARITY 4",),
)

NIC_SAMPLES = Table(
    "nic_samples",
    "nic",
    (
        *_common(),
        Column("device", NAME),
        Column("port", "UInt16"),
        Column("netdev", OPT_NAME),
        Column("link_up", "Nullable(Bool)"),
        Column("speed_gbps", F32),
        Column("counters", "Map(LowCardinality(String), UInt64) CODEC(ZSTD(3))"),
    ),
    engine="ReplacingMergeTree",
    order_by="(node, device, port, ts)",
)

STEP_TIMINGS = Table(
    "step_timings",
    "step",
    (
        *_common(job_type=NAME),
        Column("rank", "UInt32"),
        Column("gpu", "Nullable(UInt16)"),
        Column("step", "UInt64"),
        Column("step_s", "Float64 CODEC(ZSTD(1))"),
        Column("compute_s", "Nullable(Float64) CODEC(ZSTD(1))"),
        Column("pp_stage", "Nullable(UInt16)"),
        Column("dp_rank", "Nullable(UInt32)"),
        Column("tokens", U64),
    ),
    engine="ReplacingMergeTree",
    order_by="(job, rank, step)",
    indexes=("INDEX node_idx node TYPE bloom_filter GRANULARITY 4",),
)

COLLECTIVE_TIMINGS = Table(
    "collective_timings",
    "collective",
    (
        *_common(job_type=NAME),
        Column("rank", "UInt32"),
        Column("comm", NAME),
        Column("op", NAME),
        Column("seq", "UInt64"),
        Column("bytes", "UInt64"),
        Column("arrive_ts", TS, convert=micros),
        Column("end_ts", "Nullable(DateTime64(6, 'UTC'))", convert=micros),
        Column(
            "peers",
            "Array(Tuple(rank UInt32, bytes UInt64, duration_s Float64))",
            convert=lambda peers: [(p.rank, p.bytes, p.duration_s) for p in peers or ()],
        ),
    ),
    engine="ReplacingMergeTree",
    order_by="(job, comm, seq, rank)",
    indexes=("INDEX node_idx node TYPE bloom_filter GRANULARITY 4",),
)

FLAGS = Table(
    "flags",
    "flag",
    (
        Column("ts", TS, convert=micros),
        Column("node", NAME, convert=lambda n: n or ""),  # '' for job-level flags
        Column("job", OPT_NAME),
        Column("v", "UInt8"),
        Column("id", "String"),
        Column("gpu", "Nullable(UInt16)"),
        Column("device", OPT_NAME),
        Column("rank", "Nullable(UInt32)"),
        Column("detector", NAME),
        Column("category", NAME),
        Column("severity", NAME),
        Column("score", "Float64"),
        Column("evidence", "String CODEC(ZSTD(3))", convert=_json),
        Column("window_s", "Nullable(Float64)"),
    ),
    engine="ReplacingMergeTree",
    order_by="(node, id)",
    partition_by="toYYYYMM(ts)",
)

SWEEPS = Table(
    "sweeps",
    "sweep",
    (
        *_common(),
        Column("id", "String"),
        Column("sweep", NAME),
        Column("peers", "Array(String)"),
        Column(
            "checks",
            "Array(Tuple(name String, value Nullable(Float64), unit String, "
            "baseline Nullable(Float64), passed Bool, detail String))",
            convert=lambda checks: [
                (c.name, c.value, c.unit, c.baseline, c.passed, c.detail) for c in checks
            ],
        ),
        Column("passed", "Bool"),
    ),
    engine="ReplacingMergeTree",
    order_by="(node, id)",
    partition_by="toYYYYMM(ts)",
)

NODE_STATES = Table(
    "node_states",
    "node_state",
    (
        *_common(),
        Column("state", NAME),
        Column("prev", OPT_NAME),
        Column("reason", "String"),
        Column("actor", NAME),
    ),
    engine="ReplacingMergeTree",
    order_by="(node, ts, state)",
    partition_by="toYYYYMM(ts)",
)

ADVICE = Table(
    "advice",
    "advice",
    (
        Column("ts", TS, convert=micros),
        Column("node", NAME, convert=lambda n: n or ""),  # '' : advice is about a job
        Column("job", NAME),
        Column("v", "UInt8"),
        Column("id", "String"),
        Column("topology", NAME),
        Column("flows", "UInt64"),
        Column("moved_flows", "UInt64"),
        Column("ecmp_allreduce_s", "Float64"),
        Column("planned_allreduce_s", "Float64"),
        Column("expected_gain_pct", "Float64"),
        Column("hot_links", "Array(String)"),
        Column(
            "plan",
            "Array(Tuple(src String, dst String, rail UInt16, qp UInt16, "
            "spine Nullable(String), ecmp_spine Nullable(String))) CODEC(ZSTD(3))",
            convert=lambda plan: [
                (p.src, p.dst, p.rail, p.qp, p.spine, p.ecmp_spine) for p in plan
            ],
        ),
        Column(
            "actions",
            "Array(Tuple(action String, target String, value String, why String))",
            convert=lambda actions: [(a.action, a.target, a.value, a.why) for a in actions],
        ),
    ),
    engine="ReplacingMergeTree",
    order_by="(job, id)",
    partition_by="toYYYYMM(ts)",
)

TABLES: tuple[Table, ...] = (
    GPU_SAMPLES,
    NIC_SAMPLES,
    STEP_TIMINGS,
    COLLECTIVE_TIMINGS,
    FLAGS,
    SWEEPS,
    NODE_STATES,
    ADVICE,
)
TABLE_BY_KIND: dict[str, Table] = {t.kind: t for t in TABLES}

# One-minute GPU rollups, fed by a materialized view from gpu_samples.
GPU_1M_DDL = """CREATE TABLE IF NOT EXISTS `{db}`.`gpu_1m` (
  `minute` DateTime('UTC'),
  `node` LowCardinality(String),
  `gpu` UInt16,
  `job` SimpleAggregateFunction(anyLast, Nullable(String)),
  `samples` AggregateFunction(count),
  `temp_c_avg` AggregateFunction(avg, Nullable(Float32)),
  `temp_c_max` SimpleAggregateFunction(max, Nullable(Float32)),
  `power_w_avg` AggregateFunction(avg, Nullable(Float32)),
  `power_w_min` SimpleAggregateFunction(min, Nullable(Float32)),
  `sm_clock_mhz_avg` AggregateFunction(avg, Nullable(Float32)),
  `sm_clock_mhz_min` SimpleAggregateFunction(min, Nullable(Float32)),
  `util_pct_avg` AggregateFunction(avg, Nullable(Float32)),
  `clock_event_reasons_any` SimpleAggregateFunction(groupBitOr, UInt64),
  `ecc_dbe_total_max` SimpleAggregateFunction(max, Nullable(UInt64)),
  `xid_max` SimpleAggregateFunction(max, Nullable(UInt32))
)
ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (node, gpu, minute){ttl}"""

GPU_1M_MV_DDL = """CREATE MATERIALIZED VIEW IF NOT EXISTS `{db}`.`gpu_1m_mv` TO `{db}`.`gpu_1m` AS
SELECT
  toStartOfMinute(ts) AS minute,
  node,
  gpu,
  anyLast(job) AS job,
  countState() AS samples,
  avgState(temp_c) AS temp_c_avg,
  max(temp_c) AS temp_c_max,
  avgState(power_w) AS power_w_avg,
  min(power_w) AS power_w_min,
  avgState(sm_clock_mhz) AS sm_clock_mhz_avg,
  min(sm_clock_mhz) AS sm_clock_mhz_min,
  avgState(util_pct) AS util_pct_avg,
  groupBitOr(ifNull(clock_event_reasons, 0)) AS clock_event_reasons_any,
  max(ecc_dbe_total) AS ecc_dbe_total_max,
  max(xid) AS xid_max
FROM `{db}`.`gpu_samples`
GROUP BY minute, node, gpu"""


def ddl_statements(database: str, ttl_days: int = 30, rollup_ttl_days: int = 365) -> list[str]:
    """Every statement of the schema, in order; each is idempotent (IF NOT EXISTS)."""
    rollup_ttl = (
        f"\nTTL minute + INTERVAL {int(rollup_ttl_days)} DAY" if rollup_ttl_days > 0 else ""
    )
    return [
        f"CREATE DATABASE IF NOT EXISTS `{database}`",
        *(t.ddl(database, ttl_days) for t in TABLES),
        GPU_1M_DDL.format(db=database, ttl=rollup_ttl),
        GPU_1M_MV_DDL.format(db=database),
    ]


def columns_by_table(messages: Iterable[GuardMessage]) -> dict[Table, tuple[int, list[list[Any]]]]:
    """Group messages per table: (rows, the columns in the table's column order)."""
    grouped: dict[str, list[GuardMessage]] = {}
    for message in messages:
        grouped.setdefault(message.kind, []).append(message)
    out: dict[Table, tuple[int, list[list[Any]]]] = {}
    for kind, group in grouped.items():
        table = TABLE_BY_KIND[kind]
        out[table] = (len(group), table.column_data(group))
    return out


def rows_by_table(messages: Iterable[GuardMessage]) -> dict[Table, list[tuple[Any, ...]]]:
    """Group messages into rows per table, in the tables' column order."""
    out: dict[Table, list[tuple[Any, ...]]] = {}
    for message in messages:
        table = TABLE_BY_KIND[message.kind]
        out.setdefault(table, []).append(table.row(message))
    return out

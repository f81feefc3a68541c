"""Guard's Grafana dashboards as code (grafana-foundation-sdk), written as JSON for provisioning.

    python deploy/grafana/build.py            # (re)write deploy/grafana/dashboards/*.json
    python deploy/grafana/build.py --check    # exit 1 if a committed JSON is stale

Four dashboards over the ClickHouse tables (plugin ``grafana-clickhouse-datasource``, SQL
with its macros ``$__timeFilter``, ``$__timeInterval``, ``$__toTime``, ``$__interval_s``) plus
Prometheus panels for what only the services' metrics know (consumer lag, dead letters,
latencies). Every query names its datasource through a variable (``$datasource`` for
ClickHouse, ``$prometheus``) that defaults to the provisioned one, so a dashboard imported
next to other datasources can be pointed at them. Flags and cordons are annotations on every
time axis.
The rules for ``FINAL`` and ``-Merge`` are in docs/grafana.md; in short: counts and lists
read ReplacingMergeTree tables with ``FINAL`` (a message the at-least-once sink delivered
twice is one row only after a merge), the ``gpu_1m`` rollup is read with ``-Merge`` and
``GROUP BY`` (its rows are partial aggregates, one per inserted block).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import (
    heatmap,
    prometheus,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from guard.schemas import nvml_codes

HERE = Path(__file__).resolve().parent
DASHBOARD_DIR = HERE / "dashboards"

CLICKHOUSE_TYPE = "grafana-clickhouse-datasource"
PROMETHEUS_TYPE = "prometheus"
#: The provisioned datasources (provisioning/datasources/guard.yaml): the defaults of the
#: datasource variables every query goes through.
PROVISIONED = {CLICKHOUSE_TYPE: ("Guard ClickHouse", "guard-clickhouse"),
               PROMETHEUS_TYPE: ("Guard Prometheus", "guard-prometheus")}  # fmt: skip
CLICKHOUSE = dm.DataSourceRef(type_val=CLICKHOUSE_TYPE, uid="${datasource}")
PROMETHEUS = dm.DataSourceRef(type_val=PROMETHEUS_TYPE, uid="${prometheus}")

#: Node states counted against ``orchestrator.max_cordoned_fraction`` (repair is not, by default).
CAPPED_STATES = ("cordoned", "sweeping", "failed")
#: Clock-event reason bits shown on the node dashboard (idle is normal and left out).
CLOCK_REASONS = (
    ("sw_power_cap", nvml_codes.SW_POWER_CAP),
    ("hw_slowdown", nvml_codes.HW_SLOWDOWN),
    ("sw_thermal", nvml_codes.SW_THERMAL),
    ("hw_thermal", nvml_codes.HW_THERMAL),
    ("hw_power_brake", nvml_codes.HW_POWER_BRAKE),
)
NIC_ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_xmit_discards",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
)
#: Metric names the Prometheus panels use (exported by the services, guard/metrics.py).
PROMETHEUS_METRICS = (
    "guard_consumer_lag",
    "guard_streams_messages_total",
    "guard_flags_total",
    "guard_flag_latency_seconds_bucket",
    "guard_dead_letters_total",
    "guard_sink_insert_duration_seconds_bucket",
    "guard_sweeps_total",
    "guard_sweep_duration_seconds_bucket",
    "guard_cordoned_nodes",
    "guard_webhook_failures_total",
    "guard_webhook_delivery_duration_seconds_bucket",
    "guard_agent_spool_bytes",
    "guard_checkpoints_refused_total",
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "guard_build_info",
)


# --- the ClickHouse plugin's query (the SDK has no builder for this plugin) ------------------


class ClickHouseQuery(cogvariants.Dataquery):
    """A raw-SQL target of grafana-clickhouse-datasource (plugin v4 query model)."""

    def __init__(self, sql: str, ref_id: str = "A", kind: str = "timeseries") -> None:
        self.sql, self.ref_id, self.kind = sql, ref_id, kind

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": CLICKHOUSE.to_json(),
            "editorType": "sql",
            "queryType": self.kind,
            # the plugin's Format enum: 0 time series, 1 table
            "format": 0 if self.kind == "timeseries" else 1,
            "rawSql": self.sql,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClickHouseQuery:
        return cls(str(data["rawSql"]), str(data.get("refId", "A")), str(data["queryType"]))


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, sql: str, ref_id: str = "A", kind: str = "timeseries") -> None:
        self._internal = ClickHouseQuery(sql, ref_id, kind)

    def build(self) -> ClickHouseQuery:
        return self._internal


cogruntime.register_dataquery_variant(
    cogruntime.DataqueryConfig(identifier=CLICKHOUSE_TYPE, from_json_hook=ClickHouseQuery.from_json)
)


# --- SQL fragments -----------------------------------------------------------------------------


def in_var(column: str, var: str) -> str:
    """A filter on a multi-value variable: the plugin writes a selection as 'a','b',..."""
    return f"{column} IN (${var})"


NODE_GPU = f"{in_var('node', 'node')} AND {in_var('gpu', 'gpu')}"
GPU_SERIES = "concat(node, ' gpu', toString(gpu))"
NIC_SERIES = "concat(node, ' ', device, '/', toString(port))"


def quoted(names: Sequence[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


# --- panel helpers -----------------------------------------------------------------------------


def _place(panel: Any, title: str, description: str, w: int, h: int) -> Any:
    return panel.title(title).description(description).span(w).height(h)


def ts_panel(
    title: str, sql: str, unit: str, description: str, w: int = 12, bars: bool = False
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .datasource(CLICKHOUSE)
        .with_target(ClickHouseQueryBuilder(sql))
        .unit(unit)
    )
    if bars:
        panel = (
            panel.draw_style(cm.GraphDrawStyle.BARS)
            .fill_opacity(60)
            .stacking(gc.StackingConfig().mode(cm.StackingMode.NORMAL))
        )
    return _place(panel, title, description, w, 8)


def table_panel(title: str, sql: str, description: str, w: int = 24, h: int = 8) -> table.Panel:
    target = ClickHouseQueryBuilder(sql, kind="table")
    panel = table.Panel().datasource(CLICKHOUSE).with_target(target)
    return _place(panel, title, description, w, h)


def prom_panel(
    title: str, queries: Sequence[tuple[str, str]], unit: str, description: str
) -> timeseries.Panel:
    """A time series of PromQL ``queries``: (expression, legend) each, one target each (so
    series with equal label sets from different queries all show)."""
    panel = timeseries.Panel().datasource(PROMETHEUS).unit(unit)
    for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(
            prometheus.Dataquery()
            .datasource(PROMETHEUS)
            .expr(expr)
            .legend_format(legend)
            .ref_id(ref)
        )
    return _place(panel, title, description, 12, 8)


def quantiles(histogram: str, by: str, legend: str) -> list[tuple[str, str]]:
    """Median and 95th percentile of a histogram over the rate interval, by ``by``."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by})"
            f" (rate({histogram}_bucket[$__rate_interval])))",
            f"{legend} p{round(q * 100)}",
        )
        for q in (0.5, 0.95)
    ]


def datasource_var(plugin: str, name: str, label: str) -> gd.DatasourceVariable:
    text, uid = PROVISIONED[plugin]
    return (
        gd.DatasourceVariable(name)
        .label(label)
        .type(plugin)
        .current(dm.VariableOption(selected=True, text=text, value=uid))
    )


DATASOURCE_VAR = datasource_var(CLICKHOUSE_TYPE, "datasource", "ClickHouse")
PROMETHEUS_VAR = datasource_var(PROMETHEUS_TYPE, "prometheus", "Prometheus")


def multi_var(name: str, label: str, sql: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(CLICKHOUSE)
        .query(sql)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
    )


NODE_VAR = multi_var(
    "node", "node", "SELECT DISTINCT node FROM gpu_samples WHERE $__timeFilter(ts) ORDER BY node"
)
JOB_VAR = multi_var(
    "job", "job", "SELECT DISTINCT job FROM step_timings WHERE $__timeFilter(ts) ORDER BY job"
)
GPU_VAR = multi_var(
    "gpu",
    "GPU",
    "SELECT DISTINCT gpu FROM gpu_samples WHERE $__timeFilter(ts) AND node IN ($node) ORDER BY gpu",
)
CAP_VAR = (
    gd.TextBoxVariable("cap_fraction")
    .label("cordon cap (orchestrator.max_cordoned_fraction)")
    .default_value("0.05")
    .current(dm.VariableOption(selected=True, text="0.05", value="0.05"))
)


Section = tuple[str, Sequence[Any]]

#: Guard's own transitions that take a node out of the pool or put it back.
CORDON_STATES = ("cordoned", "failed", "repair")


def annotation(name: str, color: str, sql: str) -> gd.AnnotationQuery:
    """An annotation from ClickHouse: rows of ``time``, ``text`` and ``tags`` (comma-separated),
    through Grafana's standard annotation support (the plugin's query as the target)."""
    return (
        gd.AnnotationQuery()
        .name(name)
        .datasource(CLICKHOUSE)
        .enable(True)
        .icon_color(color)
        .target(ClickHouseQueryBuilder(sql, "Anno", kind="table"))
    )


def annotations(node_filter: bool) -> list[gd.AnnotationQuery]:
    """Claims (warning and critical flags) and Guard's cordons and releases, on every time
    axis of a dashboard; only the selected nodes' where the dashboard selects nodes."""
    nodes = f" AND {in_var('node', 'node')}" if node_filter else ""
    return [
        annotation(
            "Flags",
            "orange",
            "SELECT ts AS time,\n"
            "  concat(severity, ' ', category, ' on ', node,"
            " if(isNull(gpu), '', concat(' gpu', toString(gpu))), ': ',"
            " JSONExtractString(evidence, 'summary')) AS text,\n"
            "  concat(category, ',', severity, ',', detector) AS tags\n"
            "FROM flags FINAL WHERE $__timeFilter(ts) AND severity != 'info' AND node != ''"
            f"{nodes}\nORDER BY time LIMIT 1000",
        ),
        annotation(
            "Cordons and releases",
            "purple",
            "SELECT ts AS time, concat(node, ' ', ifNull(prev, '?'), ' -> ', state, ': ', reason)"
            " AS text,\n  concat(state, ',', actor) AS tags\n"
            "FROM node_states FINAL WHERE $__timeFilter(ts)\n"
            f"  AND (state IN ({quoted(CORDON_STATES)})"
            f" OR (state = 'healthy' AND prev IN ({quoted(CAPPED_STATES)}))){nodes}\n"
            "ORDER BY time LIMIT 1000",
        ),
    ]


def dashboard(
    uid: str, title: str, description: str, variables: Sequence[Any], sections: Sequence[Section]
) -> gd.Dashboard:
    """A dashboard of rows of panels, with links to the other dashboards (same variables)."""
    board = (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["guard"])
        .timezone("utc")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .readonly()
    )
    for variable in (DATASOURCE_VAR, *variables):  # first: the other variables query it
        board = board.with_variable(variable)
    selects_nodes = any(v.build().name == "node" for v in variables)
    for note in annotations(selects_nodes):
        board = board.annotation(note)
    for other, name in (("guard-fleet", "Fleet"), ("guard-node", "Node"), ("guard-job", "Job")):
        if other != uid:
            board = board.link(
                gd.DashboardLink(name)
                .type(dm.DashboardLinkType.LINK)
                .url(f"/d/{other}")
                .include_vars(True)
                .keep_time(True)
            )
    for row, panels in sections:
        board = board.with_row(gd.Row(row))
        for panel in panels:
            board = board.with_panel(panel)
    return board


# --- fleet -------------------------------------------------------------------------------------

#: Order of the transitions the orchestrator can make at one instant (cordon, sweep, fail and
#: repair in one tick): ties on ts are broken by it, so the latest state is the episode's last.
LIFECYCLE = ("suspect", "cordoned", "sweeping", "failed", "repair", "healthy")
CURRENT_STATE = f"""SELECT node,
    argMax(state, (ts, indexOf([{quoted(LIFECYCLE)}], state))) AS state, max(ts) AS since
  FROM node_states WHERE ts <= $__toTime GROUP BY node"""


def fleet() -> gd.Dashboard:
    return dashboard(
        "guard-fleet",
        "Guard / Fleet",
        "Node health across the cluster: states, flags, cordons against the cap, sweeps.",
        [NODE_VAR, CAP_VAR],
        [
            ("Node states", fleet_state_panels()),
            ("Flags", [flags_by("category"), flags_by("severity")]),
            ("Cordons and sweeps", [cordon_cap(), sweep_results(), time_to_detect()]),
            ("GPU errors", [gpu_errors()]),
        ],
    )


def fleet_state_panels() -> list[Any]:
    timeline = (
        statetimeline.Panel()
        .datasource(CLICKHOUSE)
        .with_target(
            ClickHouseQueryBuilder(
                "SELECT ts AS time, node, state FROM node_states FINAL\n"
                f"WHERE $__timeFilter(ts) AND {in_var('node', 'node')} ORDER BY time",
                kind="table",
            )
        )
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="partitionByValues", options={"fields": ["node"], "keepFields": False}
            )
        )
    )
    return [
        table_panel(
            "Nodes by state",
            "SELECT if(s.state = '', 'healthy', s.state) AS state, count() AS nodes\n"
            "FROM (SELECT DISTINCT node FROM gpu_samples WHERE $__timeFilter(ts)) AS n\n"
            f"LEFT JOIN ({CURRENT_STATE}) AS s USING node\n"
            "GROUP BY state ORDER BY nodes DESC",
            "Each node's latest state at the end of the range (nodes without a transition are "
            "healthy).",
            w=8,
        ),
        table_panel(
            "Nodes out of the pool",
            f"SELECT node, state, since FROM ({CURRENT_STATE})\n"
            f"WHERE state != 'healthy' AND {in_var('node', 'node')} ORDER BY since DESC",
            "Nodes whose latest state is not healthy, and since when.",
            w=16,
        ),
        _place(
            timeline,
            "Node state transitions",
            "Every state change in the range, one lane per node.",
            24,
            9,
        ),
    ]


def flags_by(column: str) -> timeseries.Panel:
    return ts_panel(
        f"Flags by {column}",
        f"SELECT $__timeInterval(ts) AS time, {column}, count() AS flags\n"
        "FROM flags FINAL WHERE $__timeFilter(ts)\n"
        f"  AND (node = '' OR {in_var('node', 'node')})\n"
        f"GROUP BY time, {column} ORDER BY time",
        "short",
        f"Flags per interval by {column} (FINAL: a flag delivered twice counts once).",
        bars=True,
    )


def cordon_cap() -> timeseries.Panel:
    capped = quoted(CAPPED_STATES)
    return ts_panel(
        "Nodes counted against the cordon cap",
        "SELECT time, out_of_pool, cap FROM (\n"
        "  SELECT $__timeInterval(ts) AS time,\n"
        f"    sum(sum(toInt32(state IN ({capped})) - toInt32(ifNull(prev, '') IN ({capped}))))"
        "\n      OVER (ORDER BY time) AS out_of_pool\n"
        "  FROM node_states FINAL WHERE ts <= $__toTime GROUP BY time) AS o\n"
        "CROSS JOIN (SELECT greatest(1, floor(${cap_fraction} * uniqExact(node))) AS cap\n"
        "  FROM gpu_samples WHERE $__timeFilter(ts)) AS c\n"
        "WHERE time >= toStartOfInterval($__fromTime, INTERVAL $__interval_s second)"
        " ORDER BY time",
        "short",
        f"Nodes {', '.join(CAPPED_STATES)} (the states the cap counts), from every transition "
        "up to the end of the range, against max(1, floor(cap_fraction x nodes seen)).",
    )


def sweep_results() -> timeseries.Panel:
    return ts_panel(
        "Sweeps passed and failed",
        "SELECT $__timeInterval(ts) AS time,\n"
        "  concat(sweep, if(passed, ' passed', ' failed')) AS result, count() AS sweeps\n"
        f"FROM sweeps FINAL WHERE $__timeFilter(ts) AND {in_var('node', 'node')}\n"
        "GROUP BY time, result ORDER BY time",
        "short",
        "Single- and multi-node sweeps finished per interval.",
        bars=True,
    )


def gpu_errors() -> table.Panel:
    return table_panel(
        "GPUs with errors in the range",
        "SELECT node, gpu, arrayStringConcat(arrayMap(x -> toString(x), groupUniqArray(xid)),"
        " ', ') AS xids,\n"
        "  max(ecc_sbe_total) - min(ecc_sbe_total) AS new_ecc_sbe,"
        " max(ecc_dbe_total) - min(ecc_dbe_total) AS new_ecc_dbe,\n"
        "  max(pcie_replay_total) - min(pcie_replay_total) AS new_pcie_replays,"
        " max(ts) AS last_sample\n"
        f"FROM gpu_samples WHERE $__timeFilter(ts) AND {in_var('node', 'node')}\n"
        "GROUP BY node, gpu\n"
        "HAVING xids != '' OR new_ecc_sbe > 0 OR new_ecc_dbe > 0 OR new_pcie_replays > 0\n"
        "ORDER BY new_ecc_dbe DESC, xids DESC, new_ecc_sbe DESC, new_pcie_replays DESC"
        " LIMIT 200",
        "Every GPU that reported an Xid, or whose ECC or PCIe replay counters grew, in the "
        "range (growth = newest minus oldest reading; a reset in the range hides it).",
    )


def time_to_detect() -> table.Panel:
    return table_panel(
        "Time to detect and to cordon",
        "SELECT c.node AS node, c.first_claim AS first_claim, c.category AS category,\n"
        "  c.evidence_s AS evidence_window_s, s.cordoned AS cordoned,\n"
        "  dateDiff('millisecond', c.first_claim, s.cordoned) / 1000 AS claim_to_cordon_s\n"
        "FROM (SELECT node, min(ts) AS first_claim, argMin(category, ts) AS category,\n"
        "        argMin(window_s, ts) AS evidence_s\n"
        "      FROM flags FINAL\n"
        "      WHERE $__timeFilter(ts) AND severity != 'info' AND node != ''"
        f" AND {in_var('node', 'node')}\n"
        "      GROUP BY node) AS c\n"
        "LEFT JOIN (SELECT node, minIf(ts, state = 'cordoned') AS cordoned FROM node_states\n"
        "           WHERE $__timeFilter(ts) GROUP BY node HAVING countIf(state = 'cordoned') > 0)"
        " AS s\n"
        "  USING node ORDER BY first_claim",
        "Per node: its first claim (warning or critical flag) in the range, how long the "
        "evidence behind it had been building (the flag's window), and how long the "
        "orchestrator took from that claim to the cordon. Time from the fault's onset needs "
        "the ground truth: `guard eval` reports it.",
        h=8,
    )


# --- node --------------------------------------------------------------------------------------


def gpu_metric(title: str, column: str, unit: str, agg: str = "avg") -> timeseries.Panel:
    return ts_panel(
        title,
        f"SELECT $__timeInterval(ts) AS time, {GPU_SERIES} AS gpu_name, {agg}({column}) AS "
        f"{column}\nFROM gpu_samples WHERE $__timeFilter(ts) AND {NODE_GPU}\n"
        "GROUP BY time, gpu_name ORDER BY time",
        unit,
        f"{agg} of {column} per GPU and interval, from the raw samples (a duplicated sample "
        "is an identical row: it moves neither avg nor min/max, so no FINAL).",
        w=8,
    )


def clock_reasons() -> timeseries.Panel:
    bits = ", ".join(str(bit) for _, bit in CLOCK_REASONS)
    names = quoted([name for name, _ in CLOCK_REASONS])
    return ts_panel(
        "Clock-event reasons",
        f"SELECT $__timeInterval(ts) AS time, concat({GPU_SERIES}, ' ', reason) AS series,\n"
        "  countIf(bitAnd(ifNull(clock_event_reasons, 0), bit) != 0) AS samples\n"
        f"FROM gpu_samples ARRAY JOIN [{bits}] AS bit, [{names}] AS reason\n"
        f"WHERE $__timeFilter(ts) AND {NODE_GPU}\n"
        "GROUP BY time, series ORDER BY time",
        "short",
        "Samples per interval with an NVML clock-event reason bit set (idle left out): "
        "thermal and hardware slowdowns are the throttles that cost step time.",
        w=12,
    )


def gpu_rollup() -> timeseries.Panel:
    return ts_panel(
        "Power and SM clock per minute (rollup)",
        "SELECT minute AS time, concat(node, ' gpu', toString(gpu)) AS gpu_name,\n"
        "  avgMerge(power_w_avg) AS power_w, min(sm_clock_mhz_min) AS sm_clock_min_mhz\n"
        f"FROM gpu_1m WHERE $__timeFilter(minute) AND {NODE_GPU}\n"
        "GROUP BY time, gpu_name ORDER BY time",
        "none",
        "From the gpu_1m AggregatingMergeTree rollup (kept a year, raw samples 30 days): "
        "-Merge and GROUP BY, its rows are partial aggregates.",
        w=12,
    )


def counter_delta(series: str, value: str, source: str, where: str, outer: str) -> str:
    """``outer`` over the per-interval increase ``d`` (over ``dt`` seconds) of a cumulative
    counter ``value`` per ``series``; a negative step is a reset or wrap (shown as 0 by
    ``greatest(d, 0)``)."""
    return (
        f"{outer} FROM (\n"
        f"  SELECT $__timeInterval(ts) AS time, {series} AS series,\n"
        f"    max({value}) AS v,\n"
        "    v - lagInFrame(v, 1, v) OVER (PARTITION BY series ORDER BY time) AS d,\n"
        "    dateDiff('second', lagInFrame(time, 1, time) OVER (PARTITION BY series ORDER BY"
        " time), time) AS dt\n"
        f"  FROM {source}\n"
        f"  WHERE {where}\n"
        "  GROUP BY time, series)\n"
    )


def nic_counter_delta(counters: Sequence[str], outer: str) -> str:
    """``outer`` over the per-interval increase of cumulative NIC counters (a map column)."""
    return counter_delta(
        f"concat({NIC_SERIES}, ' ', counter)",
        "counters[counter]",
        f"nic_samples ARRAY JOIN [{quoted(counters)}] AS counter",
        f"$__timeFilter(ts) AND {in_var('node', 'node')} AND mapContains(counters, counter)",
        outer,
    )


def gpu_counter_panel(title: str, columns: Sequence[str], description: str) -> timeseries.Panel:
    """Increase per interval of cumulative GPU counters (columns of gpu_samples), per GPU."""
    names = quoted(columns)
    return ts_panel(
        title,
        counter_delta(
            f"concat({GPU_SERIES}, ' ', counter)",
            "value",
            f"gpu_samples ARRAY JOIN [{names}] AS counter, [{', '.join(columns)}] AS value",
            f"$__timeFilter(ts) AND {NODE_GPU} AND value IS NOT NULL",
            "SELECT time, series, greatest(d, 0) AS increase",
        )
        + "ORDER BY time",
        "short",
        description,
        w=12,
    )


def xid_panel() -> timeseries.Panel:
    return ts_panel(
        "Xid errors",
        f"SELECT $__timeInterval(ts) AS time, concat({GPU_SERIES}, ' Xid ', toString(xid))"
        " AS series, count() AS samples\n"
        f"FROM gpu_samples WHERE $__timeFilter(ts) AND {NODE_GPU} AND xid IS NOT NULL\n"
        "GROUP BY time, series ORDER BY time",
        "short",
        "Samples per interval that report an Xid, by GPU and code (a sample carries the last "
        "Xid of its interval).",
        w=8,
        bars=True,
    )


def nic_panels() -> list[timeseries.Panel]:
    rate = nic_counter_delta(
        ("port_xmit_data", "port_rcv_data"),
        "SELECT time, series, greatest(d, 0) * 32 / dt / 1e9 AS gbps",
    )
    errors = nic_counter_delta(NIC_ERROR_COUNTERS, "SELECT time, series, greatest(d, 0) AS errors")
    return [
        ts_panel(
            "NIC data rates",
            rate + "WHERE dt > 0 ORDER BY time",
            "Gbits",
            "Transmit and receive rate per port: port_xmit_data / port_rcv_data count 4-byte "
            "words, so Gb/s = delta x 32 / seconds / 1e9.",
        ),
        ts_panel(
            "NIC errors",
            errors + "ORDER BY time",
            "short",
            "Increase per interval of each error counter (symbol errors, link downs, "
            "retransmission and sequence errors, discards).",
        ),
    ]


def node_tables() -> list[table.Panel]:
    return [
        table_panel(
            "Flags on the node",
            "SELECT ts AS time, node, category, severity, detector, gpu, device, rank,\n"
            "  round(score, 3) AS score, window_s,\n"
            "  JSONExtractString(evidence, 'summary') AS summary, evidence\n"
            f"FROM flags FINAL WHERE $__timeFilter(ts) AND {in_var('node', 'node')}\n"
            "ORDER BY time DESC LIMIT 500",
            "Every flag on the selected nodes: fusion's one-line evidence summary, and the "
            "evidence object itself (JSON).",
            h=9,
        ),
        table_panel(
            "Sweep history: checks against baselines",
            "SELECT ts AS time, node, sweep, passed, check.name AS check_name,\n"
            "  check.value AS value, check.baseline AS baseline, check.unit AS unit,\n"
            "  check.passed AS check_passed, check.detail AS detail\n"
            "FROM sweeps FINAL ARRAY JOIN checks AS check\n"
            f"WHERE $__timeFilter(ts) AND {in_var('node', 'node')}\n"
            "ORDER BY time DESC, check_name",
            "Each sweep's checks, one row per check: measured value, the baseline it is held "
            "to, and whether it passed.",
            h=10,
        ),
        table_panel(
            "State history",
            "SELECT ts AS time, node, prev, state, actor, reason FROM node_states FINAL\n"
            f"WHERE $__timeFilter(ts) AND {in_var('node', 'node')} ORDER BY time DESC",
            "Every state change of the selected nodes, with who made it and why.",
        ),
    ]


def node() -> gd.Dashboard:
    gpus = [
        gpu_metric("GPU temperature", "temp_c", "celsius", "max"),
        gpu_metric("GPU power", "power_w", "watt"),
        gpu_metric("SM clock", "sm_clock_mhz", "rotmhz", "min"),
        gpu_metric("GPU utilisation", "util_pct", "percent"),
        gpu_metric("Memory utilisation", "mem_util_pct", "percent"),
        xid_panel(),
        gpu_counter_panel(
            "ECC errors",
            ("ecc_sbe_total", "ecc_dbe_total"),
            "New single-bit (corrected) and double-bit (uncorrectable) ECC errors per interval "
            "and GPU: a DBE is a fault the sweep confirms; SBEs that climb foretell one.",
        ),
        gpu_counter_panel(
            "PCIe replays",
            ("pcie_replay_total",),
            "New PCIe replays per interval and GPU: a link that retransmits slows every "
            "host-device copy (a reseat or a riser, not the GPU).",
        ),
        clock_reasons(),
        gpu_rollup(),
    ]
    return dashboard(
        "guard-node",
        "Guard / Node",
        "One node: GPU telemetry with clock-event reasons, NICs, flags, sweeps, states.",
        [NODE_VAR, GPU_VAR],
        [("GPUs", gpus), ("NICs", nic_panels()), ("Flags, sweeps and states", node_tables())],
    )


# --- job ---------------------------------------------------------------------------------------

#: compute_s of each rank over the median of its peers (same job, step and pipeline stage).
COMPUTE_RATIO = f"""SELECT ts, job, rank, node,
    compute_s / median(compute_s) OVER (PARTITION BY job, step, pp_stage) AS ratio
  FROM step_timings FINAL
  WHERE $__timeFilter(ts) AND {in_var("job", "job")} AND compute_s IS NOT NULL"""

#: Per collective op and rank: how long after the first rank it arrived, in ms.
LATENESS = f"""SELECT arrive_ts, job, comm, rank, node,
    dateDiff('microsecond', min(arrive_ts) OVER (PARTITION BY job, comm, seq), arrive_ts)
      / 1000 AS late_ms
  FROM collective_timings FINAL
  WHERE $__timeFilter(arrive_ts) AND {in_var("job", "job")}"""


def job_timing_panels() -> list[Any]:
    compute_map = (
        heatmap.Panel()
        .datasource(CLICKHOUSE)
        .with_target(
            ClickHouseQueryBuilder(
                "SELECT $__timeInterval(ts) AS time,\n"
                "  concat(job, ' rank ', leftPad(toString(rank), 5, '0')) AS job_rank,"
                " avg(ratio) AS ratio\n"
                f"FROM ({COMPUTE_RATIO})\nGROUP BY time, job_rank ORDER BY time"
            )
        )
        .calculate(False)
        .title("Per-rank compute time vs peers (heatmap)")
        .description(
            "Each rank's busy time before the step's collective over its stage's median: a "
            "straggler is a row persistently above 1 (step_s is the same for every rank)."
        )
        .span(24)
        .height(12)
    )
    return [
        ts_panel(
            "Step time",
            "SELECT $__timeInterval(ts) AS time, job, median(step_s) AS median_s,"
            " max(step_s) AS max_s\n"
            f"FROM step_timings FINAL WHERE $__timeFilter(ts) AND {in_var('job', 'job')}\n"
            "GROUP BY time, job ORDER BY time",
            "s",
            "Wall step time per interval: the same on every rank of a synchronous job, so it "
            "shows the job's slowdown, not who causes it.",
        ),
        ts_panel(
            "Collective lateness",
            "SELECT toStartOfInterval(toDateTime(arrive_ts), INTERVAL $__interval_s second)"
            " AS time, job,\n"
            "  quantile(0.5)(late_ms) AS median_ms, max(late_ms) AS max_ms\n"
            f"FROM ({LATENESS})\nGROUP BY time, job ORDER BY time",
            "ms",
            "How long after the first rank the others enter each collective (median and "
            "last): a slow rank arrives last every time.",
        ),
        compute_map,
    ]


def job_tables() -> list[table.Panel]:
    return [
        table_panel(
            "Slowest ranks",
            "SELECT job, rank, any(node) AS node, round(avg(ratio), 4) AS compute_vs_peers,\n"
            "  round(quantile(0.9)(ratio), 4) AS p90\n"
            f"FROM ({COMPUTE_RATIO})\n"
            "GROUP BY job, rank ORDER BY compute_vs_peers DESC LIMIT 20",
            "Ranks by mean compute time over their peers' median in the range.",
            w=12,
        ),
        table_panel(
            "Latest arrivals at collectives",
            "SELECT job, comm, rank, any(node) AS node, round(avg(late_ms), 3) AS mean_late_ms,\n"
            "  round(max(late_ms), 3) AS max_late_ms\n"
            f"FROM ({LATENESS})\n"
            "GROUP BY job, comm, rank ORDER BY mean_late_ms DESC LIMIT 20",
            "Ranks that enter collectives last, per communicator (C4D's non-communication slow).",
            w=12,
        ),
        table_panel(
            "Straggler and imbalance flags",
            "SELECT ts AS time, job, node, rank, gpu, category, severity, detector,"
            " round(score, 4) AS score,\n"
            "  JSONExtractString(evidence, 'summary') AS summary\n"
            f"FROM flags FINAL WHERE $__timeFilter(ts) AND {in_var('job', 'job')}\n"
            "  AND category IN ('straggler', 'imbalance', 'comm_slow', 'comm_hang')\n"
            "ORDER BY time DESC LIMIT 500",
            "Job-level findings: slow ranks, stage imbalance, slow or hung communication.",
        ),
        advice_table(),
    ]


def advice_table() -> table.Panel:
    """C4P advice (guard.advice): the plan's gain over ECMP and what to apply today."""
    return table_panel(
        "Traffic-engineering advice (C4P)",
        "SELECT ts AS time, job, round(expected_gain_pct, 1) AS gain_pct,\n"
        "  round(ecmp_allreduce_s * 1000, 3) AS ecmp_ms,"
        " round(planned_allreduce_s * 1000, 3) AS planned_ms,\n"
        "  flows, length(plan) AS planned_flows, arrayStringConcat(hot_links, ', ') AS hot_links,\n"
        "  arrayStringConcat(arrayMap(a -> concat(tupleElement(a, 1), ' ', tupleElement(a, 2),"
        " ': ', tupleElement(a, 3)), actions), '; ') AS apply\n"
        f"FROM advice FINAL WHERE $__timeFilter(ts) AND {in_var('job', 'job')}\n"
        "ORDER BY time DESC LIMIT 200",
        "Path plan against ECMP hashing per job (modelled all-reduce time), the hottest links "
        "under ECMP, and the actions an operator can apply: NCCL settings, uplinks or rails "
        "to drain (docs/c4p.md).",
    )


def job() -> gd.Dashboard:
    return dashboard(
        "guard-job",
        "Guard / Job",
        "One training job: step time, per-rank compute against peers, collectives.",
        [JOB_VAR],
        [("Timing", job_timing_panels()), ("Stragglers", job_tables())],
    )


# --- Guard itself ------------------------------------------------------------------------------

STORED = (
    ("gpu", "gpu_samples"),
    ("nic", "nic_samples"),
    ("step", "step_timings"),
    ("collective", "collective_timings"),
    ("flag", "flags"),
    ("sweep", "sweeps"),
    ("node_state", "node_states"),
)


def guard_store_panels() -> list[Any]:
    per_kind = "\n  UNION ALL ".join(
        f"SELECT $__timeInterval(ts) AS time, '{kind}' AS kind FROM {name} WHERE $__timeFilter(ts)"
        for kind, name in STORED
    )
    freshness = "\nUNION ALL ".join(
        f"SELECT '{name}' AS table_name, max(ts) AS newest,"
        f" dateDiff('second', max(ts), now64()) AS age_s FROM {name}"
        for _, name in STORED
    )
    return [
        ts_panel(
            "Stored messages by kind",
            f"SELECT time, kind, count() / $__interval_s AS per_s FROM (\n  {per_kind})\n"
            "GROUP BY time, kind ORDER BY time",
            "short",
            "Messages per second by event time, as stored by the sink.",
        ),
        ts_panel(
            "Flags by detector",
            "SELECT $__timeInterval(ts) AS time, detector, count() AS flags\n"
            "FROM flags FINAL WHERE $__timeFilter(ts) GROUP BY time, detector ORDER BY time",
            "short",
            "Which detectors fire, per interval.",
            bars=True,
        ),
        table_panel(
            "Freshness of each table",
            freshness,
            "Newest event time stored in each table and its age: a growing age on the "
            "telemetry tables means the agents, the streams or the sink are behind.",
            w=12,
        ),
        table_panel(
            "Storage",
            "SELECT table AS table_name, sum(rows) AS rows,"
            " formatReadableSize(sum(bytes_on_disk)) AS on_disk,\n"
            "  count() AS active_parts\n"
            "FROM system.parts WHERE database = currentDatabase() AND active\n"
            "GROUP BY table_name ORDER BY sum(bytes_on_disk) DESC",
            "Rows, bytes and active parts per table (many small parts: the sink's batches are "
            "too small, raise clickhouse.batch_rows / batch_seconds).",
            w=12,
        ),
    ]


def guard_metric_panels() -> list[timeseries.Panel]:
    rate = "[$__rate_interval]"
    return [
        prom_panel(
            "Consumer lag",
            [("sum by (job, group, topic) (guard_consumer_lag)", "{{group}} {{topic}}")],
            "short",
            "Records each consumer group is behind the end of its topics.",
        ),
        prom_panel(
            "Messages handled",
            [(f"sum by (job, kind) (rate(guard_streams_messages_total{rate}))", "{{kind}}")],
            "short",
            "Valid telemetry messages per second the streams workers handle, by kind.",
        ),
        prom_panel(
            "Flags raised",
            [
                (
                    f"sum by (category, severity) (rate(guard_flags_total{rate}))",
                    "{{category}} {{severity}}",
                )
            ],
            "short",
            "Flags per second from the streams, by category and severity.",
        ),
        prom_panel(
            "Event to flag latency",
            quantiles("guard_flag_latency_seconds", "engine", "{{engine}}"),
            "s",
            "From a flag's event time to the worker sending it, by engine: the detectors' "
            "windows plus transport. A replay of old telemetry shows its age here.",
        ),
        prom_panel(
            "Dead letters",
            [
                (
                    f"sum by (job, reason) (increase(guard_dead_letters_total{rate}))",
                    "{{job}} {{reason}}",
                )
            ],
            "short",
            "Records sent to the dead-letter topic, by reason (a bad message, never a stop).",
        ),
        prom_panel(
            "Sink insert duration",
            quantiles("guard_sink_insert_duration_seconds", "result", "{{result}}"),
            "s",
            "One batch insert into ClickHouse (ok, or failed and retried).",
        ),
        prom_panel(
            "Sweeps, cordons and webhook failures",
            [
                (
                    f"sum by (sweep, result) (increase(guard_sweeps_total{rate}))",
                    "{{sweep}} {{result}}",
                ),
                ("sum(guard_cordoned_nodes)", "cordoned now"),
                (f"sum(increase(guard_webhook_failures_total{rate}))", "webhooks given up"),
            ],
            "short",
            "Sweeps finished by result, nodes out of the pool on suspicion now, and webhook "
            "notifications given up after every retry (three queries: their series all show).",
        ),
        prom_panel(
            "Sweep and webhook duration",
            [
                *quantiles("guard_sweep_duration_seconds", "sweep", "{{sweep}} sweep"),
                *quantiles(
                    "guard_webhook_delivery_duration_seconds", "result", "webhook {{result}}"
                ),
            ],
            "s",
            "A sweep from its start to its result, and a webhook notification from its first "
            "attempt to delivered or given up (retries included).",
        ),
        prom_panel(
            "Agent spool",
            [("sum by (instance) (guard_agent_spool_bytes)", "{{instance}}")],
            "bytes",
            "Bytes each agent holds on disk while the broker is away.",
        ),
        prom_panel(
            "Refused checkpoints",
            [(f"sum by (job) (increase(guard_checkpoints_refused_total{rate}))", "{{job}}")],
            "short",
            "Checkpoints the streams refused (forged, of another format or key): their keys "
            "started cold.",
        ),
        prom_panel(
            "Memory of each process",
            [
                (
                    'sum by (job, instance) (process_resident_memory_bytes{job=~"guard-.*"})',
                    "{{instance}}",
                )
            ],
            "bytes",
            "Resident memory of each Guard process (prometheus_client's process collector).",
        ),
        prom_panel(
            "CPU of each process",
            [
                (
                    "sum by (job, instance)"
                    f' (rate(process_cpu_seconds_total{{job=~"guard-.*"}}{rate}))',
                    "{{instance}}",
                )
            ],
            "short",
            "Cores each Guard process keeps busy (1: one core).",
        ),
        prom_panel(
            "Releases running",
            [("count by (version, job) (guard_build_info)", "{{job}} {{version}}")],
            "short",
            "Processes by Guard release: more than one version means a rollout in progress.",
        ),
    ]


def guard_self() -> gd.Dashboard:
    return dashboard(
        "guard-self",
        "Guard / Guard itself",
        "The pipeline's own health: from the ClickHouse tables, and from the services' "
        "Prometheus metrics (consumer lag, dead letters) that only they know.",
        [PROMETHEUS_VAR],
        [("From ClickHouse", guard_store_panels()), ("From Prometheus", guard_metric_panels())],
    )


# --- output ------------------------------------------------------------------------------------

DASHBOARDS = {"fleet": fleet, "node": node, "job": job, "guard": guard_self}


def render(make: Any) -> str:
    """The dashboard as provisioning JSON, panel ids numbered in order."""
    model = make().build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args(argv)
    stale = []
    DASHBOARD_DIR.mkdir(exist_ok=True)
    for name, make in DASHBOARDS.items():
        path = DASHBOARD_DIR / f"{name}.json"
        text = render(make)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
    if stale:
        names = ", ".join(str(p.relative_to(HERE.parent.parent)) for p in stale)
        print(f"stale: {names}; run `python deploy/grafana/build.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

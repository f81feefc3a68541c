"""The shipped Grafana dashboards: their SQL runs on chDB filled by a real run, the JSON is valid.

Every ClickHouse panel, annotation and variable query is expanded the way
grafana-clickhouse-datasource expands it (tests/deploy/grafana_sql.py) and executed; each must
return rows with at least one value. The JSON must be what deploy/grafana/build.py writes, load
into the foundation SDK's dashboard model and back unchanged (annotation targets aside: the
SDK models only the built-in Grafana annotation target, so they are checked against the
plugin's query model instead), and hold together (ids, layout, datasources, variables).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import FilledStore
from .grafana_sql import TimeRange, panel_sql, referenced_variables

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
#: Grafana's core panel types the dashboards may use.
PANEL_TYPES = {"row", "timeseries", "table", "stat", "heatmap", "state-timeline"}


def _load_builder() -> Any:
    spec = importlib.util.spec_from_file_location("guard_grafana_build", GRAFANA / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = _load_builder()


def _targets(board: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(title, target) of every panel query and every annotation query."""
    panels = [
        (panel["title"], target) for panel in board["panels"] for target in panel.get("targets", [])
    ]
    notes = [(f"annotation {a['name']}", a["target"]) for a in _annotations(board)]
    return panels + notes


def _annotations(board: dict[str, Any]) -> list[dict[str, Any]]:
    return list(board.get("annotations", {}).get("list", []))


def _datasource_vars(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board["templating"].get("list", []) if v["type"] == "datasource"}


def _clickhouse_targets(board: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (title, t["rawSql"])
        for title, t in _targets(board)
        if t["datasource"]["type"] == build.CLICKHOUSE_TYPE
    ]


def _range(store: FilledStore) -> TimeRange:
    start, end = int(store.start_ts) - 60, int(store.end_ts) + 60
    # Grafana: interval = range / max data points (about the panel's width in pixels).
    return TimeRange(start, end, max(1, round((end - start) / 600)))


def _values(store: FilledStore, board: dict[str, Any], rng: TimeRange) -> dict[str, list[str]]:
    """*All* for every query variable (every option the variable query returns)."""
    values: dict[str, Any] = {}
    for variable in board["templating"].get("list", []):
        if variable["type"] == "textbox":
            values[variable["name"]] = variable["query"]
            continue
        if variable["type"] == "datasource":  # its default: the provisioned datasource
            values[variable["name"]] = variable["current"]["value"]
            continue
        rows = store.client.query(panel_sql(variable["query"], values, rng)).result_rows
        assert rows, f"variable {variable['name']} has no options"
        values[variable["name"]] = [str(r[0]) for r in rows]
    return values


def _one_of_each(store: FilledStore) -> dict[str, list[str]]:
    """A single selection that every panel must still fill: a swept node that reported an Xid
    (a node without one rightly has no Xid bars), a flagged job.

    A multi-value variable's value is a list even with one option picked (so the plugin
    writes it quoted)."""
    q = store.client.query
    node = q(
        "SELECT node FROM sweeps FINAL"
        " WHERE node IN (SELECT node FROM gpu_samples WHERE xid IS NOT NULL)"
        " ORDER BY passed, ts LIMIT 1"
    ).result_rows[0][0]
    job = q(
        "SELECT job FROM flags FINAL WHERE category = 'straggler' AND job IS NOT NULL LIMIT 1"
    ).result_rows[0][0]
    return {"node": [node], "job": [job]}


def _assert_panels_return_rows(
    store: FilledStore, board: dict[str, Any], variables: dict[str, Any], rng: TimeRange
) -> None:
    empty = []
    for title, sql in _clickhouse_targets(board):
        rows = store.client.query(panel_sql(sql, variables, rng)).result_rows
        has_value = any(
            v is not None and not (isinstance(v, float) and math.isnan(v))
            for row in rows
            for v in row
        )
        if not rows or not has_value:
            empty.append(title)
    assert not empty, f"{board['uid']}: no rows for {empty} with {variables}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_sql_returns_rows_on_a_filled_store(
    path: Path, filled_store: FilledStore
) -> None:
    board = json.loads(path.read_text())
    rng = _range(filled_store)
    variables = _values(filled_store, board, rng)
    _assert_panels_return_rows(filled_store, board, variables, rng)
    names = {v["name"] for v in board["templating"].get("list", [])}
    chosen = {k: v for k, v in _one_of_each(filled_store).items() if k in names}
    if chosen:  # and with one node / one job picked instead of All, in 30 s buckets
        coarse = TimeRange(rng.from_s, rng.to_s, 30)
        _assert_panels_return_rows(filled_store, board, {**variables, **chosen}, coarse)


def test_the_dashboards_cover_every_table_and_the_rollup(filled_store: FilledStore) -> None:
    sql = " ".join(s for p in DASHBOARDS for _, s in _clickhouse_targets(json.loads(p.read_text())))
    tables = {
        r[0]
        for r in filled_store.client.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase()"
            " AND engine NOT LIKE 'MaterializedView'"
        ).result_rows
    }
    assert tables and all(f" {t}" in sql for t in tables), tables
    assert "avgMerge(" in sql and "FINAL" in sql


def test_the_committed_json_is_what_the_builder_writes() -> None:
    assert {p.stem for p in DASHBOARDS} == set(build.DASHBOARDS)
    for path in DASHBOARDS:
        assert path.read_text() == build.render(build.DASHBOARDS[path.stem]), (
            f"{path.name} is stale: run `python deploy/grafana/build.py`"
        )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_json_round_trips_through_the_sdk_model(path: Path) -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads(path.read_text())
    model = Dashboard.from_json(data)
    back = json.loads(json.dumps(model, cls=JSONEncoder))
    assert back.pop("annotations") and data.pop("annotations")  # (the module's docstring)
    assert back == data


def _provisioned_uids() -> set[str]:
    files = (GRAFANA / "provisioning" / "datasources").glob("*.yaml")
    return {d["uid"] for f in files for d in yaml.safe_load(f.read_text())["datasources"]}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path: Path) -> None:
    board = json.loads(path.read_text())
    assert board["uid"].startswith("guard-") and board["title"].startswith("Guard / ")
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel.get("title") and panel.get("description"), panel
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(set(refs)) == len(refs) and all(refs), panel["title"]
    uids = _provisioned_uids()
    declared = {v["name"] for v in board["templating"].get("list", [])}
    for title, target in _targets(board):
        assert_datasource_variable(board, target["datasource"], uids, title)
        if target["datasource"]["type"] == build.CLICKHOUSE_TYPE:  # the plugin's query model
            assert target["editorType"] == "sql"
            assert (target["queryType"], target["format"]) in {("timeseries", 0), ("table", 1)}
        text = target.get("rawSql") or target.get("expr")
        assert text, title
        assert referenced_variables(text) <= declared, (title, referenced_variables(text))
    for variable in board["templating"].get("list", []):
        if variable["type"] == "query":
            assert_datasource_variable(board, variable["datasource"], uids, variable["name"])
            assert referenced_variables(variable["query"]) <= declared
    for note in _annotations(board):
        assert note["datasource"] == note["target"]["datasource"], note["name"]
        assert note["enable"] and note["name"] and note["iconColor"], note


def assert_datasource_variable(
    board: dict[str, Any], ref: dict[str, str], provisioned: set[str], where: str
) -> None:
    """A query's datasource is a datasource variable of its plugin type (no fixed uid), and
    the variable defaults to a provisioned datasource."""
    name = ref["uid"].removeprefix("${").removesuffix("}")
    assert ref["uid"] == f"${{{name}}}", f"{where}: a fixed datasource uid {ref['uid']}"
    variable = _datasource_vars(board).get(name)
    assert variable is not None, f"{where}: no datasource variable ${name}"
    assert variable["query"] == ref["type"], where
    assert variable["current"]["value"] in provisioned, where


def test_prometheus_panels_use_the_listed_metrics() -> None:
    board = json.loads((GRAFANA / "dashboards" / "guard.json").read_text())
    exprs = [t["expr"] for _, t in _targets(board) if "expr" in t]
    assert exprs
    used = {m for m in build.PROMETHEUS_METRICS if any(m in e for e in exprs)}
    assert used == set(build.PROMETHEUS_METRICS)
    # `a or b` keeps only b's series whose labels a lacks: two sums without labels were one
    # series, and the webhook failures never showed. Each series gets its own query.
    assert not [e for e in exprs if " or " in e]


def test_provisioning_points_at_the_dashboards_and_the_plugin() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "guard.yaml").read_text())
    [clickhouse] = [d for d in ds["datasources"] if d["type"] == build.CLICKHOUSE_TYPE]
    assert clickhouse["uid"] == build.PROVISIONED[build.CLICKHOUSE_TYPE][1]
    [prom] = [d for d in ds["datasources"] if d["type"] == build.PROMETHEUS_TYPE]
    assert prom["uid"] == build.PROVISIONED[build.PROMETHEUS_TYPE][1]
    assert {"host", "port", "protocol", "username", "defaultDatabase"} <= set(
        clickhouse["jsonData"]
    )
    assert clickhouse["jsonData"]["protocol"] in ("http", "native")
    [provider] = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "guard.yaml").read_text()
    )["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")

"""A panel's SQL as grafana-clickhouse-datasource sends it to ClickHouse.

Two passes, as in Grafana:

1. the frontend (the plugin's ``applyTemplateVariables`` → ``templateSrv.replace`` with the
   plugin's ``format``): ``$var``, ``${var}`` and ``[[var]]`` become the variable's value; a
   multi-value selection (or *All* without an ``allValue``: every option) is written
   ``'a','b'``, a single value as it is. Grafana's own ``$__interval`` and ``$__rate_interval``
   are replaced here too; ``$__timeFilter`` & co. are not variables and pass through;
2. the backend (``pkg/macros/macros.go`` of the plugin, matched the way sqlds does:
   ``$__name`` optionally followed by ``(args)``): ``$__timeFilter(c)`` is ``c >=
   toDateTime(from) AND c <= toDateTime(to)``, ``$__timeInterval(c)`` is
   ``toStartOfInterval(toDateTime(c), INTERVAL n second)``, ``$__fromTime``/``$__toTime``
   are ``toDateTime(s)``, ``$__interval_s`` is the interval in seconds (at least 1), and so on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Grafana's variable syntax (public/app/features/variables/utils.ts, variableRegex).
VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\${(\w+)(?:\.([^:^\}]+))?(?::([^\}]+))?}")
#: Backend macros of the plugin; sqlds matches ``$__name\b`` with optional ``(args)``.
MACRO = re.compile(r"\$__(\w+)\b(?:\(([^)]*)\))?")
BACKEND_MACROS = frozenset(
    {
        "fromTime",
        "toTime",
        "fromTime_ms",
        "toTime_ms",
        "timeFilter",
        "timeFilter_ms",
        "dateFilter",
        "dateTimeFilter",
        "dt",
        "timeInterval",
        "timeInterval_ms",
        "interval_s",
    }
)


@dataclass(frozen=True)
class TimeRange:
    from_s: int
    to_s: int
    interval_s: int  # the panel's interval (Grafana: range / max data points, rounded)

    def date(self, ts: int) -> str:
        import datetime as dt

        return f"toDate('{dt.datetime.fromtimestamp(ts, dt.UTC):%Y-%m-%d}')"


def format_value(value: str | Sequence[str]) -> str:
    """The plugin's ``format``: arrays as ``'a','b'``, anything else as it is."""
    if isinstance(value, str):
        return value
    return "'" + "','".join(value) + "'"


def interpolate(sql: str, variables: Mapping[str, str | Sequence[str]], rng: TimeRange) -> str:
    """Pass 1: template variables (dashboard ones and Grafana's interval built-ins)."""
    builtins = {"__interval": f"{rng.interval_s}s", "__rate_interval": f"{4 * rng.interval_s}s"}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        if name in builtins:
            return builtins[name]
        if name in variables:
            return format_value(variables[name])
        return match.group(0)  # not a variable: a macro for the backend, or literal text

    return VARIABLE.sub(replace, sql)


def expand_macros(sql: str, rng: TimeRange) -> str:
    """Pass 2: the plugin's backend macros."""
    f, t = rng.from_s, rng.to_s
    ms = (f"fromUnixTimestamp64Milli({f * 1000})", f"fromUnixTimestamp64Milli({t * 1000})")

    def between(column: str, low: str, high: str) -> str:
        return f"{column} >= {low} AND {column} <= {high}"

    def replace(match: re.Match[str]) -> str:
        name, raw = match.group(1), match.group(2)
        if name not in BACKEND_MACROS:
            raise ValueError(f"unknown macro $__{name} in {sql!r}")
        args = [a.strip() for a in raw.split(",")] if raw else []
        if name == "fromTime":
            return f"toDateTime({f})"
        if name == "toTime":
            return f"toDateTime({t})"
        if name in ("fromTime_ms", "toTime_ms"):
            return ms[name == "toTime_ms"]
        if name == "timeFilter":
            return between(args[0], f"toDateTime({f})", f"toDateTime({t})")
        if name == "timeFilter_ms":
            return between(args[0], *ms)
        if name == "dateFilter":
            return between(args[0], rng.date(f), rng.date(t))
        if name in ("dateTimeFilter", "dt"):
            date = between(args[0], rng.date(f), rng.date(t))
            return f"({date}) AND ({between(args[1], f'toDateTime({f})', f'toDateTime({t})')})"
        if name == "timeInterval":
            return f"toStartOfInterval(toDateTime({args[0]}), INTERVAL {rng.interval_s} second)"
        if name == "timeInterval_ms":
            return (
                f"toStartOfInterval(toDateTime64({args[0]}, 3), "
                f"INTERVAL {rng.interval_s * 1000} millisecond)"
            )
        return str(max(rng.interval_s, 1))  # interval_s

    return MACRO.sub(replace, sql)


def panel_sql(sql: str, variables: Mapping[str, str | Sequence[str]], rng: TimeRange) -> str:
    """What ClickHouse receives for a panel's ``rawSql``."""
    return expand_macros(interpolate(sql, variables, rng), rng)


def referenced_variables(sql: str) -> set[str]:
    """Names written as template variables in ``sql`` (macros and built-ins excluded)."""
    names = set()
    for match in VARIABLE.finditer(sql):
        name = match.group(1) or match.group(2) or match.group(4)
        if not name.startswith("__"):
            names.add(name)
    return names

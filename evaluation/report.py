"""One self-contained HTML page of what Guard did: ``guard report``, ``guard demo --report``.

Four plotly figures on one page, with plotly.js inlined once (the page opens offline):

1. step time with and without Guard (per job; the run without is a counterfactual: the same
   simulated scenario without remediation, or any run given as the baseline), a dotted line
   at each cordon;
2. a timeline per node: its node states as bars (healthy, suspect, cordoned, sweeping,
   failed, repair), a square where each begins (states entered in the same second stack up
   in a column, so none hides another) and every warning/critical flag as a marker;
3. time to detect and to cordon per fault (from the simulator's ground truth, when there is
   one);
4. goodput: useful steps per hour with and without, and the cumulative useful steps.

Times are drawn on the wall clock (UTC date axes, the run's span), the step times and the
timeline one above the other with the same width, so their times line up.

:class:`ReportData` is plain data; :func:`from_messages` builds it from messages (JSONL
files, or rows read back from ClickHouse by the command), :func:`render_html` writes the page.

Example
-------
>>> data = ReportData(title="t", start_ts=0.0, end_ts=20.0,
...                   steps={"job-a": {"with Guard": [(2.0, 2.0), (4.0, 2.0)]}})
>>> page = render_html(data)
>>> page.count('class="plotly-graph-div"'), "<script src=" in page
(4, False)
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from guard.schemas import Flag, GuardMessage, NodeState, StepTiming
from guard.schemas.truth import Truth

from .goodput import goodput_per_hour, useful_curve
from .scoring import evaluate

__all__ = [
    "POLICY_COLORS",
    "STATE_COLORS",
    "TTD_COLORS",
    "ReportData",
    "first_cordons",
    "flag_rows",
    "from_messages",
    "render_html",
]

#: One colour per node state, the same in every plot.
STATE_COLORS = {
    "healthy": "#2ca02c",
    "suspect": "#ffbf00",
    "cordoned": "#ff7f0e",
    "sweeping": "#1f77b4",
    "failed": "#d62728",
    "repair": "#7f7f7f",
}
SEVERITY_SYMBOL = {"warning": "triangle-up", "critical": "x"}
#: One colour per run (policy), the same in every plot; jobs differ by line dash.
POLICY_COLORS = {"with Guard": "#1f77b4", "without Guard": "#7f7f7f"}
#: Time to detect (brown) and time to cordon (the cordoned state's orange) per fault.
TTD_COLORS = {"time to detect": "#8c564b", "time to cordon": STATE_COLORS["cordoned"]}
JOB_DASHES = ("solid", "dot", "dash", "dashdot", "longdash")


def _policy_color(label: str) -> str:
    return POLICY_COLORS.get(label, "#9467bd")


def _guard_on_top(run: tuple[str, Any]) -> bool:
    """Sort key: the run with Guard last, so its line is drawn over the others'."""
    return run[0] == "with Guard"


def _dash(jobs: list[str], job: str) -> str:
    return JOB_DASHES[sorted(jobs).index(job) % len(JOB_DASHES)]


Curve = list[tuple[float, float]]


def _clock(ts: float) -> str:
    """An epoch time as the x of a plotly date axis: UTC wall clock, to the millisecond (a
    naive string: plotly.js draws date strings as given, without a time zone)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _since(data: ReportData, ts: float) -> str:
    """Hover text: how far into the run ``ts`` is."""
    return f"t+{ts - data.start_ts:,.0f} s"


#: Every wall-clock axis: UTC, labelled so a reader can match it to logs and Grafana.
CLOCK_AXIS = {"type": "date", "title": "time, UTC", "hoverformat": "%H:%M:%S"}
#: The legend in a row above the plot: the plots on the clock then have the same width, so
#: their times line up down the page (a legend at the side takes what its names need).
LEGEND_ABOVE = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0}


@dataclass
class ReportData:
    """What the page shows. Times are epoch seconds, drawn as UTC wall clock; the curves'
    times in ``useful`` are seconds from ``start_ts``."""

    title: str
    start_ts: float
    end_ts: float
    #: job -> run label ("with Guard", "without Guard") -> [(end_ts, step_s)]
    steps: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    #: job -> run label -> [(s since start, cumulative useful steps)]
    useful: dict[str, dict[str, Curve]] = field(default_factory=dict)
    #: job -> run label -> useful steps per hour
    goodput: dict[str, dict[str, float]] = field(default_factory=dict)
    flags: list[dict[str, Any]] = field(default_factory=list)  # ts, node, category, severity
    states: list[dict[str, Any]] = field(default_factory=list)  # ts, node, state
    faults: list[dict[str, Any]] = field(default_factory=list)  # id, node, kind, ttd s | None
    notes: list[str] = field(default_factory=list)


def _job_steps(messages: Iterable[GuardMessage]) -> dict[str, list[tuple[float, float]]]:
    """One ``(end_ts, step_s)`` per job and step (the latest rank's report of it)."""
    per: dict[str, dict[int, tuple[float, float]]] = {}
    for m in messages:
        if isinstance(m, StepTiming) and m.job:
            seen = per.setdefault(m.job, {}).get(m.step)
            if seen is None or m.ts > seen[0]:
                per[m.job][m.step] = (m.ts, m.step_s)
    return {job: sorted(steps.values()) for job, steps in per.items()}


def flag_rows(flags: Iterable[Flag]) -> list[dict[str, Any]]:
    """The claims (warning/critical flags about a node) as the timeline's rows."""
    return [
        {
            "ts": f.ts,
            "node": f.node,
            "category": f.category,
            "severity": f.severity,
            "detector": f.detector,
        }
        for f in flags
        if f.node and f.severity != "info"
    ]


def first_cordons(states: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Every ``cordoned`` time per node, in order (to match a fault's onset to its cordon)."""
    out: dict[str, list[float]] = {}
    for s in sorted(states, key=lambda s: s["ts"]):
        if s["state"] == "cordoned":
            out.setdefault(s["node"], []).append(s["ts"])
    return out


def time_to_cordon(cordons: dict[str, list[float]], node: str, onset: float) -> float | None:
    """Seconds from ``onset`` to the node's first cordon at or after it (None: none)."""
    after = [ts for ts in cordons.get(node, []) if ts >= onset]
    return round(after[0] - onset, 1) if after else None


def from_messages(
    messages: Iterable[GuardMessage],
    baseline: Iterable[GuardMessage] = (),
    truth: Truth | None = None,
    title: str = "Guard report",
) -> ReportData:
    """The report of a run: its steps, flags and node states, a baseline run's steps (e.g.
    the same scenario simulated without remediation), and time to detect from ``truth``."""
    msgs = list(messages)
    flags = [m for m in msgs if isinstance(m, Flag)]
    states = [m for m in msgs if isinstance(m, NodeState)]
    runs = {"with Guard": _job_steps(msgs), "without Guard": _job_steps(baseline)}
    times = [m.ts for m in msgs] or [0.0]
    start = truth.start_ts if truth else min(times)
    end = truth.end_ts if truth else max(times)
    data = ReportData(title=title, start_ts=start, end_ts=end)
    for label, per_job in runs.items():
        for job, log in per_job.items():
            data.steps.setdefault(job, {})[label] = log
            data.goodput.setdefault(job, {})[label] = goodput_per_hour(log, [], start, end)
            bin_s = max(1.0, (end - start) / 200)
            data.useful.setdefault(job, {})[label] = [
                (t, float(n)) for t, n in useful_curve(log, [], start, end, bin_s)
            ]
    data.flags = flag_rows(flags)
    data.states = [{"ts": s.ts, "node": s.node, "state": s.state} for s in states]
    if truth is not None:
        ev = evaluate(truth, [f.model_dump() for f in flags])
        cordons = first_cordons(data.states)
        data.faults = [
            {
                "id": f.id,
                "node": f.node,
                "kind": f.kind,
                "ttd_s": None
                if (hit := ev.first_hit.get(f.id)) is None
                else max(0.0, hit - f.onset),
                "ttc_s": time_to_cordon(cordons, f.node, f.onset),
            }
            for f in truth.faults
        ]
    data.notes.append(
        "Goodput from telemetry alone counts completed steps per hour (a crash's redone "
        "steps are not visible in step messages)."
    )
    return data


# --- figures --------------------------------------------------------------------------------


def _with_gaps(log: list[tuple[float, float]]) -> tuple[list[Any], list[Any]]:
    """x (epoch s) and y of a step-time line, broken (None) where no step ended for over a
    minute: a hung or restarting job is not drawn as a straight line."""
    xs: list[Any] = []
    ys: list[Any] = []
    prev = None
    for end, step_s in log:
        if prev is not None and end - prev > max(60.0, 3 * step_s):
            xs.append(None)
            ys.append(None)
        xs.append(end)
        ys.append(step_s)
        prev = end
    return xs, ys


def _step_figure(data: ReportData) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    jobs = list(data.steps)
    for job, runs in sorted(data.steps.items()):
        for label, log in sorted(runs.items(), key=_guard_on_top):
            xs, ys = _with_gaps(log)
            fig.add_scatter(
                x=[None if x is None else _clock(x) for x in xs],
                y=ys,
                text=[None if x is None else _since(data, x) for x in xs],
                mode="lines",
                name=f"{job}, {label}",
                line={"color": _policy_color(label), "dash": _dash(jobs, job)},
            )
    # where Guard acted: a dotted line at each cordon, named by its node
    for node, times in sorted(first_cordons(data.states).items()):
        for ts in times:
            fig.add_shape(
                type="line",
                x0=_clock(ts),
                x1=_clock(ts),
                yref="paper",
                y0=0,
                y1=1,
                line={"color": STATE_COLORS["cordoned"], "dash": "dot", "width": 1.5},
            )
            fig.add_annotation(
                x=_clock(ts),
                yref="paper",
                y=1,
                yanchor="top",
                xanchor="left",
                bgcolor="rgba(255,255,255,0.7)",
                text=f"cordon {node}",
                showarrow=False,
                font={"size": 10, "color": STATE_COLORS["cordoned"]},
            )
    fig.update_layout(
        title="Step time with and without Guard (gaps: the job was down; dotted: a cordon)",
        xaxis={**CLOCK_AXIS, "range": [_clock(data.start_ts), _clock(data.end_ts)]},
        legend=LEGEND_ABOVE,
        yaxis={"title": "step time, s", "type": "log", **_log_ticks(data)},
    )
    return fig


#: Step times worth a label on the log axis (plotly's own labels 20, 30 as "2", "3").
NICE_STEP_S = (0.1, 0.2, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600)


def _log_ticks(data: ReportData) -> dict[str, Any]:
    """Tick values for the step-time axis, each labelled in full, over the steps' range."""
    values = [s for runs in data.steps.values() for log in runs.values() for _, s in log if s > 0]
    if not values:
        return {}
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ticks = [v for v in NICE_STEP_S if lo <= v <= hi]
    return {"tickvals": ticks, "ticktext": [f"{v:g}" for v in ticks]} if ticks else {}


def _state_spans(data: ReportData) -> list[tuple[str, str, float, float]]:
    """(node, state, start epoch s, seconds) from the state changes."""
    spans = []
    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in sorted(data.states, key=lambda s: s["ts"]):
        by_node.setdefault(s["node"], []).append(s)
    for node, changes in by_node.items():
        bounds = [c["ts"] for c in changes[1:]] + [data.end_ts]
        for c, end in zip(changes, bounds, strict=True):
            spans.append((node, c["state"], c["ts"], max(end, c["ts"]) - c["ts"]))
    return spans


#: Where in its node's row each state's start mark sits (rows are 1 apart): transitions made
#: in the same second (cordon, sweep, verdict) show as a column of marks, none hiding another.
STATE_MARK_OFFSET = {
    state: round(-0.3 + 0.6 * i / (len(STATE_COLORS) - 1), 2)
    for i, state in enumerate(STATE_COLORS)
}


def _timeline_figure(data: ReportData) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    spans = _state_spans(data)
    nodes = sorted({s[0] for s in spans} | {f["node"] for f in data.flags})
    row = {node: i for i, node in enumerate(nodes)}
    for state, color in STATE_COLORS.items():
        mine = [s for s in spans if s[1] == state]
        if mine:
            fig.add_bar(  # on a date axis a bar's length is in milliseconds
                y=[row[s[0]] for s in mine],
                x=[1000 * s[3] for s in mine],
                base=[_clock(s[2]) for s in mine],
                orientation="h",
                width=0.8,
                name=state,
                legendgroup=state,
                marker_color=color,
                opacity=0.6,
                hoverinfo="skip",
            )
    # a mark where each state begins: a span a second long, or none, still shows at any zoom
    for state, color in STATE_COLORS.items():
        mine = [s for s in spans if s[1] == state]
        if mine:
            fig.add_scatter(
                y=[row[s[0]] + STATE_MARK_OFFSET[state] for s in mine],
                x=[_clock(s[2]) for s in mine],
                mode="markers",
                name=f"{state} (start)",
                legendgroup=state,
                showlegend=False,
                marker={"color": color, "symbol": "square", "size": 7},
                text=[f"{s[0]}: {state} for {s[3]:,.0f} s from {_since(data, s[2])}" for s in mine],
                hoverinfo="text",
            )
    for severity, symbol in SEVERITY_SYMBOL.items():
        mine = [f for f in data.flags if f["severity"] == severity]
        if mine:
            fig.add_scatter(
                y=[row[f["node"]] for f in mine],
                x=[_clock(f["ts"]) for f in mine],
                mode="markers",
                name=f"{severity} flag",
                marker_symbol=symbol,
                marker_color="black",
                text=[
                    f"{f['node']}: {f['category']} ({f['detector']}), {_since(data, f['ts'])}"
                    for f in mine
                ],
                hoverinfo="text",
            )
    fig.update_layout(
        title="Flags and node states per node (a square where each state begins)",
        xaxis={**CLOCK_AXIS, "range": [_clock(data.start_ts), _clock(data.end_ts)]},
        yaxis={
            "tickvals": list(range(len(nodes))),
            "ticktext": nodes,
            "range": [len(nodes) - 0.5, -0.5],  # the first node at the top
            "showgrid": False,
            "zeroline": False,
        },
        barmode="overlay",
        legend=LEGEND_ABOVE,
        height=max(300, 50 * len(nodes) + 180),
    )
    return fig


def _ttd_figure(data: ReportData) -> Any:
    import plotly.graph_objects as go

    labels = [f"{f['kind']} @ {f['node']}" for f in data.faults]
    fig = go.Figure()
    for key, name, miss in (("ttd_s", "time to detect", "missed"),
                            ("ttc_s", "time to cordon", "not cordoned")):  # fmt: skip
        values = [f.get(key) for f in data.faults]
        fig.add_bar(
            x=labels,
            y=[v if v is not None else 0 for v in values],
            text=[miss if v is None else f"{v:.0f} s" for v in values],
            textposition="outside",
            name=name,
            marker_color=TTD_COLORS[name],
        )
    title = "Time to detect and to cordon per fault"
    if not data.faults:
        title += " (no ground truth given)"
    fig.update_layout(title=title, yaxis_title="s from onset", barmode="group")
    return fig


def _goodput_figure(data: ReportData) -> Any:
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("useful steps per hour", "cumulative useful steps")
    )
    labels = sorted({label for runs in data.goodput.values() for label in runs})
    jobs = sorted(data.goodput)
    for label in labels:  # one bar series per run, grouped by job, in the run's colour
        fig.add_bar(
            x=jobs,
            y=[data.goodput[j].get(label, 0.0) for j in jobs],
            name=f"{label} goodput",
            marker_color=_policy_color(label),
            row=1,
            col=1,
        )
    ujobs = list(data.useful)
    for job, runs in sorted(data.useful.items()):
        for label, binned in sorted(runs.items(), key=_guard_on_top):
            # every run starts from nothing at the start
            curve = [(0.0, 0.0), *binned] if binned and binned[0][0] > 0 else binned
            fig.add_scatter(
                x=[_clock(data.start_ts + t) for t, _ in curve],
                y=[n for _, n in curve],
                mode="lines",
                name=f"{job}, {label}",
                line={"color": _policy_color(label), "dash": _dash(ujobs, job)},
                row=1,
                col=2,
            )
    fig.update_layout(title="Goodput with and without Guard", barmode="group")
    fig.update_xaxes(**CLOCK_AXIS, range=[_clock(data.start_ts), _clock(data.end_ts)], row=1, col=2)
    return fig


def render_html(data: ReportData) -> str:
    """The whole page: a header, the notes, the four figures; plotly.js inlined once."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    figures = [_step_figure(data), _timeline_figure(data), _ttd_figure(data), _goodput_figure(data)]
    divs = "\n".join(
        pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"plot-{i}")
        for i, fig in enumerate(figures)
    )
    rows = "".join(
        f"<tr><td>{html.escape(job)}</td>"
        + "".join(f"<td>{html.escape(k)}: {v:,.0f}</td>" for k, v in runs.items())
        + "</tr>"
        for job, runs in sorted(data.goodput.items())
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data.notes)
    meta = json.dumps({"start_ts": data.start_ts, "end_ts": data.end_ts, "plots": len(figures)})
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(data.title)}</title>
<script type="text/javascript">{get_plotlyjs()}</script>
<style>body{{font-family:sans-serif;margin:1.5em}} td{{padding:0 1em}}</style></head>
<body><h1>{html.escape(data.title)}</h1>
<p>{_clock(data.start_ts)[:19]} to {_clock(data.end_ts)[:19]} UTC:
{data.end_ts - data.start_ts:,.0f} s of event time.</p>
<table><caption>goodput, useful steps per hour</caption>{rows}</table>
<ul>{notes}</ul>
{divs}
<script type="application/json" id="guard-report-meta">{meta}</script>
</body></html>
"""

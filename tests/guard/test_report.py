"""``guard report``: one self-contained HTML page, rendered in a real headless browser.

The page is opened by Debian's chromium (``deploy/tools/debian-tool.sh`` installs it when it is
missing, so the README's test command needs nothing installed by hand) with every host name
unresolvable, so a plot that needed the network would not draw: each of the four plots must
render (plotly's ``main-svg`` inside each plot's div) and the browser console must stay
silent (chromium logs every console message, errors included, as ``:CONSOLE:``). One test
also takes a screenshot and reads its pixels: each plot's box is not blank and holds the
colours of the traces it should draw.
"""

from __future__ import annotations

import functools
import io
import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from guard.cli import main
from guard.config import Settings

from ..tools import debian_tool

PLOTS = 4
ROOT = Path(__file__).resolve().parents[2]
WIDTH = 1280


@functools.cache
def chromium() -> str:
    """A chromium's path: the one on PATH, else Debian's, installed for the test."""
    return debian_tool("chromium", "chromium")


def _chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless chromium on ``page``: no network (every host unresolvable), a fresh profile,
    nothing in the background; 3 s of virtual time for the scripts to draw."""
    done = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=3000",
            *args,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def render(page: Path) -> tuple[str, str]:
    """The rendered DOM and the browser's log of ``page``."""
    profile = page.parent / f"{page.stem}-profile"
    profile.mkdir(exist_ok=True)
    done = _chromium(page, profile, "--dump-dom")
    return done.stdout, done.stderr


#: Appended to a copy of the page: once it has drawn, each plot's box (page pixels) and the
#: page's height go into the DOM, for the screenshot's geometry.
_MEASURE = """<script>window.addEventListener("load", () => setTimeout(() => {
  const boxes = {};
  for (const d of document.querySelectorAll('div[id^="plot-"]')) {
    const r = d.getBoundingClientRect();
    boxes[d.id] = [r.left + scrollX, r.top + scrollY, r.width, r.height];
  }
  const out = document.createElement("pre");
  out.id = "guard-boxes";
  out.textContent = JSON.stringify({boxes, height: document.documentElement.scrollHeight});
  document.body.appendChild(out);
}, 200));</script>"""


def screenshot(page: Path, png: Path) -> tuple[np.ndarray, dict[str, list[float]]]:
    """The whole page as RGB pixels (height x WIDTH x 3) and each plot's box
    ``[left, top, width, height]`` in those pixels: one run measures, a second one, with a
    window as tall as the page, takes the picture."""
    from PIL import Image

    measured = page.with_name(f"{page.stem}-measured.html")
    measured.write_text(page.read_text().replace("</body>", _MEASURE + "</body>"))
    profile = page.parent / f"{page.stem}-profile"
    profile.mkdir(exist_ok=True)
    flags = ("--hide-scrollbars", "--force-device-scale-factor=1")
    dom = _chromium(measured, profile, *flags, f"--window-size={WIDTH},1000", "--dump-dom").stdout
    found = re.search(r'<pre id="guard-boxes">(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    geometry = json.loads(found.group(1))
    height = int(geometry["height"])
    _chromium(page, profile, *flags, f"--window-size={WIDTH},{height}", f"--screenshot={png}")
    pixels = np.asarray(Image.open(png).convert("RGB"))
    assert pixels.shape == (height, WIDTH, 3), pixels.shape
    return pixels, geometry["boxes"]


#: plotly's plot area (template "plotly"): what translucent bars are drawn over.
PLOT_BG = "#e5ecf6"


def _rgb(color: str, opacity: float = 1.0, over: str = PLOT_BG) -> np.ndarray:
    """``#rrggbb`` as drawn over ``over`` with ``opacity``."""

    def rgb(c: str) -> np.ndarray:
        return np.array([int(c[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)

    return opacity * rgb(color) + (1 - opacity) * rgb(over)


def pixels_of(region: np.ndarray, color: str, opacity: float = 1.0, tol: int = 4) -> int:
    """How many pixels of ``region`` have ``color`` (within ``tol`` per channel)."""
    diff = np.abs(region.astype(int) - _rgb(color, opacity).round().astype(int))
    return int((diff.max(axis=2) <= tol).sum())


def assert_every_plot_renders(dom: str, log: str) -> None:
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    parts = re.split(r'<div id="plot-(\d+)"', dom)[1:]
    drawn = {int(parts[i]) for i in range(0, len(parts), 2) if "main-svg" in parts[i + 1]}
    assert drawn == set(range(PLOTS)), f"plots drawn: {sorted(drawn)} of {PLOTS}"


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small run with an Xid (fail-stop off: what `guard simulate` writes), its flags from
    `guard backtest`, and a second run of the same seed as the baseline."""
    d = tmp_path_factory.mktemp("run")
    sim = ["simulate", "--nodes", "6", "--duration", "240", "--seed", "4", "--random-faults", "0"]
    faults = ["--fault", "slow_gpu:node=node-002:gpu=1:onset=60:slowdown=0.3",
              "--fault", "xid:node=node-004:onset=120"]  # fmt: skip
    assert main([*sim, *faults, "--out", str(d / "t.jsonl"), "--truth", str(d / "truth.json")]) == 0
    assert main(["backtest", str(d / "t.jsonl"), "--out", str(d / "flags.jsonl"), "--quiet"]) == 0
    return {"telemetry": d / "t.jsonl", "flags": d / "flags.jsonl", "truth": d / "truth.json"}


def test_report_from_jsonl_renders_every_plot_offline(
    simulated_run: dict[str, Path], tmp_path: Path, settings: Settings
) -> None:
    page = tmp_path / "report.html"
    run = simulated_run
    args = ["report", "--jsonl", str(run["telemetry"]), str(run["flags"])]
    args += ["--baseline", str(run["telemetry"]), "--truth", str(run["truth"])]
    assert main([*args, "--out", str(page)]) == 0
    html = page.read_text()
    assert "<script src=" not in html  # plotly.js is inlined
    assert "slow_gpu @ node-002" in html and "xid @ node-004" in html  # time to detect
    dom, log = render(page)
    assert_every_plot_renders(dom, log)


def node_states(truth_path: Path, flags_path: Path, out: Path) -> list[tuple[str, str]]:
    """The node states Guard's orchestrator makes of a backtest's flags: the real core
    (policy, cordon cap, state machine) in event time, a tick every 5 s, sweeps simulated
    from the truth; written as JSONL. Returns ``(node, state)`` in order."""
    from guard.config import OrchestratorSettings
    from guard.schemas import Flag
    from guard.schemas.truth import Truth
    from guard.sweeps import DryRunScheduler, SimulatedSweepExecutor
    from guard.sweeps.orchestrator import Orchestrator

    truth = Truth.load(truth_path)
    lines = flags_path.read_text().splitlines()
    pending = sorted((Flag.model_validate_json(line) for line in lines), key=lambda f: f.ts)
    nodes = list(truth.nodes)
    now = [truth.start_ts]
    published: list[object] = []
    orchestrator = Orchestrator(
        # nodes in repair count against the cap (issue 27): room for both faulty nodes' sweeps
        OrchestratorSettings(nodes=nodes, max_cordoned_fraction=0.5),
        scheduler=DryRunScheduler(nodes),
        executor=SimulatedSweepExecutor.from_truth(truth),
        publish=published.append,
        clock=lambda: now[0],
        nodes=nodes,
        inline_sweeps=True,
    )
    while now[0] <= truth.end_ts:
        while pending and pending[0].ts <= now[0]:
            orchestrator.handle_flag(pending.pop(0))
        orchestrator.tick()
        now[0] += 5.0
    states = [m for m in published if getattr(m, "kind", "") == "node_state"]
    out.write_text("".join(m.model_dump_json() + "\n" for m in states))  # type: ignore[attr-defined]
    return [(m.node, m.state) for m in states]  # type: ignore[attr-defined]


def test_report_screenshot_shows_every_plot_with_its_traces(
    simulated_run: dict[str, Path], tmp_path: Path, settings: Settings
) -> None:
    """The page as a reader sees it: chromium's screenshot, read pixel by pixel. Each plot's
    box is not blank and holds the colours of what it must draw: both runs' step times, the
    node states and flags, time to detect and to cordon, both runs' goodput."""
    from guard.evaluation.report import POLICY_COLORS, STATE_COLORS, TTD_COLORS

    run = simulated_run
    states = node_states(run["truth"], run["flags"], tmp_path / "states.jsonl")
    # the Xid node is cordoned and goes to repair; the straggler is claimed and swept
    assert ("node-004", "repair") in states and ("node-002", "sweeping") in states, states
    # the baseline: the same seed with a steady 10 % straggler left in the job (another curve)
    baseline = tmp_path / "baseline.jsonl"
    sim = ["simulate", "--nodes", "6", "--duration", "240", "--seed", "4", "--random-faults", "0"]
    faults = ["--fault", "slow_gpu:node=node-002:gpu=1:onset=60:slowdown=0.1:pattern=steady"]
    assert main([*sim, *faults, "--out", str(baseline), "--truth", str(tmp_path / "b.json")]) == 0
    page = tmp_path / "report.html"
    args = ["report", "--jsonl", str(run["telemetry"]), str(run["flags"])]
    args += [str(tmp_path / "states.jsonl"), "--baseline", str(baseline)]
    args += ["--truth", str(run["truth"]), "--out", str(page)]
    assert main(args) == 0
    pixels, boxes = screenshot(page, tmp_path / "report.png")
    white = (pixels == 255).all(axis=2)
    assert white.mean() < 0.9, "the page is (almost) blank"
    assert sorted(boxes) == [f"plot-{i}" for i in range(PLOTS)], boxes

    def box(i: int) -> np.ndarray:
        left, top, width, height = (round(v) for v in boxes[f"plot-{i}"])
        return pixels[top : top + height, left : left + width]

    for i in range(PLOTS):
        region = box(i)
        assert region.size and (region != 255).any(axis=2).mean() > 0.2, f"plot {i} is blank"
        assert len(np.unique(region.reshape(-1, 3), axis=0)) > 50, f"plot {i} has no detail"
    step, timeline, ttd, goodput = (box(i) for i in range(PLOTS))
    for label, colour in POLICY_COLORS.items():  # a 2-px line of each run, a bar of each
        assert pixels_of(step, colour) > 300, f"step time: no line {label}"
        assert pixels_of(goodput, colour) > 3000, f"goodput: no bar {label}"
        # (a few pixels of grey anti-aliased text are not a bar)
        assert pixels_of(ttd, colour) < 500, f"time to detect drew {label}'s colour"
    # a square where each state begins, in full colour, also for the states the orchestrator
    # passed through in the same second (suspect, cordoned, sweeping, failed); the bars of the
    # lasting ones (healthy, repair: minutes) at the timeline's opacity 0.6
    for state in {state for _, state in states}:
        assert pixels_of(timeline, STATE_COLORS[state]) >= 25, f"timeline: no {state} mark"
    for state in ("healthy", "repair"):
        assert pixels_of(timeline, STATE_COLORS[state], 0.6) > 3000, f"timeline: no {state} bar"
    assert pixels_of(timeline, "#000000", tol=40) > 20, "timeline: no flag markers"
    for name, colour in TTD_COLORS.items():
        assert pixels_of(ttd, colour) > 1000, f"no bar of {name}"
    # the cordons as dotted lines over the step times, in the cordoned state's colour
    assert pixels_of(step, STATE_COLORS["cordoned"]) > 100, "step time: no cordon lines"
    assert pixels_of(step, TTD_COLORS["time to detect"]) < 100


def test_report_from_clickhouse_shows_node_states_and_flags(
    store: tuple[object, Settings], tmp_path: Path
) -> None:
    from guard.commands.report import read_store
    from guard.evaluation.report import from_messages, render_html
    from guard.schemas import Flag, NodeState, StepTiming
    from guard.store import insert_messages

    client, settings = store
    t0 = time.time() - 3600  # recent: the tables' TTL drops rows older than 30 days
    steps = [
        StepTiming(ts=t0 + 2 * i + 0.01 * r, node=f"n{r}", job="j", rank=r, step=i, step_s=2.0)
        for i in range(50)
        for r in range(4)
    ]
    flag = Flag(ts=t0 + 30, node="n2", job="j", id="f1", detector="peer_straggler",
                category="straggler", severity="warning", score=4.0)  # fmt: skip
    states = [
        NodeState(ts=t0 + 31, node="n2", state="suspect", prev="healthy", actor="orchestrator"),
        NodeState(ts=t0 + 32, node="n2", state="cordoned", prev="suspect", actor="orchestrator"),
        NodeState(ts=t0 + 40, node="n2", state="repair", prev="failed", actor="orchestrator"),
    ]
    insert_messages(client, settings, [*steps, flag, *states])
    messages = read_store(client, settings.clickhouse.database)
    assert {m.kind for m in messages} == {"step", "flag", "node_state"}, messages[:3]
    data = from_messages(messages, title="from chDB")
    assert len(data.steps["j"]["with Guard"]) == 50
    assert [s["state"] for s in data.states] == ["suspect", "cordoned", "repair"]
    assert [(f["node"], f["category"]) for f in data.flags] == [("n2", "straggler")]
    page = tmp_path / "store.html"
    page.write_text(render_html(data))
    dom, log = render(page)
    assert_every_plot_renders(dom, log)
    assert "cordoned" in dom and "n2" in dom


def test_report_without_input_says_what_to_do(
    settings: Settings, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["report", "--jsonl", str(tmp_path / "missing.jsonl"), "--out", "x.html"])
    assert code == 1
    assert "missing.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_report_shows_goodput_with_and_without_guard(
    settings: Settings, kafka_bootstrap: str, chdb_client: object, tmp_path: Path
) -> None:
    """The demo's pipeline with an Xid: Guard cordons the node during the watchdog's hang and
    the job restarts on a spare; the counterfactual crash-loops."""
    from guard.agents.simulator import FaultSpec
    from guard.demo import DemoConfig, Pipeline
    from guard.demo.report import demo_effect, demo_report_data, print_summary, summarize
    from guard.evaluation.report import render_html

    config = DemoConfig(
        nodes=8, duration_s=200.0, seed=5, faults=[FaultSpec("xid", onset_s=60)],
        bootstrap=kafka_bootstrap, home=tmp_path, speed=5.0,  # slow enough to act in time
    )  # fmt: skip
    settings.clickhouse.dsn = None
    settings.streams.app_id = "report-streams"
    settings.clickhouse.batch_seconds = 0.5
    pipe = Pipeline(settings, config)
    pipe.client_override = chdb_client
    try:
        pipe.start()
        pipe.publish()
        assert pipe.drain(timeout_s=120), "the streams worker did not catch up"
        pipe.finish_sink()
        effects = demo_effect(pipe)
        summary = summarize(pipe, 0.0, effects)
        data = demo_report_data(pipe, effects, summary)
    finally:
        pipe.stop()
    job = summary["step_time"]["job-a"]
    # the job's mechanics compressed 10x: watchdog 60 s, restart 60 s, re-crash 12 s
    assert job["with_guard"]["crashes"] == 1 <= job["without_guard"]["crashes"]
    assert job["with_guard"]["goodput_per_h"] > job["without_guard"]["goodput_per_h"], pipe.events
    # the gain holds with the compression halved and doubled (same cordons replayed)
    gains = summary["compression"]["gain_pct_by_compression"]
    assert sorted(gains, key=float) == ["5", "10", "20"]
    assert all(g["job-a"]["with_guard"] > g["job-a"]["without_guard"] for g in gains.values())
    # each cordon's lag after its claim: the streams' round trip plus the orchestrator's part
    for lag in summary["cordon_lag"]:
        assert lag["lag_s"] == pytest.approx(lag["streams_s"] + lag["orchestrator_s"], abs=0.2)
    assert job["ahead_after_s"] is not None and job["ahead_after_s"] > 60
    assert [s["state"] for s in data.states if s["state"] == "cordoned"]
    page = tmp_path / "demo.html"
    page.write_text(render_html(data))
    dom, log = render(page)
    assert_every_plot_renders(dom, log)
    # the summary at 80 columns (a file, as a pipe: rich's default width) keeps the longest
    # fault names and categories whole
    fault = summary["faults"][0]
    summary["faults"] = [
        {**fault, "kind": kind, "category": category}
        for kind, category in [
            ("thermal_throttle", "thermal"), ("degraded_nic", "nic"),
            ("slow_gpu", "straggler"), ("xid", "gpu_error"),
        ]
    ]  # fmt: skip
    summary["peak_rss_mb"] = {"demo": 622, "largest_worker": 415}  # `guard demo` adds these
    out = io.StringIO()
    print_summary(summary, out)
    text = out.getvalue()
    assert max(map(len, text.splitlines())) <= 80, text
    for name in ("thermal_throttle", "degraded_nic", "(straggler)", "(gpu_error)"):
        assert name in text, text


def test_demo_compression_scales_the_job_mechanics_together() -> None:
    from guard.demo import DemoConfig
    from guard.demo.pipeline import REAL_JOB_S

    for c in (5.0, 10.0, 20.0):
        sim = DemoConfig(compression=c).sim_config(0.0)
        got = {k: getattr(sim, k) for k in REAL_JOB_S}
        assert got == {k: v / c for k, v in REAL_JOB_S.items()}
    with pytest.raises(ValueError, match="compression must be > 0"):
        DemoConfig(compression=0).sim_config(0.0)


def test_compression_check_replays_cordons_at_half_and_double() -> None:
    """Without Kafka: the simulator both ways at 5x, 10x, 20x, Guard's cordon of the Xid
    node replayed 10 s after onset; the gain on job-a must hold at each."""
    from types import SimpleNamespace

    from guard.agents.simulator import FaultSpec
    from guard.demo import DemoConfig
    from guard.demo.report import compression_check
    from guard.schemas import NodeState

    config = DemoConfig(
        nodes=8, duration_s=600.0, seed=5, faults=[FaultSpec("xid", node="node-001", onset_s=200)]
    )
    start = 1767225600.0
    cordon = NodeState(ts=start + 210, node="node-001", state="cordoned", prev="suspect")
    pipe = SimpleNamespace(config=config, sim=object(), start_ts=start, state_log=[cordon])
    gains = compression_check(pipe)  # type: ignore[arg-type]
    assert list(gains) == ["5", "10", "20"]
    assert all(g["job-a"]["gain_pct"] > 0 for g in gains.values()), gains
    # a cordon replayed after the run changes nothing: no gain at any compression
    late = NodeState(ts=start + 900, node="node-001", state="cordoned", prev="suspect")
    none = compression_check(SimpleNamespace(**{**pipe.__dict__, "state_log": [late]}))  # type: ignore[arg-type]
    assert all(g["job-a"]["gain_pct"] == 0 for g in none.values()), none


def test_report_figures_cordon_beside_detect_one_colour_per_run_and_state_marks() -> None:
    """The figures' data (no browser): time to cordon beside time to detect, each run in one
    colour in every plot, and a marker where each state begins (a 1-s span at any zoom)."""
    from guard.evaluation import report as rp

    t0 = 1000.0
    states = [
        {"ts": t0 + 50, "node": "n1", "state": "suspect"},
        {"ts": t0 + 60, "node": "n1", "state": "cordoned"},
        {"ts": t0 + 61, "node": "n1", "state": "sweeping"},
        {"ts": t0 + 62, "node": "n1", "state": "repair"},
    ]
    cordons = rp.first_cordons(states)
    data = rp.ReportData(
        title="t", start_ts=t0, end_ts=t0 + 600,
        steps={"a": {"with Guard": [(t0 + 2, 2.0)], "without Guard": [(t0 + 2, 2.5)]},
               "b": {"with Guard": [(t0 + 2, 2.0)], "without Guard": [(t0 + 2, 2.0)]}},
        useful={"a": {"with Guard": [(10.0, 5.0)], "without Guard": [(10.0, 4.0)]}},
        goodput={"a": {"with Guard": 900.0, "without Guard": 800.0},
                 "b": {"with Guard": 700.0, "without Guard": 750.0}},
        states=states,
        faults=[{"id": "f1", "node": "n1", "kind": "xid", "ttd_s": 5.0,
                 "ttc_s": rp.time_to_cordon(cordons, "n1", t0 + 40)},
                {"id": "f2", "node": "n2", "kind": "slow_gpu", "ttd_s": None, "ttc_s": None}],
    )  # fmt: skip
    ttd = rp._ttd_figure(data)
    assert [t.name for t in ttd.data] == ["time to detect", "time to cordon"]
    assert list(ttd.data[1].y) == [20.0, 0] and list(ttd.data[1].text) == ["20 s", "not cordoned"]
    colours: dict[str, set[str]] = {}
    for fig in (rp._step_figure(data), rp._goodput_figure(data)):
        for trace in fig.data:
            label = "without Guard" if "without Guard" in trace.name else "with Guard"
            colour = trace.marker.color if trace.type == "bar" else trace.line.color
            colours.setdefault(label, set()).add(colour)
    assert colours == {k: {v} for k, v in rp.POLICY_COLORS.items()}
    timeline = rp._timeline_figure(data)
    marks = [t for t in timeline.data if t.type == "scatter" and t.name.endswith("(start)")]
    assert {t.name for t in marks} == {f"{s} (start)" for s in
                                       ("suspect", "cordoned", "sweeping", "repair")}  # fmt: skip
    sweeping = next(t for t in marks if t.name == "sweeping (start)")
    assert (
        list(sweeping.x) == [rp._clock(t0 + 61)]
        and sweeping.marker.color == rp.STATE_COLORS["sweeping"]
    )

"""Goodput against a counterfactual that fails like a real cluster.

The simulator's fail-stop semantics (``SimConfig.fail_stop``: an Xid or DBE hangs the job
until the NCCL watchdog, it restarts from its last checkpoint, crash-loops until a person
drains the node, and a cordon during the hang restarts it at once), the goodput and
variation measures of :mod:`guard.evaluation.goodput`, the demo's with/without comparison,
the day model of ``benchmarks/goodput.py`` and its sensitivity page in headless chromium.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guard.agents.simulator import ClusterSimulator, FaultSpec, JobSpec, SimConfig
from guard.evaluation.goodput import ahead_after, confounder_steps, useful_curve, window_cv

ONSET = 300.0


def _config(**kw: Any) -> SimConfig:
    return SimConfig(
        nodes=8,
        duration_s=2400,
        seed=2,
        jobs=[JobSpec("job-a", 6)],
        faults=[FaultSpec("ecc_dbe", node="node-002", onset_s=ONSET)],
        random_faults=0,
        fail_stop=True,
        checkpoint_every_s=200.0,
        sample_interval_s=10.0,  # GPU samples are not what these tests read
        **kw,
    )


def _run(config: SimConfig, cordon_at_s: float | None = None) -> ClusterSimulator:
    sim = ClusterSimulator(config)
    for batch in sim.batches():
        if cordon_at_s is not None and batch and batch[-1].ts - config.start_ts >= cordon_at_s:
            sim.remediate("node-002")
            cordon_at_s = None
    return sim


def _gaps(sim: ClusterSimulator) -> list[tuple[float, float]]:
    """(s since start, length) of every pause of job-a's steps longer than 50 s."""
    log = sim.step_times("job-a")
    t0 = sim.start_ts
    return [
        (round(a[0] - t0), round(b[0] - a[0]))
        for a, b in itertools.pairwise(log)
        if b[0] - a[0] > 50
    ]


def test_a_dbe_crash_loops_the_job_until_a_person_drains_the_node() -> None:
    config = _config(human_drain_s=1500.0)
    sim = _run(config)
    crashes = sim.training.crashes
    period = config.watchdog_s + config.restart_s + config.recrash_s
    first, second = (c["ts"] - sim.start_ts for c in crashes)
    assert first == pytest.approx(ONSET, abs=3)
    # checked at step starts: a checkpoint save in between can delay it a little
    assert period <= second - first <= period + 60
    # each pause: the watchdog's hang plus the restart (plus a checkpoint save come due)
    hang = config.watchdog_s + config.restart_s
    assert all(hang <= g <= hang + 60 for _, g in _gaps(sim)[:2]), _gaps(sim)
    # work since the last checkpoint (every 200 s) is lost, never more
    assert crashes[0]["lost_steps"] > 0
    assert all(0 <= c["lost_steps"] <= 200 / 2.0 + 2 for c in crashes), crashes
    drains = [r for r in sim.training.remediations if r["by"] == "person"]
    assert [r["node"] for r in drains] == ["node-002"]
    assert drains[0]["ts"] - crashes[0]["ts"] >= config.human_drain_s
    steps_after = [e for e, _ in sim.step_times("job-a") if e > drains[0]["ts"] + 200]
    assert len(steps_after) > 100  # the job runs again once the node is out


def test_a_cordon_during_the_hang_restarts_the_job_at_once() -> None:
    config = _config()
    sim = _run(config, cordon_at_s=ONSET + 10)
    assert len(sim.training.crashes) == 1
    (gap,) = _gaps(sim)
    # the cordon lands within a sampling tick or two; the watchdog (600 s) is not waited for
    tick = config.sample_interval_s
    assert 10 + config.restart_s <= gap[1] <= 10 + config.restart_s + 2 * tick + 4
    assert [r["by"] for r in sim.training.remediations] == ["guard"]


def test_without_fail_stop_an_xid_is_telemetry_only() -> None:
    config = _config()
    config.fail_stop = False
    sim = _run(config)
    assert sim.training.crashes == [] and _gaps(sim) == []


def test_the_demo_effect_gives_goodput_and_the_break_even() -> None:
    from guard.demo.report import effect

    with_guard = _run(_config(), cordon_at_s=ONSET + 10)
    without = _run(_config())
    job = effect(with_guard, without, window_s=60.0)["job-a"]
    w, wo = job["with_guard"], job["without_guard"]
    assert w["goodput_per_h"] > 1.5 * wo["goodput_per_h"] > 0
    assert w["crashes"] == 1 and wo["crashes"] == 3  # a person drains after 2 h: not within
    assert wo["lost_steps"] > w["lost_steps"] > 0
    # identical before the fault, so Guard is ahead only after the crash
    assert job["extrapolated"] is False
    assert ONSET < job["ahead_after_s"] < ONSET + 200
    assert w["confounder_steps"]["steps"] > 0  # checkpoints, counted apart


def test_window_cv_leaves_confounder_steps_out_and_measures_slow_windows() -> None:
    steady = [(2.0 * i, 2.0) for i in range(1, 301)]
    checkpoint = [*steady[:100], (240.0, 40.0), *[(e + 40.0, s) for e, s in steady[100:]]]
    assert window_cv(steady, 60.0) == 0.0
    assert window_cv(checkpoint, 60.0) > 0.05
    assert window_cv(checkpoint, 60.0, confounders=[(200.5, 240.0)]) == pytest.approx(0.0)
    assert confounder_steps(checkpoint, [(200.5, 240.0)]) == {"steps": 1, "seconds": 40.0}
    slow = [(2.0 * i, 2.0 if i < 150 else 2.4) for i in range(1, 301)]
    assert window_cv(slow, 60.0) == pytest.approx(0.4 / 2.2 / 2, rel=0.15)


def test_useful_curves_and_ahead_after() -> None:
    log = [(2.0 * i, 2.0) for i in range(1, 101)]
    curve = useful_curve(log, [(100.0, 30)], 0.0, 200.0, bin_s=50.0)
    assert curve == [(50.0, 25), (100.0, 20), (150.0, 45), (200.0, 70)]
    behind = [(t, n - 1) for t, n in curve]
    assert ahead_after(curve, behind) == 50.0
    assert ahead_after(behind, curve) is None
    assert ahead_after(curve, curve) is None


@pytest.fixture(scope="module")
def bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "goodput.py"
    spec = importlib.util.spec_from_file_location("goodput_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_day_model_crash_loops_without_remediation(bench: Any) -> None:
    onset = 3600.0
    fault = bench.Fault("xid", onset, 0.0, math.inf, onset + bench.HUMAN_TTR_S, None)
    day = bench.simulate_day([fault], [], restart_s=600.0)
    cycle = bench.WATCHDOG_S + 600.0 + bench.RECRASH_S
    assert day.restarts == math.ceil(bench.HUMAN_TTR_S / cycle)
    cordoned = bench.Fault("xid", onset, 0.0, math.inf, onset + 10.0, 10.0)
    fast = bench.simulate_day([cordoned], [], restart_s=600.0)
    assert fast.restarts == 1
    assert fast.down_s == pytest.approx(10.0 + 600.0, abs=bench.TICK_S)
    assert fast.goodput > day.goodput


def test_benchmark_day_model_grey_fault_costs_slow_steps_or_a_restart(bench: Any) -> None:
    slow = bench.Fault("slow_gpu", 3600.0, 0.2, math.inf, math.inf, None)
    left = bench.simulate_day([slow], [], restart_s=600.0)
    removed = bench.Fault("slow_gpu", 3600.0, 0.2, math.inf, 3620.0, 20.0)
    fixed = bench.simulate_day([removed], [], restart_s=600.0)
    assert left.restarts == 0 and left.mean_step_s > bench.STEP_S * 1.15
    planned = 600.0 + bench.ONDEMAND_CKPT_S
    assert fixed.restarts == 1 and fixed.down_s == pytest.approx(planned, abs=bench.TICK_S)
    assert fixed.lost_steps == 0  # the on-demand checkpoint is recorded
    assert fixed.hourly_cv < left.hourly_cv
    assert fixed.goodput > left.goodput
    # a restart for a fault that slows nothing is a pure loss
    harmless = bench.Fault("link_flap", 3600.0, 0.0, math.inf, 3620.0, 20.0)
    assert (
        bench.simulate_day([harmless], [], 600.0).goodput
        < bench.simulate_day([], [], 600.0).goodput
    )


def test_benchmark_straggler_costs_until_the_job_relaunches_without_it(bench: Any) -> None:
    # cordoned at 3620 s: slow steps end at the relaunch (checkpoint + restart later), not
    # at the cordon; the job ran slow for 20 s and was down for the rest
    removed = bench.Fault("slow_gpu", 3600.0, 0.5, math.inf, 3620.0, 20.0)
    day = bench.simulate_day([removed], [], restart_s=600.0)
    slow_steps = 20.0 / (bench.STEP_S * 1.5)
    ideal_before = 3600.0 / bench.STEP_S
    rest = (bench.HORIZON_S - 3620.0 - 600.0 - bench.ONDEMAND_CKPT_S) / bench.STEP_S
    assert day.useful_steps == pytest.approx(ideal_before + slow_steps + rest, rel=1e-9)


def test_benchmark_spares_and_sweeps_cost_what_they_cost(bench: Any) -> None:
    # three false cordons within a minute, two spares, a 3,000-s sweep: the relaunch waits
    # for the first swept node to come back (a 300-s sweep is over before the relaunch)
    falses = [3600.0, 3610.0, 3620.0]
    long = bench.simulate_day([], falses, restart_s=600.0, spares=2, sweep_s=3000.0)
    many = bench.simulate_day([], falses, restart_s=600.0, spares=5, sweep_s=3000.0)
    short = bench.simulate_day([], falses, restart_s=600.0, spares=2, sweep_s=300.0)
    assert many.spare_wait_s == 0 == short.spare_wait_s and long.spare_wait_s > 0
    wait = 3600.0 + bench.ONDEMAND_CKPT_S + 3000.0 - (3600.0 + bench.ONDEMAND_CKPT_S + 600.0)
    assert long.spare_wait_s == pytest.approx(wait)
    assert long.goodput < many.goodput == short.goodput < bench.IDEAL_DAY.goodput
    # no spares at all: the relaunch waits for the swept nodes themselves
    none = bench.simulate_day([], falses, restart_s=600.0, spares=0, sweep_s=3000.0)
    assert none.spare_wait_s > long.spare_wait_s and none.goodput < long.goodput


def test_benchmark_compute_rule_fires_in_a_synchronous_job(bench: Any) -> None:
    # step_s is equal on every rank (the collective waits for the slowest); compute_s is not
    from guard.schemas import StepTiming

    rules = bench.DcgmAlertRules()
    alerts = []
    for step in range(200):
        for rank in range(8):
            compute = 1.8 if rank == 3 else 1.2
            msg = StepTiming(
                ts=1000.0 + 2.0 * step,
                node=f"n{rank}",
                job="j",
                rank=rank,
                step=step,
                step_s=2.0,
                compute_s=compute,
            )
            alerts += rules.update(msg)
    alerts += rules.flush()
    assert {a.node for a in alerts} == {"n3"}
    first = min(a.ts for a in alerts) - 1000.0
    assert 0.9 * rules.compute_hold_s <= first <= rules.compute_hold_s + 10
    # the old static rule (step_s > 1.2x median) cannot fire here
    from guard.detectors.baselines import StaticRulesBaseline

    static = StaticRulesBaseline()
    fired = [
        f
        for step in range(50)
        for rank in range(8)
        for f in static.update(
            StepTiming(
                ts=2.0 * step,
                node=f"n{rank}",
                job="j",
                rank=rank,
                step=step,
                step_s=2.0,
                compute_s=1.8 if rank == 3 else 1.2,
            )
        )
    ]
    assert fired == []


def _small_setting(bench: Any, rate: float) -> Any:
    """A day model over two slices: a slow GPU only Guard takes out (cordoned 120 s after
    onset) and an Xid everyone acts on."""
    slow = bench.SliceOutcome(
        "slow_gpu", 0.3, {"guard": 60.0, "rules": None}, {"guard": 120.0, "rules": None}, {}
    )
    xid = bench.SliceOutcome(
        "xid", 0.0, {"guard": 5.0, "rules": 5.0}, {"guard": 30.0, "rules": 5.0}, {}
    )
    return bench.Setting(
        rate=rate,
        mix={"slow_gpu": 0.5, "xid": 0.5},
        pool={"slow_gpu": [slow], "xid": [xid]},
        false_rate={"guard": 0.0, "rules": 0.0},
    )


def test_benchmark_interval_and_break_even(bench: Any) -> None:
    setting = _small_setting(bench, 5e-4)
    m, lo, hi = bench.gain(setting, 60, "none")
    assert lo < m < hi and lo > 0  # Guard takes the slow GPU out; no one else does
    be = bench.break_even(setting, 60, "none")
    assert be is not None and be > 0
    # at the break-even rate, the gain is about zero; well above it, negative
    above = bench.Setting(**{**setting.__dict__, "false_rate": {"guard": 4 * be / 1000}})
    assert bench.gain(above, 60, "none")[0] < 0
    assert bench.poisson_upper(0) == pytest.approx(2.996, abs=1e-3)


def test_a_crash_after_a_planned_restart_loses_only_steps_since_its_checkpoint() -> None:
    # node-001 is cordoned while the job runs (its restart saves a checkpoint on demand);
    # node-002's DBE crashes the job 150 s later: only the steps after the relaunch are lost,
    # not all since the start (checkpoints every 2,000 s save nothing before the crash)
    config = _config()
    config.checkpoint_every_s = 2000.0
    sim = ClusterSimulator(config)
    cordoned = False
    for batch in sim.batches():
        if not cordoned and batch and batch[-1].ts - config.start_ts >= ONSET - 150:
            sim.remediate("node-001")
            cordoned = True
    (crash,) = sim.training.crashes[:1]
    steps_per_s = 1 / 2.0
    ran_s = 150 - config.restart_s + 2 * config.sample_interval_s
    assert 0 < crash["lost_steps"] <= ran_s * steps_per_s
    assert [r["node"] for r in sim.training.remediations][:1] == ["node-001"]


def test_the_sensitivity_page_renders_every_figure_in_its_colours(
    bench: Any, tmp_path: Path
) -> None:
    """benchmarks/goodput.py's page (the false-cordon figure over the fault rate x restart
    cost heat maps) from the benchmark's own day model on a small pool of slices, opened
    offline in headless chromium as tests/guard/test_report.py does the report: both figures
    drawn and the console silent; in the screenshot each baseline's line and interval in its
    colour, and the heat maps green where Guard gains and red where it loses, with every
    cell's value written on it."""
    from ..guard.test_report import pixels_of, render, screenshot

    setting = _small_setting(bench, 1.2e-4)  # about the trace's rate
    seeds = 40
    headline = {
        x: {
            b: bench.gain(
                bench.Setting(**{**setting.__dict__, "false_rate": {"guard": x / 1000}}), seeds, b
            )
            for b in bench.BASELINES
        }
        for x in (0.0, 0.5, 1.0, 5.0)
    }
    evens = {b: bench.break_even(setting, seeds, b) for b in bench.BASELINES}
    # Guard with a false cordon per 1,000 node-hours: it loses at 1x, gains at 20x
    costly = bench.Setting(**{**setting.__dict__, "false_rate": {"guard": 1.0 / 1000}})
    grid = bench.sensitivity(costly, 20, [1, 5, 20], [120, 600, 1800])
    values = [v for cell in grid.values() for v in cell.values()]
    for b in bench.BASELINES:  # each heat map has cells of both signs
        assert min(c[b] for c in grid.values()) < -1 < 1 < max(c[b] for c in grid.values()), b
    page = tmp_path / "sensitivity.html"
    figure = bench.false_cordon_figure(headline, evens, seeds, bound=34.0)
    bench.plot_sensitivity(grid, page, 20, figure, false_per_1000=1.0)
    assert "<script src=" not in page.read_text()  # plotly.js inlined

    dom, log = render(page)
    assert [line for line in log.splitlines() if ":CONSOLE" in line] == []
    parts = re.split(r'<div id="plot-(\d+)"', dom)[1:]
    drawn = {int(parts[i]) for i in range(0, len(parts), 2) if "main-svg" in parts[i + 1]}
    assert drawn == {0, 1}, f"figures drawn: {sorted(drawn)} of 2"
    for v in values:  # the heat maps' texttemplate: every cell says its gain
        assert f"{v:+.2f}%" in dom, v
    for b, be in evens.items():
        assert be is None or f"break-even vs {b}: {be:.3g}" in dom
    assert "Guard's false cordons 1 per 1,000 node-hours" in dom
    # a colour bar per heat map: each has its own scale (vs none's gains are ten times the rest)
    heat_dom = dom[dom.index('<div id="plot-1"') :]
    assert len(re.findall(r'class="\w+ colorbar"', heat_dom)) == len(bench.BASELINES)

    pixels, boxes = screenshot(page, tmp_path / "sensitivity.png")
    assert sorted(boxes) == ["plot-0", "plot-1"], boxes

    def box(name: str) -> np.ndarray:
        left, top, width, height = (round(v) for v in boxes[name])
        return pixels[top : top + height, left : left + width]

    cordons, heat = box("plot-0"), box("plot-1")
    for region in (cordons, heat):
        assert region.size and (region != 255).any(axis=2).mean() > 0.2, "a blank figure"
    for b, colour in bench.BASELINE_COLORS.items():  # a 2-px line with its interval bars
        assert pixels_of(cordons, colour) > 300, f"false-cordon figure: no line vs {b}"
        assert pixels_of(heat, colour) < 200, f"the heat maps drew {b}'s line colour"

    # each heat map on its own scale (its colour bar beside it, symmetric about 0): green
    # where Guard gains, red where it loses, wherever a cell is a fifth of the scale or more
    # (RdYlGn's pale yellow at 0 is neither). Only wide areas count, as a cell (~100 x 90 px),
    # not the 12-px colour bars that hold every colour of the scale.
    def wide(mask: np.ndarray, run: int = 40) -> int:
        """Pixels that begin a horizontal run of ``run`` or more pixels of ``mask``."""
        sums = np.pad(mask.astype(int).cumsum(axis=1), ((0, 0), (1, 0)))
        return int(((sums[:, run:] - sums[:, :-run]) == run).sum())

    width = heat.shape[1]
    for i, b in enumerate(bench.BASELINES):
        third = heat[:, round(i * width / 3) : round((i + 1) * width / 3)].astype(int)
        green = wide((third[..., 1] - third[..., 0] > 25) & (third[..., 2] < 170))
        red = wide((third[..., 0] - third[..., 1] > 25) & (third[..., 2] < 170))
        gains = [c[b] for c in grid.values()]
        scale = max(map(abs, gains))
        assert max(gains) / scale > 0.2 and green > 2000, f"vs {b}: no green cells ({green} px)"
        if min(gains) / scale < -0.2:
            assert red > 2000, f"vs {b}: no red cells where Guard loses ({red} px)"
        else:
            assert red == 0, f"vs {b}: red cells where Guard hardly loses ({red} px)"
    assert sum(min(c[b] for c in grid.values()) < 0 for b in bench.BASELINES) >= 2

"""What the demo reports: the summary as plain data (:func:`summarize`) and its rendering."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from typing import Any

from guard.agents.simulator import ClusterSimulator
from guard.evaluation.goodput import (
    ahead_after,
    confounder_steps,
    goodput_per_hour,
    useful_curve,
    window_cv,
)
from guard.evaluation.scoring import evaluate
from guard.schemas.tables import TABLES
from guard.schemas.truth import Truth

from .pipeline import Pipeline

__all__ = ["demo_effect", "effect", "print_summary", "summarize"]


def _faults(truth: Truth, first_hit: dict[str, float], snapshot: dict[str, Any]) -> list[Any]:
    faults = []
    for fault in truth.faults:
        hit = first_hit.get(fault.id)
        faults.append(
            {
                "id": fault.id,
                "node": fault.node,
                "kind": fault.kind,
                "category": fault.category,
                "onset_s": round(fault.onset - truth.start_ts, 1),
                "slowdown": fault.slowdown,
                "detected": hit is not None,
                "time_to_detect_s": None if hit is None else round(max(0.0, hit - fault.onset), 1),
                "final_state": getattr(snapshot.get(fault.node), "state", "healthy"),
            }
        )
    return faults


#: Confounders during which the whole job waits (no node at fault): reported apart.
JOB_CONFOUNDERS = ("checkpoint", "data_stall")


def crashes_of(sim: ClusterSimulator, job: str) -> list[tuple[float, int]]:
    """``(ts, lost steps)`` of every crash of ``job`` in a simulator run."""
    return [(c["ts"], c["lost_steps"]) for c in sim.training.crashes if c["job"] == job]


def _job_run(sim: ClusterSimulator, truth: Truth, job: str, window_s: float) -> dict[str, Any]:
    spans = [
        (c.start, c.end)
        for c in truth.confounders
        if c.kind in JOB_CONFOUNDERS and c.job in (None, job)
    ]
    log = sim.step_times(job)
    clean = [s for end, s in log if not any(a < end and end - s < b for a, b in spans)]
    crashes = crashes_of(sim, job)
    return {
        "steps": len(log),
        "useful_steps": len(log) - sum(n for _, n in crashes),
        "goodput_per_h": goodput_per_hour(log, crashes, truth.start_ts, truth.end_ts),
        "mean_s": statistics.fmean(clean) if clean else 0.0,
        "window_cv": window_cv(log, window_s, spans),
        "crashes": len(crashes),
        "lost_steps": sum(n for _, n in crashes),
        "confounder_steps": confounder_steps(log, spans),
    }


def _horizon(curve_w: list[tuple[float, int]], curve_wo: list[tuple[float, int]]) -> dict[str, Any]:
    """When Guard's useful steps get ahead to stay. A lead held over less than the last tenth
    of the run is no verdict: then the horizon is extrapolated from the useful-step rates of
    the last quarter of the run (None: Guard is not gaining at those rates)."""
    ahead = ahead_after(curve_w, curve_wo)
    if (ahead is not None and ahead <= 0.9 * curve_w[-1][0]) or len(curve_w) < 4:
        return {"ahead_after_s": ahead, "extrapolated": False}
    q = len(curve_w) * 3 // 4
    span = curve_w[-1][0] - curve_w[q][0]
    rate_w = (curve_w[-1][1] - curve_w[q][1]) / span
    rate_wo = (curve_wo[-1][1] - curve_wo[q][1]) / span
    deficit = curve_wo[-1][1] - curve_w[-1][1]
    if rate_w <= rate_wo * 1.001:  # within noise: not gaining
        return {"ahead_after_s": None, "extrapolated": True}
    at = curve_w[-1][0] + max(0.0, deficit) / (rate_w - rate_wo)
    return {"ahead_after_s": round(at), "extrapolated": True}


def effect(
    with_guard: ClusterSimulator, without: ClusterSimulator, window_s: float = 60.0
) -> dict[str, Any]:
    """Per job: goodput, step time and its window-to-window variation with and without
    remediation (same seed and scenario), the useful-step curves and Guard's break-even."""
    truth_w, truth_wo = with_guard.truth(), without.truth()
    out = {}
    bin_s = max(window_s / 4, (truth_w.end_ts - truth_w.start_ts) / 200)
    for job in truth_w.jobs:
        name = job.job
        curves = {
            label: useful_curve(
                sim.step_times(name), crashes_of(sim, name), truth_w.start_ts, truth_w.end_ts, bin_s
            )
            for label, sim in (("with", with_guard), ("without", without))
        }
        out[name] = {
            "with_guard": _job_run(with_guard, truth_w, name, window_s),
            "without_guard": _job_run(without, truth_wo, name, window_s),
            "window_s": window_s,
            **_horizon(curves["with"], curves["without"]),
            "curves": curves,
            "steps": {
                "with": with_guard.step_times(name),
                "without": without.step_times(name),
            },
        }
    return out


def demo_effect(pipe: Pipeline) -> dict[str, Any]:
    """The effect of remediation against the counterfactual: same seed and scenario, no
    remediation (fail-stop faults crash-loop until a person drains the node)."""
    assert pipe.sim is not None
    counterfactual = ClusterSimulator(pipe.config.sim_config(pipe.start_ts))
    for _ in counterfactual.messages():
        pass
    return effect(pipe.sim, counterfactual)


def cordon_lags(pipe: Pipeline) -> list[dict[str, Any]]:
    """Per cordoned node: how long from its first claim (the flag's event time) to the cordon,
    split into the streams' round trip (the event time published meanwhile: the replay runs
    ``speed`` times faster than wall time) and the orchestrator's part, in simulated seconds,
    with the round trip's wall seconds (what it would cost at 1x)."""
    first_cordon: dict[str, float] = {}
    for st in pipe.state_log:
        if st.state == "cordoned":
            first_cordon.setdefault(st.node, st.ts)
    out = []
    for node, cordon_ts in sorted(first_cordon.items(), key=lambda kv: kv[1]):
        claim = pipe.first_claim.get(node)
        if claim is None:
            continue
        flag_ts, seen_ts, seen_wall = claim
        wall = pipe.cordon_wall.get(node, seen_wall)
        out.append(
            {
                "node": node,
                "flag_s": round(flag_ts - pipe.start_ts, 1),
                "lag_s": round(cordon_ts - flag_ts, 1),
                "streams_s": round(seen_ts - flag_ts, 1),
                "streams_wall_s": round((seen_ts - flag_ts) / pipe.speed, 2),
                "orchestrator_s": round(cordon_ts - seen_ts, 1),
                "orchestrator_wall_s": round(max(0.0, wall - seen_wall), 2),
            }
        )
    return out


def _gain(with_guard: ClusterSimulator, without: ClusterSimulator) -> dict[str, dict[str, Any]]:
    """Per job: goodput with and without Guard, and the gain in % (None: none without)."""
    truth_w, truth_wo = with_guard.truth(), without.truth()
    out: dict[str, dict[str, Any]] = {}
    for job in truth_w.jobs:
        w = _job_run(with_guard, truth_w, job.job, 60.0)["goodput_per_h"]
        wo = _job_run(without, truth_wo, job.job, 60.0)["goodput_per_h"]
        gain = round(100 * (w / wo - 1), 1) if wo else None
        out[job.job] = {"with_guard": w, "without_guard": wo, "gain_pct": gain}
    return out


def compression_check(
    pipe: Pipeline, factors: tuple[float, ...] = (0.5, 1.0, 2.0)
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per compression, per job: goodput with and without Guard and the gain (%), with the
    job's mechanics compressed ``factor`` times the demo's compression: the simulator rerun
    both ways, Guard's cordons replayed at the event times the pipeline made them (detection
    is not compressed)."""
    assert pipe.sim is not None
    cordons = sorted(
        {st.node: st.ts for st in reversed(pipe.state_log) if st.state == "cordoned"}.items(),
        key=lambda kv: kv[1],
    )
    out = {}
    for factor in factors:
        cfg = replace(pipe.config, compression=pipe.config.compression * factor)
        with_guard = ClusterSimulator(cfg.sim_config(pipe.start_ts))
        pending = list(cordons)
        for batch in with_guard.batches():
            while pending and batch and batch[-1].ts >= pending[0][1]:
                with_guard.remediate(pending.pop(0)[0])
        without = ClusterSimulator(cfg.sim_config(pipe.start_ts))
        for _ in without.batches():
            pass
        out[f"{cfg.compression:g}"] = _gain(with_guard, without)
    return out


def _stored_rows(pipe: Pipeline) -> dict[str, int]:
    db = pipe.settings.clickhouse.database
    return {
        table: int(pipe.client.query(f"SELECT count() FROM `{db}`.`{table}`").result_rows[0][0])
        for table in (t.name for t in TABLES)
    }


def summarize(pipe: Pipeline, wall_s: float, effects: dict[str, Any]) -> dict[str, Any]:
    """Everything the demo reports, as plain data (``effects``: :func:`demo_effect`)."""
    assert pipe.sim is not None and pipe.flag_reader is not None and pipe.orchestrator is not None
    truth = pipe.sim.truth()
    flags = [f.model_dump() for f in pipe.flag_reader.flags]
    ev = evaluate(truth, flags)
    snapshot = pipe.orchestrator.core.snapshot()
    faults = _faults(truth, ev.first_hit, snapshot)
    swept = sorted({s.node for s in pipe.sweeps})
    final = {node: getattr(v, "state", str(v)) for node, v in snapshot.items()}
    claims = [f for f in flags if f["severity"] != "info" and f.get("node")]
    return {
        "cluster": {
            "nodes": len(truth.nodes),
            "gpus": len(truth.nodes) * truth.gpus_per_node,
            "jobs": {j.job: len(j.nodes) for j in truth.jobs},
            "simulated_s": pipe.config.duration_s,
            "speed": round(pipe.speed, 2),
        },
        "messages_published": pipe.published,
        "faults_injected": len(truth.faults),
        "faults_detected": sum(f["detected"] for f in faults),
        "faults": faults,
        "confounders": dict(Counter(c.kind for c in truth.confounders)),
        "flags": {
            "claims": len(claims),
            "info": len(flags) - len(claims),
            "false_claims": len(ev.false_claims),
            "false_claim_examples": ev.false_claims[:5],
        },
        "precision": ev.precision,
        "recall": ev.rows["all"].recall,
        "nodes": {
            "swept": swept,
            "released": sorted(n for n in swept if final.get(n) == "healthy"),
            "repair": sorted(n for n, st in final.items() if st == "repair"),
            "sweeps_run": len(pipe.sweeps),
        },
        "step_time": {
            job: {k: v for k, v in e.items() if k not in ("curves", "steps")}
            for job, e in effects.items()
        },
        "compression": {
            "factor": pipe.config.compression,
            "job_timings_s": pipe.config.job_timings(),
            "gain_pct_by_compression": compression_check(pipe),
        },
        "cordon_lag": cordon_lags(pipe),
        "clickhouse_rows": _stored_rows(pipe),
        "wall_s": round(wall_s, 1),
    }


def print_summary(summary: dict[str, Any], out: Any) -> None:
    from rich.console import Console
    from rich.table import Column, Table

    console = Console(file=out)
    c = summary["cluster"]
    console.rule("[bold]Guard demo: summary")
    console.print(
        f"{c['nodes']} nodes / {c['gpus']} GPUs, jobs {c['jobs']}, {c['simulated_s']:.0f} s "
        f"simulated at {c['speed']}x in {summary['wall_s']} s; "
        f"{summary['messages_published']:,} telemetry messages through Kafka"
    )
    # fits 80 columns with the longest fault names whole (category under the kind)
    table = Table(
        Column("fault", no_wrap=True), "node", "onset", "slow", "found", "time to detect",
        "outcome",
    )  # fmt: skip
    for f in summary["faults"]:
        table.add_row(
            f"{f['kind']}\n({f['category']})",
            f["node"],
            f"t+{f['onset_s']:.0f}s",
            f"{f['slowdown']:.0%}",
            "yes" if f["detected"] else "[red]no",
            "-" if f["time_to_detect_s"] is None else f"{f['time_to_detect_s']:.0f} s",
            f["final_state"],
        )
    console.print(table)
    fl = summary["flags"]
    console.print(
        f"faults detected {summary['faults_detected']}/{summary['faults_injected']}; "
        f"claims {fl['claims']} (false {fl['false_claims']}), observations {fl['info']}; "
        f"confounders injected: {summary['confounders']}"
    )
    n = summary["nodes"]
    console.print(
        f"sweeps run {n['sweeps_run']}: swept {n['swept'] or '-'}, released "
        f"{n['released'] or '-'}, sent to repair {n['repair'] or '-'}"
    )
    _print_effect(console, summary["step_time"], summary["cluster"]["simulated_s"])
    _print_compression(console, summary)
    console.print(f"ClickHouse rows: {summary['clickhouse_rows']}")
    console.print(
        f"peak memory: demo {summary['peak_rss_mb']['demo']} MB, "
        f"largest worker {summary['peak_rss_mb']['largest_worker']} MB"
    )


def _print_effect(console: Any, step_time: dict[str, Any], simulated_s: float) -> None:
    from rich.table import Table

    table = Table(
        "job",
        "goodput, useful steps/h (with / without)",
        "mean step",
        "step-time CV, window to window",
        "crashes (lost steps)",
        "checkpoint / data-stall steps",
    )
    for job, st in step_time.items():
        w, wo = st["with_guard"], st["without_guard"]
        gain = (
            f"{w['goodput_per_h'] / wo['goodput_per_h'] - 1:+.1%}" if wo["goodput_per_h"] else "n/a"
        )
        table.add_row(
            job,
            f"{w['goodput_per_h']:.0f} / {wo['goodput_per_h']:.0f} ({gain})",
            f"{w['mean_s']:.3f} / {wo['mean_s']:.3f} s",
            f"{w['window_cv']:.1%} / {wo['window_cv']:.1%}",
            f"{w['crashes']} ({w['lost_steps']}) / {wo['crashes']} ({wo['lost_steps']})",
            f"{w['confounder_steps']['steps']} / {wo['confounder_steps']['steps']}",
        )
    window = next(iter(step_time.values()), {}).get("window_s", 60.0)
    console.print(
        f"with Guard / without remediation (same seed; without, an Xid or DBE crash-loops the "
        f"job until a person drains the node); CV over {window:.0f}-s windows, checkpoint and "
        "data-stall steps left out:"
    )
    console.print(table)
    for job, st in step_time.items():
        ahead = st["ahead_after_s"]
        if ahead is None:
            verdict = "not ahead to stay, and not gaining at the end's rates"
        elif st["extrapolated"]:
            verdict = f"ahead after t+{ahead:.0f} s (extrapolated past the {simulated_s:.0f}-s run)"
        else:
            verdict = f"ahead from t+{ahead:.0f} s on"
        console.print(f"  {job}: Guard's useful steps are {verdict}")


def _print_compression(console: Any, summary: dict[str, Any]) -> None:
    comp = summary["compression"]
    t = comp["job_timings_s"]
    console.print(
        f"time compression: the job's mechanics run {comp['factor']:g}x fast (watchdog "
        f"{t['watchdog_s']:.0f} s, checkpoint every {t['checkpoint_every_s']:.0f} s, restart "
        f"{t['restart_s']:.0f} s, re-crash {t['recrash_s']:.0f} s, a person drains a "
        f"crash-looping node after {t['human_drain_s']:.0f} s; real: 600 / 1,800 / 600 / 120 / "
        "7,200 s); telemetry, detection, the orchestrator and checkpoint saves are not "
        "compressed, so Guard's detection is relatively faster here than in a real job"
    )
    gains = comp["gain_pct_by_compression"]
    jobs = sorted({j for g in gains.values() for j in g})
    for job in jobs:
        cells = []
        for c, g in gains.items():
            run = g[job]
            gain = "" if run["gain_pct"] is None else f" ({run['gain_pct']:+.1f}%)"
            cells.append(f"{c}x {run['with_guard']:.0f} / {run['without_guard']:.0f}{gain}")
        console.print(
            f"  {job}: goodput with / without Guard by compression (same cordons replayed): "
            + ", ".join(cells)
        )
    lags = summary["cordon_lag"]
    if lags:
        console.print(
            f"cordon lag after the first claim, simulated s (at {summary['cluster']['speed']}x "
            "replay: the streams' round trip in wall s times the speed, then the orchestrator):"
        )
        for lag in lags:
            console.print(
                f"  {lag['node']}: flag t+{lag['flag_s']:.0f}s, cordon {lag['lag_s']:.0f} s "
                f"later = streams {lag['streams_s']:.0f} s ({lag['streams_wall_s']:.1f} s wall) "
                f"+ orchestrator {lag['orchestrator_s']:.0f} s "
                f"({lag['orchestrator_wall_s']:.1f} s wall)"
            )


def demo_report_data(pipe: Pipeline, effects: dict[str, Any], summary: dict[str, Any]) -> Any:
    """The demo's run as the report's data: both runs' steps and useful-step curves, the
    flags and node states Guard produced, and time to detect per fault."""
    from guard.evaluation.report import ReportData, first_cordons, flag_rows, time_to_cordon

    assert pipe.sim is not None and pipe.flag_reader is not None
    truth = pipe.sim.truth()
    data = ReportData(
        title=f"Guard demo: {summary['cluster']['gpus']} GPUs, "
        f"{summary['cluster']['simulated_s']:.0f} s simulated",
        start_ts=truth.start_ts,
        end_ts=truth.end_ts,
    )
    labels = {"with": "with Guard", "without": "without Guard"}
    for job, e in effects.items():
        data.steps[job] = {labels[k]: v for k, v in e["steps"].items()}
        data.useful[job] = {
            labels[k]: [(t, float(n)) for t, n in v] for k, v in e["curves"].items()
        }
        data.goodput[job] = {
            "with Guard": e["with_guard"]["goodput_per_h"],
            "without Guard": e["without_guard"]["goodput_per_h"],
        }
    data.flags = flag_rows(pipe.flag_reader.flags)
    data.states = [{"ts": s.ts, "node": s.node, "state": s.state} for s in pipe.state_log]
    cordons = first_cordons(data.states)
    data.faults = [
        {
            "id": f["id"],
            "node": f["node"],
            "kind": f["kind"],
            "ttd_s": f["time_to_detect_s"],
            "ttc_s": time_to_cordon(cordons, f["node"], truth.start_ts + f["onset_s"]),
        }
        for f in summary["faults"]
    ]
    data.notes.append(
        "Without Guard: the same seed and scenario, no remediation; an Xid or double-bit ECC "
        f"error hangs the job until the NCCL watchdog "
        f"({pipe.config.job_timings()['watchdog_s']:.0f} s: the job's mechanics are compressed "
        f"{pipe.config.compression:g}x), it restarts from its last checkpoint and crashes again "
        "until a person drains the node."
    )
    for job, st in summary["step_time"].items():
        if st["ahead_after_s"] is not None:
            how = " (extrapolated)" if st["extrapolated"] else ""
            data.notes.append(
                f"{job}: Guard ahead in useful steps after t+{st['ahead_after_s']:.0f} s{how}."
            )
    return data

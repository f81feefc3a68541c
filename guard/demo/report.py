"""What the demo reports: the summary as plain data (:func:`summarize`) and its rendering."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from guard.agents.simulator import ClusterSimulator
from guard.evaluation.scoring import evaluate
from guard.schemas.tables import TABLES
from guard.schemas.truth import Truth

from .pipeline import Pipeline

__all__ = ["print_summary", "step_stats", "summarize"]


def step_stats(step_log: list[tuple[float, float]], after_ts: float) -> dict[str, float | int]:
    values = [s for ts, s in step_log if ts >= after_ts]
    if len(values) < 2:
        return {"steps": len(values), "mean_s": values[0] if values else 0.0, "cv": 0.0}
    mean = statistics.fmean(values)
    return {"steps": len(values), "mean_s": mean, "cv": statistics.pstdev(values) / mean}


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


def _step_time(pipe: Pipeline, truth: Truth) -> dict[str, Any]:
    """Step times with Guard against the counterfactual: same seed and scenario, no remedy."""
    assert pipe.sim is not None
    first_onset = min((f.onset for f in truth.faults), default=truth.start_ts)
    counterfactual = ClusterSimulator(pipe.config.sim_config(pipe.start_ts))
    for _ in counterfactual.messages():
        pass
    step_time = {}
    for job in truth.jobs:
        name = job.job
        step_time[name] = {
            "with_guard": step_stats(pipe.sim.step_times(name), first_onset),
            "without_guard": step_stats(counterfactual.step_times(name), first_onset),
            # restarts after a cordon cost steps: goodput is the honest bottom line
            "steps_total_with": len(pipe.sim.step_times(name)),
            "steps_total_without": len(counterfactual.step_times(name)),
        }
    return step_time


def _stored_rows(pipe: Pipeline) -> dict[str, int]:
    db = pipe.settings.clickhouse.database
    return {
        table: int(pipe.client.query(f"SELECT count() FROM `{db}`.`{table}`").result_rows[0][0])
        for table in (t.name for t in TABLES)
    }


def summarize(pipe: Pipeline, wall_s: float) -> dict[str, Any]:
    """Everything the demo reports, as plain data."""
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
        "step_time": _step_time(pipe, truth),
        "clickhouse_rows": _stored_rows(pipe),
        "wall_s": round(wall_s, 1),
    }


def print_summary(summary: dict[str, Any], out: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    c = summary["cluster"]
    console.rule("[bold]Guard demo: summary")
    console.print(
        f"{c['nodes']} nodes / {c['gpus']} GPUs, jobs {c['jobs']}, {c['simulated_s']:.0f} s "
        f"simulated at {c['speed']}x in {summary['wall_s']} s; "
        f"{summary['messages_published']:,} telemetry messages through Kafka"
    )
    table = Table("fault", "node", "onset", "slowdown", "detected", "time to detect", "outcome")
    for f in summary["faults"]:
        table.add_row(
            f"{f['kind']} ({f['category']})",
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
    steps = Table(
        "job", "mean step, with Guard", "CV", "without", "CV", "steps done (with / without)"
    )
    for job, st in summary["step_time"].items():
        w, wo = st["with_guard"], st["without_guard"]
        steps.add_row(
            job,
            f"{w['mean_s']:.3f} s",
            f"{w['cv']:.1%}",
            f"{wo['mean_s']:.3f} s",
            f"{wo['cv']:.1%}",
            f"{st['steps_total_with']} / {st['steps_total_without']}",
        )
    console.print("step time after the first fault, same seed, with and without remediation:")
    console.print(steps)
    console.print(f"ClickHouse rows: {summary['clickhouse_rows']}")
    console.print(
        f"peak memory: demo {summary['peak_rss_mb']['demo']} MB, "
        f"largest worker {summary['peak_rss_mb']['largest_worker']} MB"
    )

"""``run_demo``: the pipeline on a simulated cluster, with progress while it runs and a summary."""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from guard.config import Settings

from .pipeline import DemoConfig, Pipeline
from .report import demo_effect, demo_report_data, print_summary, summarize

__all__ = ["run_demo"]


def _demo_settings(settings: Settings, home: Path) -> None:
    settings.home = home
    settings.clickhouse.dsn = f"chdb://{home / 'chdb'}"
    settings.streams.app_id = "guard-demo-streams"
    settings.kafka.telemetry_partitions = min(settings.kafka.telemetry_partitions, 4)
    settings.clickhouse.batch_seconds = 1.0
    # Nodes in repair count against the cordon cap and no one repairs the simulated ones: a
    # quarter of the cluster may be held, so that every injected fault is seen through.
    settings.orchestrator.max_cordoned_fraction = max(
        settings.orchestrator.max_cordoned_fraction, 0.25
    )


def run_demo(
    settings: Settings, config: DemoConfig, as_json: bool = False, report: Path | None = None
) -> dict[str, Any]:
    """Run the demo end to end and return (and print) its summary; ``report``: also write
    the HTML report there."""
    home = config.home or Path(tempfile.mkdtemp(prefix="guard-demo-"))
    _demo_settings(settings, home)
    out = sys.stderr
    pipe = Pipeline(settings, config)
    started = time.monotonic()
    print(
        f"guard demo: starting broker, store, streams worker(s), sink and orchestrator "
        f"(data in {home})",
        file=out,
        flush=True,
    )
    try:
        pipe.start()
        print(
            f"guard demo: {config.nodes} simulated nodes, {config.duration_s:.0f} s at "
            f"{pipe.speed:.1f}x",
            file=out,
            flush=True,
        )
        _publish_with_progress(pipe, out, live=not as_json and out.isatty())
        if not pipe.drain():
            print("guard demo: warning: the pipeline did not drain in time", file=out)
        pipe.finish_sink()
        effects = demo_effect(pipe)
        summary = summarize(pipe, time.monotonic() - started, effects)
        if report is not None:
            _write_report(report, demo_report_data(pipe, effects, summary), out)
    finally:
        pipe.stop()
    summary["peak_rss_mb"] = {
        "demo": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "largest_worker": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
    }
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary, sys.stdout)
    return summary


def _write_report(path: Path, data: Any, out: Any) -> None:
    from guard.evaluation.report import render_html

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(data), encoding="utf-8")
    print(f"guard demo: report written to {path}", file=out, flush=True)


def _publish_with_progress(pipe: Pipeline, out: Any, live: bool) -> None:
    publisher = threading.Thread(target=pipe.publish, name="guard-demo-publish", daemon=True)
    publisher.start()
    if live:
        _live_progress(pipe, publisher)
    else:
        _line_progress(pipe, publisher, out)
    pipe.raise_if_failed()


def _live_progress(pipe: Pipeline, publisher: threading.Thread) -> None:
    """A rich panel redrawn four times a second (on a terminal)."""
    from rich.live import Live
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    duration = pipe.config.duration_s

    def render() -> Panel:
        grid = Table.grid(padding=(0, 2))
        sim_s = min(duration, max(0.0, pipe.sim_now()))
        grid.add_row(
            ProgressBar(total=duration, completed=sim_s, width=40),
            f"t+{sim_s:.0f}/{duration:.0f} s simulated",
        )
        assert pipe.workers is not None and pipe.flag_reader is not None
        grid.add_row(
            "messages",
            f"{pipe.published:,} published, {pipe.workers.telemetry:,} processed by the streams",
        )
        claims = sum(1 for f in pipe.flag_reader.flags if f.severity != "info")
        grid.add_row(
            "flags", f"{claims} claims, {len(pipe.flag_reader.flags) - claims} observations"
        )
        states = Counter(pipe.states.values())
        grid.add_row("nodes", ", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "-")
        grid.add_row("events", "\n".join(pipe.events[-8:]) or "-")
        return Panel(grid, title="guard demo")

    with Live(render(), refresh_per_second=4, console=None, transient=False) as view:
        while publisher.is_alive():
            publisher.join(0.25)
            view.update(render())


def _line_progress(pipe: Pipeline, publisher: threading.Thread, out: Any) -> None:
    """Events as they happen and a progress line every 5 s (not a terminal, or --json)."""
    duration = pipe.config.duration_s
    last = 0.0
    shown = 0
    while publisher.is_alive():
        publisher.join(0.5)
        for line in pipe.events[shown:]:
            print(f"  {line}", file=out, flush=True)
        shown = len(pipe.events)
        if time.monotonic() - last >= 5:
            last = time.monotonic()
            assert pipe.workers is not None
            print(
                f"guard demo: t+{min(duration, pipe.sim_now()):.0f}/{duration:.0f} s, "
                f"{pipe.published:,} published, {pipe.workers.telemetry:,} processed",
                file=out,
                flush=True,
            )

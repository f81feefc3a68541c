"""``guard orchestrator``: the sweep orchestrator as a long-running command (flags → sweeps)."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from typing import Any

from guard.config import Settings
from guard.errors import GuardError, UsageError

from .common import add_log_level, add_metrics_port, apply_options, configure_logging

__all__ = ["register", "when"]


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _load_truth(path: str) -> Any:
    from pydantic import ValidationError

    from guard.schemas.truth import Truth

    try:
        return Truth.load(path)
    except (OSError, ValidationError) as exc:
        raise GuardError(
            f"cannot read the truth file {path}: {exc}; write one with `guard simulate --truth`"
        ) from None


def _simulated(args: argparse.Namespace, settings: Settings) -> tuple[Any, Any]:
    """The simulated sweep executor and the clock for ``--truth``."""
    from guard.sweeps.executors import SimulatedSweepExecutor
    from guard.sweeps.orchestrator import SimulatedClock

    o = settings.orchestrator
    truth = _load_truth(args.truth)
    o.executor = "simulated"
    executor = SimulatedSweepExecutor.from_truth(truth, duration_s=args.sweep_delay)
    if not o.nodes:
        o.nodes = list(truth.nodes)
    clock: Any = time.time
    if args.speed is not None:
        sim_start = args.sim_start if args.sim_start is not None else truth.start_ts
        clock = SimulatedClock(sim_start, args.speed, args.wall_start)
    return executor, clock


def _show(message: Any) -> None:
    if message.kind == "node_state":
        print(
            f"{when(message.ts)} {message.node} {message.prev} -> {message.state}: "
            f"{message.reason}",
            flush=True,
        )
    else:
        verdict = "passed" if message.passed else "FAILED"
        print(f"{when(message.ts)} {message.node} {message.sweep}-node sweep {verdict}", flush=True)


def cmd_orchestrator(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import wait_for_broker
    from guard.metrics import Metrics
    from guard.shutdown import stop_on_signals
    from guard.sweeps.executors import NO_EXECUTOR_HINT
    from guard.sweeps.metrics import observe_orchestrator
    from guard.sweeps.service import KafkaOrchestrator

    configure_logging(args.log_level)
    args.node_list = [n for n in args.nodes.split(",") if n] if args.nodes else None
    apply_options(
        settings,
        args,
        {
            "orchestrator.scheduler": "scheduler",
            "orchestrator.nodes": "node_list",
            "metrics.orchestrator_port": "metrics_port",
        },
    )
    o = settings.orchestrator
    executor, clock = None, time.time
    if args.truth:
        executor, clock = _simulated(args, settings)
    elif o.executor == "simulated" and o.simulated_truth is None:
        raise UsageError("the simulated executor needs --truth TRUTH.json")
    metrics = Metrics("orchestrator", stale_s=settings.metrics.stale_s)
    with stop_on_signals() as stop:
        try:
            orchestrator = KafkaOrchestrator(
                settings, executor=executor, clock=clock, listeners=[_show], metrics=metrics
            )
        except ValueError as exc:
            raise GuardError(str(exc)) from None
        observe_orchestrator(metrics, orchestrator)
        m = settings.metrics
        server = metrics.serve(m.orchestrator_port, m.host, "metrics.orchestrator_port")
        executor_name = (
            type(orchestrator.core.executor).__name__
            if orchestrator.core.executor is not None
            else f"none ({NO_EXECUTOR_HINT})"
        )
        print(
            f"orchestrator: scheduler {orchestrator.core.scheduler.name}, executor "
            f"{executor_name}, flags from {settings.topic('remediation')}",
            file=sys.stderr,
            flush=True,
        )
        wait_for_broker(settings)
        try:
            orchestrator.run(stop)
        except (RuntimeError, TimeoutError) as exc:
            raise GuardError(str(exc)) from exc
        finally:
            if server is not None:
                server.close()
    return 0


def register(sub: Any, add: Any) -> None:
    """Add ``orchestrator`` to the ``guard`` parser."""
    p = add("orchestrator", cmd_orchestrator, "run the sweep orchestrator (flags → sweeps)")
    p.add_argument("--scheduler", choices=["dry-run", "slurm", "kubernetes"])
    p.add_argument("--nodes", help="node inventory, comma-separated (default: settings)")
    p.add_argument("--truth", help="simulator TRUTH.json: use the simulated sweep executor")
    p.add_argument("--speed", type=float, help="with --truth: simulated time runs this fast")
    p.add_argument("--sim-start", type=float, help="simulated time at --wall-start")
    p.add_argument("--wall-start", type=float, help="wall time of --sim-start (default: now)")
    p.add_argument("--sweep-delay", type=float, default=0.0, help="simulated sweep duration, s")
    add_metrics_port(p, "metrics.orchestrator_port")
    add_log_level(p, "warning", "transitions are printed anyway; info adds scheduler actions")

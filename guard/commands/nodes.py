"""``guard orchestrator`` and ``guard node list | show | release | repair``.

The node commands talk to Kafka only (the compacted ``guard.node-state`` topic): in embedded
mode ClickHouse belongs to another process, and the orchestrator, not the command, changes
node states — ``release`` and ``repair`` publish an operator request it applies.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guard.config import Settings

__all__ = ["register"]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fail(message: str) -> int:
    print(f"guard: error: {message}", file=sys.stderr)
    return 2


def cmd_orchestrator(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import wait_for_broker
    from guard.sweeps.executors import SimulatedSweepExecutor
    from guard.sweeps.orchestrator import SimulatedClock
    from guard.sweeps.service import KafkaOrchestrator

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    o = settings.orchestrator
    if args.scheduler:
        o.scheduler = args.scheduler
    if args.nodes:
        o.nodes = [n for n in args.nodes.split(",") if n]
    executor = None
    clock: Any = time.time
    if args.truth:
        truth = json.loads(Path(args.truth).read_text())
        o.executor = "simulated"
        executor = SimulatedSweepExecutor.from_truth(truth, duration_s=args.sweep_delay)
        if not o.nodes:
            o.nodes = list(truth.get("nodes", []))
        if args.speed is not None:
            clock = SimulatedClock(
                args.sim_start if args.sim_start is not None else float(truth["start_ts"]),
                args.speed,
                args.wall_start,
            )
    elif o.executor == "simulated" and o.simulated_truth is None:
        return _fail("the simulated executor needs --truth TRUTH.json")

    def show(message: Any) -> None:
        if message.kind == "node_state":
            print(
                f"{_when(message.ts)} {message.node} {message.prev} -> {message.state}: "
                f"{message.reason}",
                flush=True,
            )
        else:
            verdict = "passed" if message.passed else "FAILED"
            print(
                f"{_when(message.ts)} {message.node} {message.sweep}-node sweep {verdict}",
                flush=True,
            )

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        orchestrator = KafkaOrchestrator(settings, executor=executor, clock=clock, listeners=[show])
    except ValueError as exc:
        return _fail(str(exc))
    print(
        f"orchestrator: scheduler {orchestrator.core.scheduler.name}, executor "
        f"{type(orchestrator.core.executor).__name__}, flags from {settings.topic('remediation')}",
        file=sys.stderr,
        flush=True,
    )
    wait_for_broker(settings)
    try:
        orchestrator.run(stop)
    except (RuntimeError, TimeoutError) as exc:
        return _fail(str(exc))
    return 0


def _views(settings: Settings, args: argparse.Namespace, history: bool = False) -> Any:
    from guard.kafka import wait_for_broker
    from guard.sweeps.service import read_node_states

    wait_for_broker(settings, timeout_s=args.timeout)
    return read_node_states(settings, timeout_s=args.timeout, keep_history=history)


def _state_dict(state: Any) -> dict[str, Any] | None:
    if state is None:
        return None
    return {k: v for k, v in state.model_dump().items() if k not in ("kind", "v", "job")}


def cmd_node_list(args: argparse.Namespace, settings: Settings) -> int:
    try:
        views = _views(settings, args)
    except (RuntimeError, TimeoutError) as exc:
        return _fail(str(exc))
    rows = []
    for node in sorted(views):
        view = views[node]
        state = view.state.state if view.state else "healthy"
        if args.state and state not in args.state:
            continue
        rows.append((node, state, view))
    if args.json:
        data = [
            {
                "node": node,
                "state": state,
                "latest": _state_dict(view.state),
                "pending": _state_dict(view.pending),
            }
            for node, state, view in rows
        ]
        print(json.dumps(data, indent=2))
        return 0
    if not rows:
        print("no node has a recorded state (every node is healthy and untouched)")
        return 0
    print(f"{'NODE':<20} {'STATE':<9} {'SINCE (UTC)':<19}  REASON")
    for node, state, view in rows:
        since = _when(view.state.ts) if view.state else "-"
        reason = view.state.reason if view.state else ""
        if view.pending is not None:
            reason = f"[pending {view.pending.state} by {view.pending.actor}] {reason}"
        print(f"{node:<20} {state:<9} {since:<19}  {reason[:100]}")
    return 0


def cmd_node_show(args: argparse.Namespace, settings: Settings) -> int:
    from guard.sweeps.service import read_sweeps

    try:
        view = _views(settings, args, history=True).get(args.node)
        sweeps = read_sweeps(settings, args.node, timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        return _fail(str(exc))
    if view is None and not sweeps:
        print(f"{args.node}: no recorded state (healthy, never acted on)")
        return 0
    if args.json:
        data = {
            "node": args.node,
            "state": view.state.state if view and view.state else "healthy",
            "latest": _state_dict(view.state) if view else None,
            "pending": _state_dict(view.pending) if view else None,
            "history": [_state_dict(s) for s in view.history] if view else [],
            "sweeps": [s.model_dump(exclude={"kind", "v"}) for s in sweeps],
        }
        print(json.dumps(data, indent=2))
        return 0
    state = view.state.state if view and view.state else "healthy"
    print(f"{args.node}: {state}")
    if view and view.pending is not None:
        print(f"  pending request: {view.pending.state} by {view.pending.actor}")
    print("history (retained on the compacted topic):")
    for s in view.history if view else []:
        print(f"  {_when(s.ts)}  {s.prev or '-':>8} -> {s.state:<8} {s.actor:<16} {s.reason}")
    for sweep in sweeps:
        verdict = "passed" if sweep.passed else "FAILED"
        peers = f" with {', '.join(sweep.peers)}" if sweep.peers else ""
        print(f"{sweep.sweep}-node sweep {_when(sweep.ts)}{peers}: {verdict}")
        for c in sweep.checks:
            value = "-" if c.value is None else f"{c.value:g}"
            base = "" if c.baseline is None else f" (baseline {c.baseline:g})"
            mark = "ok  " if c.passed else "FAIL"
            print(f"  {mark} {c.name:<28} {value} {c.unit}{base}  {c.detail}")
    return 0


def _request(args: argparse.Namespace, settings: Settings, state: str) -> int:
    from guard.sweeps.service import request_operator_action, wait_for_answer

    try:
        current = _views(settings, args).get(args.node)
        prev = current.state.state if current and current.state else None
        request = request_operator_action(
            settings, args.node, state, args.reason or "", user=args.user, prev=prev
        )
    except (RuntimeError, TimeoutError) as exc:
        return _fail(str(exc))
    what = "release" if state == "healthy" else "repair"
    print(f"{what} of {args.node} requested (was {prev or 'healthy'})", flush=True)
    if args.wait <= 0:
        return 0
    answer = wait_for_answer(settings, request, args.wait)
    if answer is None:
        print(
            f"no answer from the orchestrator within {args.wait:g} s; the request stays on "
            f"{settings.topic('node-state')} and is applied when the orchestrator runs",
            file=sys.stderr,
        )
        return 1
    print(f"{args.node}: {answer.prev} -> {answer.state} ({answer.reason})")
    return 0


def cmd_node_release(args: argparse.Namespace, settings: Settings) -> int:
    return _request(args, settings, "healthy")


def cmd_node_repair(args: argparse.Namespace, settings: Settings) -> int:
    return _request(args, settings, "repair")


def register(sub: Any, add: Any) -> None:
    """Add ``orchestrator`` and ``node`` to the ``guard`` parser."""
    p = add("orchestrator", cmd_orchestrator, "run the sweep orchestrator (flags → sweeps)")
    p.add_argument("--scheduler", choices=["dry-run", "slurm", "kubernetes"])
    p.add_argument("--nodes", help="node inventory, comma-separated (default: settings)")
    p.add_argument("--truth", help="simulator TRUTH.json: use the simulated sweep executor")
    p.add_argument("--speed", type=float, help="with --truth: simulated time runs this fast")
    p.add_argument("--sim-start", type=float, help="simulated time at --wall-start")
    p.add_argument("--wall-start", type=float, help="wall time of --sim-start (default: now)")
    p.add_argument("--sweep-delay", type=float, default=0.0, help="simulated sweep duration, s")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="transitions are printed anyway; info adds scheduler actions",
    )

    node = sub.add_parser("node", help="node health").add_subparsers(dest="sub", required=True)
    p = add("list", cmd_node_list, "every node with a recorded state", node)
    p.add_argument("--state", action="append", help="only these states (repeatable)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=15.0)
    p = add("show", cmd_node_show, "one node's state history and sweeps", node)
    p.add_argument("node")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=15.0)
    for name, handler, text in (
        ("release", cmd_node_release, "return a node to the pool (the orchestrator uncordons it)"),
        ("repair", cmd_node_repair, "send a node to repair (cordoned until released)"),
    ):
        p = add(name, handler, text, node)
        p.add_argument("node")
        p.add_argument("--reason", help="why, recorded with the state")
        p.add_argument("--user", help="operator name (default: the login name)")
        p.add_argument(
            "--wait",
            type=float,
            default=10.0,
            help="seconds to wait for the orchestrator's answer (0: do not wait)",
        )
        p.add_argument("--timeout", type=float, default=15.0)

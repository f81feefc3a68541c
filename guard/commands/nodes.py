"""``guard node list | show | release | repair``.

The node commands talk to Kafka only (the compacted ``guard.node-state`` topic): in embedded
mode ClickHouse belongs to another process, and the orchestrator, not the command, changes
node states — ``release`` and ``repair`` publish an operator request it applies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from guard.config import Settings
from guard.errors import GuardError

from .orchestrator import when

__all__ = ["register"]


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """Kafka's failures (no broker, no answer in time) as the command's one-line error."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        if isinstance(exc, GuardError):
            raise
        raise GuardError(str(exc)) from exc


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
    with _one_line_errors():
        views = _views(settings, args)
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
        since = when(view.state.ts) if view.state else "-"
        reason = view.state.reason if view.state else ""
        if view.pending is not None:
            reason = f"[pending {view.pending.state} by {view.pending.actor}] {reason}"
        print(f"{node:<20} {state:<9} {since:<19}  {reason[:100]}")
    return 0


def cmd_node_show(args: argparse.Namespace, settings: Settings) -> int:
    from guard.sweeps.service import read_sweeps

    with _one_line_errors():
        view = _views(settings, args, history=True).get(args.node)
        sweeps = read_sweeps(settings, args.node, timeout_s=args.timeout)
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
        print(f"  {when(s.ts)}  {s.prev or '-':>8} -> {s.state:<8} {s.actor:<16} {s.reason}")
    for sweep in sweeps:
        verdict = "passed" if sweep.passed else "FAILED"
        peers = f" with {', '.join(sweep.peers)}" if sweep.peers else ""
        print(f"{sweep.sweep}-node sweep {when(sweep.ts)}{peers}: {verdict}")
        for c in sweep.checks:
            value = "-" if c.value is None else f"{c.value:g}"
            base = "" if c.baseline is None else f" (baseline {c.baseline:g})"
            mark = "ok  " if c.passed else "FAIL"
            print(f"  {mark} {c.name:<28} {value} {c.unit}{base}  {c.detail}")
    return 0


def _request(args: argparse.Namespace, settings: Settings, state: str) -> int:
    from guard.sweeps.service import request_operator_action, wait_for_answer

    with _one_line_errors():
        current = _views(settings, args).get(args.node)
        prev = current.state.state if current and current.state else None
        request = request_operator_action(
            settings, args.node, state, args.reason or "", user=args.user, prev=prev
        )
    what = "release" if state == "healthy" else "repair"
    print(f"{what} of {args.node} requested (was {prev or 'healthy'})", flush=True)
    if args.wait <= 0:
        return 0
    answer = wait_for_answer(settings, request, args.wait)
    if answer is None:
        raise GuardError(
            f"no answer from the orchestrator within {args.wait:g} s; the request stays on "
            f"{settings.topic('node-state')} and is applied when the orchestrator runs"
        )
    print(f"{args.node}: {answer.prev} -> {answer.state} ({answer.reason})")
    return 0


def cmd_node_release(args: argparse.Namespace, settings: Settings) -> int:
    return _request(args, settings, "healthy")


def cmd_node_repair(args: argparse.Namespace, settings: Settings) -> int:
    return _request(args, settings, "repair")


def register(sub: Any, add: Any) -> None:
    """Add ``node`` to the ``guard`` parser."""
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

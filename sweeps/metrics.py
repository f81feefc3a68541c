"""What the sweep orchestrator shows on ``/metrics``: node states, the cordon cap, sweeps
by result, flags by outcome, webhook deliveries.

Read at scrape time from the orchestrator's own records and counters, plus a listener that
counts the sweep results and node states it publishes; see :mod:`guard.metrics`. Two
histograms, declared here once per process, are observed where the work ends: a sweep's
duration (:func:`sweep_finished`, the orchestrator) and a webhook delivery's, retries
included (:func:`webhook_delivery`, the notifier).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

from guard.metrics import DEAD_LETTER_REASONS, Metrics
from guard.schemas import NODE_STATES, GuardMessage, NodeState, SweepResult

__all__ = ["SWEEP_DURATION", "WEBHOOK_DELIVERY", "observe_orchestrator"]

SWEEP_DURATION = Histogram(
    "guard_sweep_duration_seconds",
    "a sweep from its start to its result (timeouts included), by sweep and result",
    ["sweep", "result"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200),
    registry=None,
)
WEBHOOK_DELIVERY = Histogram(
    "guard_webhook_delivery_duration_seconds",
    "a webhook notification from the first attempt to delivered or given up, by result",
    ["result"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=None,
)


def sweep_finished(sweep: str, passed: bool, seconds: float) -> None:
    SWEEP_DURATION.labels(sweep, "passed" if passed else "failed").observe(max(0.0, seconds))


def webhook_delivery(delivered: bool, seconds: float) -> None:
    WEBHOOK_DELIVERY.labels("delivered" if delivered else "failed").observe(seconds)


class _Published:
    """An orchestrator listener: sweep results by kind and result, transitions by state."""

    def __init__(self) -> None:
        self.sweeps: collections.Counter[tuple[str, str]] = collections.Counter()
        self.transitions: collections.Counter[str] = collections.Counter()

    def __call__(self, message: GuardMessage) -> None:
        if isinstance(message, SweepResult):
            self.sweeps[(message.sweep, "passed" if message.passed else "failed")] += 1
        elif isinstance(message, NodeState):
            self.transitions[message.state] += 1


def observe_orchestrator(metrics: Metrics, orchestrator: Any) -> None:
    """``orchestrator``: a :class:`~guard.sweeps.service.KafkaOrchestrator`."""
    core = orchestrator.core
    published = _Published()
    core.listeners.append(published)
    m = metrics

    def states() -> dict[tuple[str, ...], float]:
        counts = collections.Counter(s.state for s in core.snapshot().values())
        return {(state,): counts.get(state, 0) for state in NODE_STATES}

    def out_of_pool() -> int:
        return sum(core.policy.counts_against_cap(s.state) for s in core.snapshot().values())

    def stat(prefix: str) -> dict[tuple[str, ...], float]:
        items = dict(core.stats).items()
        return {(k.removeprefix(prefix),): n for k, n in items if k.startswith(prefix)}

    m.gauge("guard_nodes", "nodes Guard has acted on, by state", states, ("state",))
    m.gauge(
        "guard_cordoned_nodes",
        "nodes Guard holds out of the pool (counted against the cap)",
        out_of_pool,
    )
    m.gauge(
        "guard_cordon_cap",
        "most nodes Guard may hold out of the pool at once",
        lambda: core.policy.cordon_limit(core.cluster_size()),
    )
    m.counter(
        "guard_sweeps_total",
        "sweeps finished, by sweep and result",
        lambda: {k: float(n) for k, n in dict(published.sweeps).items()},
        ("sweep", "result"),
        [(sweep, result) for sweep in ("single", "multi") for result in ("passed", "failed")],
    )
    m.counter(
        "guard_node_transitions_total",
        "node states published, by state",
        lambda: {(s,): n for s, n in dict(published.transitions).items()},
        ("state",),
        [(state,) for state in NODE_STATES],
    )
    m.counter(
        "guard_flags_received_total", "flags by outcome", lambda: stat("flags_"), ("outcome",)
    )
    m.counter(
        "guard_scheduler_errors_total",
        "cordon/uncordon calls the scheduler refused (retried)",
        lambda: core.stats.get("scheduler_errors", 0),
    )
    m.counter(
        "guard_cordons_deferred_total",
        "cordons put off by the cap (each waiting node, each tick)",
        lambda: core.stats.get("cordons_deferred", 0),
    )
    m.gauge(
        "guard_cordons_held_back",
        "qualified suspects the cordon cap holds back now",
        lambda: len(core.held_back),
    )
    m.gauge(
        "guard_sweeps_queued",
        "qualified suspects waiting, flagged but not cordoned, for a free sweep worker",
        lambda: len(core.queued),
    )
    m.gauge(
        "guard_sweeps_stopped",
        "1 while Guard cordons and sweeps nothing: too many recent sweeps failed",
        lambda: float(core.sweeps_stopped is not None),
    )
    m.counter(
        "guard_dead_letters_total",
        "records sent to the dead-letter topic, by reason",
        lambda: {(r,): n for r, n in dict(orchestrator.dead_reasons).items()},
        ("reason",),
        [(reason,) for reason in DEAD_LETTER_REASONS],
    )
    webhook = orchestrator.webhook
    for name, doc, attr in (
        ("guard_webhook_failures_total", "webhooks given up after every retry", "failed"),
        ("guard_webhook_deliveries_total", "webhooks delivered", "delivered"),
        ("guard_webhook_dropped_total", "webhooks dropped from a full queue", "dropped"),
    ):
        m.counter(name, doc, _attribute(webhook, attr))
    for sweep in ("single", "multi"):  # every series exists (zero) before the first sweep
        for result in ("passed", "failed"):
            SWEEP_DURATION.labels(sweep, result)
    for result in ("delivered", "failed"):
        WEBHOOK_DELIVERY.labels(result)
    m.include(SWEEP_DURATION, WEBHOOK_DELIVERY)


def _attribute(obj: object | None, name: str) -> Callable[[], float]:
    """A reader of ``obj.name`` (0 without ``obj``) for a counter."""
    return lambda: float(getattr(obj, name, 0)) if obj is not None else 0.0

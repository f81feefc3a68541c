"""What the node agent shows on ``/metrics``: messages by kind, delivery, spool, clients.

The families read the daemon's, the publisher's and the spool's own counters (the numbers
of the agent's status line) at scrape time; see :mod:`guard.metrics`.
"""

from __future__ import annotations

from typing import Any

from guard.metrics import Metrics
from guard.schemas.topics import JOB_KINDS, NODE_KINDS

__all__ = ["observe_agent"]


def observe_agent(metrics: Metrics, daemon: Any) -> None:
    """``daemon``: an :class:`~guard.agents.daemon.AgentDaemon` and its publisher."""
    m = metrics
    publisher = daemon.publisher
    m.counter(
        "guard_agent_messages_total",
        "messages published, by kind",
        lambda: {(kind,): n for kind, n in dict(daemon.kinds).items()},
        ("kind",),
        [(kind,) for kind in NODE_KINDS + JOB_KINDS],
    )
    m.counter("guard_agent_cycles_total", "sampling cycles", lambda: daemon.cycles)
    m.counter(
        "guard_agent_collector_errors_total",
        "collector calls that failed (the cycle went on)",
        lambda: daemon.collector_errors,
    )
    stats = getattr(publisher, "stats", None)
    if isinstance(stats, dict):
        m.counter(
            "guard_agent_records_total",
            "records by outcome: published, delivered, spooled, replayed, failed, rejected",
            lambda: {(outcome,): n for outcome, n in dict(stats).items()},
            ("outcome",),
        )
    spool = getattr(publisher, "spool", None)
    if spool is not None:
        m.gauge("guard_agent_spool_bytes", "bytes in the spool on disk", lambda: spool.size_bytes)
        m.gauge("guard_agent_spool_records", "spooled records not yet replayed", lambda: len(spool))
        m.counter(
            "guard_agent_spool_dropped_total",
            "records lost because the spool was full (oldest first)",
            lambda: spool.dropped,
        )
    listener = daemon.listener
    if listener is not None:
        m.counter(
            "guard_agent_client_messages_total",
            "training-client datagrams, by outcome",
            lambda: {
                ("received",): listener.received,
                ("invalid",): listener.invalid,
                ("dropped",): listener.dropped,
            },
            ("outcome",),
        )

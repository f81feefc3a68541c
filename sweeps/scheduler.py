"""Scheduler adapters: take a node out of the pool (cordon), put it back (uncordon), and
isolate the jobs on it (requeue them elsewhere).

Every adapter is idempotent — cordoning a cordoned node updates its reason, uncordoning
a node Guard did not cordon changes nothing — and touches only what Guard did: a node
someone else took out stays exactly as they left it. After a restart the orchestrator calls
``reassert``, which takes a node out again only when Guard's own mark is still on it (a node
an administrator put back is not taken out again: a cancel, see below).

An operator's word wins (design rule 5): an adapter may also offer ``overridden(node)`` (a
note saying who put a node Guard holds back in service and when, as far as the scheduler
says, or ``None``), ``lift(node)`` (remove Guard's own marks, and nothing the operator set),
``opted_out(node)`` (why Guard must never touch the node, or ``None``) and ``watch(held)``
(at start: mark every watched node, those Guard holds excepted). The orchestrator calls them
when present: a node put back by an operator is a cancel, not cordoned again for
``operator_holdoff_s``. ``idle_peers(candidates, want)`` (those of the healthy candidates that
run nothing now, in order) lets a multi-node sweep take idle peers before busy ones, and
``jobs_on(node)`` (the jobs running there) lets the orchestrator wait for them to end before
the sweep of an executor that does not wait itself (ssh, commands).

``cordon``/``reassert``/``uncordon`` return what they did (a word such as ``drained``,
``foreign`` for someone else's node, ``resumed-by-other`` when a restart finds the node back
in service), or ``None`` when the adapter cannot tell.

- :class:`DryRunScheduler` (default) records what it would do.
- :class:`guard.sweeps.slurm.SlurmScheduler`: DRAIN with a ``guard:`` Reason, a maintenance
  reservation for the sweep job, RESUME only Guard's own drain; ``scontrol requeue``.
- :class:`guard.sweeps.kubernetes.KubernetesScheduler`: cordon + ``guard.io/suspect=<reason>``
  taint + a ``GuardSuspect`` condition and an Event; undoes only what Guard added; deletes a
  job's pods so that their controller recreates them elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from guard.config import Settings

__all__ = [
    "ISOLATE_POLICIES",
    "JOBS_POLL_MAX_S",
    "DryRunScheduler",
    "JobsPollBackoff",
    "SchedulerAction",
    "SchedulerAdapter",
    "SchedulerError",
    "make_scheduler",
]

log = logging.getLogger(__name__)


class SchedulerError(RuntimeError):
    """The scheduler refused or could not be reached; the orchestrator retries later."""


#: The longest wait between two questions to the scheduler about a node's jobs.
JOBS_POLL_MAX_S = 15.0


class JobsPollBackoff:
    """The waits between two questions to the scheduler about a node's jobs (``squeue``, the
    node's pods) while Guard waits for them to end: ``first_s``, doubling up to ``max_s``
    (training jobs take minutes to drain; asking every second per waiting node only loads the
    scheduler), never past ``deadline`` (a ``time.monotonic()``), so that the last question is
    asked when the wait times out.

    Example
    -------
    >>> backoff = JobsPollBackoff(first_s=1.0, max_s=15.0)
    >>> [backoff.next_delay() for _ in range(7)]
    [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]
    """

    __slots__ = ("_next_s", "deadline", "max_s")

    def __init__(
        self, first_s: float = 1.0, max_s: float = JOBS_POLL_MAX_S, deadline: float | None = None
    ) -> None:
        self.max_s, self.deadline = max_s, deadline
        self._next_s = min(first_s, max_s)

    def next_delay(self) -> float:
        delay, self._next_s = self._next_s, min(self.max_s, self._next_s * 2)
        if self.deadline is not None:
            delay = min(delay, max(0.0, self.deadline - time.monotonic()))
        return delay

    def sleep(self) -> None:
        time.sleep(self.next_delay())


#: What happens to the jobs on a node Guard takes out: nothing, a note (which jobs), or a
#: restart elsewhere (Slurm requeue; Kubernetes: their pods deleted for the controller).
ISOLATE_POLICIES = ("off", "notify", "requeue")
IsolatePolicy = Literal["off", "notify", "requeue"]


class SchedulerAdapter(Protocol):
    name: str

    def cordon(self, node: str, reason: str) -> str | None: ...

    def reassert(self, node: str, reason: str) -> str | None:
        """After a restart: keep (or update) Guard's cordon, never re-take a node someone
        else put back or took over."""
        ...

    def uncordon(self, node: str) -> str | None: ...

    def isolate(self, node: str, policy: str) -> list[str]:
        """The jobs on the node (``notify``), restarted elsewhere under ``requeue``."""
        ...

    def inventory(self) -> list[str] | None:
        """Every node the scheduler knows, or ``None`` when it cannot tell."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerAction:
    ts: float
    action: str  # cordon | uncordon
    node: str
    reason: str = ""


class DryRunScheduler:
    """Changes nothing; keeps the actions it would have taken (``actions``, ``cordoned``,
    ``isolated``)."""

    name = "dry-run"

    def __init__(self, nodes: list[str] | None = None) -> None:
        self._nodes = list(nodes) if nodes else None
        self._lock = threading.Lock()
        self.actions: list[SchedulerAction] = []
        self.cordoned: set[str] = set()
        self.isolated: list[tuple[str, str]] = []

    def cordon(self, node: str, reason: str) -> str | None:
        with self._lock:
            self.actions.append(SchedulerAction(time.time(), "cordon", node, reason))
            self.cordoned.add(node)
        log.info("dry-run: would cordon %s (%s)", node, reason)
        return None

    def reassert(self, node: str, reason: str) -> str | None:
        return self.cordon(node, reason)

    def uncordon(self, node: str) -> str | None:
        with self._lock:
            self.actions.append(SchedulerAction(time.time(), "uncordon", node))
            self.cordoned.discard(node)
        log.info("dry-run: would uncordon %s", node)
        return None

    def isolate(self, node: str, policy: str) -> list[str]:
        with self._lock:
            self.isolated.append((node, policy))
        return []  # no jobs: nothing runs here

    def inventory(self) -> list[str] | None:
        return self._nodes


def make_scheduler(settings: Settings) -> SchedulerAdapter:
    """The adapter ``settings.orchestrator.scheduler`` names."""
    o = settings.orchestrator
    if o.scheduler == "slurm":
        from .slurm import SlurmScheduler

        return SlurmScheduler.from_settings(o)
    if o.scheduler == "kubernetes":
        from .kubernetes import KubernetesScheduler

        return KubernetesScheduler.from_settings(o)
    return DryRunScheduler(o.nodes or None)

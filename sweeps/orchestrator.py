"""The orchestrator's core: flags in, node-state transitions, scheduler actions and sweeps out.

:class:`Orchestrator` holds no Kafka client. It is driven by four calls — ``handle_flag``,
``handle_operator``, ``tick`` and, at start, ``recover``/``resume`` — and acts through what
it is given: a scheduler adapter, a sweep executor, and ``publish`` (which receives every
:class:`~guard.schemas.NodeState` and :class:`~guard.schemas.SweepResult` it emits, in
order). :class:`guard.sweeps.service.KafkaOrchestrator` wires it to Kafka; tests and the
demo can drive it directly.

Ordering makes restarts safe: a state that takes a node out of the pool is published
*before* the scheduler is told (a restart re-asserts the cordon of every node out of the
pool), and a node is uncordoned *before* ``healthy`` is published (a restart that finds it
still ``sweeping`` sweeps it again).

Time: every policy window compares the flags' event times with ``clock()``, so ``clock``
must run in the flags' time base — ``time.time`` in production, the simulator's clock
(:class:`SimulatedClock`) when the cluster is simulated at a speed-up.

Example
-------
>>> from guard.config import OrchestratorSettings
>>> from guard.schemas import Flag
>>> from guard.sweeps.executors import SimulatedFault, SimulatedSweepExecutor
>>> from guard.sweeps.scheduler import DryRunScheduler
>>> out = []
>>> orch = Orchestrator(
...     OrchestratorSettings(nodes=[f"n{i}" for i in range(8)]),
...     scheduler=DryRunScheduler(),
...     executor=SimulatedSweepExecutor([SimulatedFault("n1", "slow_gpu", 0.0, gpu=2,
...                                                     slowdown=0.2)]),
...     publish=out.append, clock=lambda: 100.0, inline_sweeps=True)
>>> orch.handle_flag(Flag(id="f1", ts=99.0, node="n1", gpu=2, detector="peer",
...                       category="straggler", severity="critical", score=5.0))
'qualified'
>>> orch.tick()
>>> [m.state for m in out if m.kind == "node_state"]
['suspect', 'cordoned', 'sweeping', 'failed', 'repair']
>>> [(m.sweep, m.passed) for m in out if m.kind == "sweep"]
[('single', False)]
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from guard.config import OrchestratorSettings
from guard.schemas import (
    SEVERITY_RANK,
    Flag,
    GuardMessage,
    NodeState,
    SweepCheck,
    SweepResult,
    stable_id,
)

from .executors import NO_EXECUTOR_HINT, SweepExecutor
from .metrics import sweep_finished
from .policy import SweepFailureStop, SweepPolicy
from .scheduler import JOBS_POLL_MAX_S, JobsPollBackoff, SchedulerAdapter, SchedulerError
from .states import (
    ALLOWED,
    FLAG_IN_REASON,
    NETWORK_CATEGORIES,
    OUT_OF_POOL,
    REASON_AWAITING_CORDON,
    REASON_AWAITING_REPAIR,
    REASON_CORDONED_FOR_REPAIR,
    REASON_PUT_BACK,
    InvalidTransition,
    NodeRecord,
    flags_note,
    is_operator,
    recover_views,
)

__all__ = ["NodeSummary", "Orchestrator", "SimulatedClock"]

log = logging.getLogger(__name__)

Publish = Callable[[GuardMessage], None]
#: Told when sweeping stops (True, why) and when it may go on again (False, why it stopped).
StopListener = Callable[[bool, str], None]

_SEEN_FLAG_IDS = 100_000
_HOLD_NOTE = re.compile(r"; (?:cap of \d|sweeping stopped: |queued: )")
_SCHEDULER_RETRY_S = 10.0
#: The first and the longest wait between two questions about a node's jobs (doubling).
_JOBS_POLL_S = 1.0
_JOBS_POLL_MAX_S = JOBS_POLL_MAX_S


class SimulatedClock:
    """Simulated time: ``sim_start`` at wall time ``wall_start``, running ``speed`` x faster."""

    def __init__(self, sim_start: float, speed: float = 1.0, wall_start: float | None = None):
        self.sim_start = sim_start
        self.speed = speed
        self.wall_start = time.time() if wall_start is None else wall_start

    def __call__(self) -> float:
        return self.sim_start + (time.time() - self.wall_start) * self.speed


@dataclass(slots=True)
class _SweepJob:
    node: str
    sweep: str
    peers: list[str]
    started: float
    deadline: float
    future: Future[list[SweepCheck]] | None = None
    checks: list[SweepCheck] | None = None


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """A node as the orchestrator sees it now (from :meth:`Orchestrator.snapshot`)."""

    node: str
    state: str
    since: float
    reason: str
    claims: int
    sweeps: tuple[SweepResult, ...] = field(default=())


class Orchestrator:
    """Policy, node-state machine, cordon cap and sweep sequencing for a cluster.

    Parameters
    ----------
    settings
        The ``orchestrator`` section of the settings (policy and sweep parameters).
    scheduler, executor
        Where cordons and sweeps go (:mod:`guard.sweeps.scheduler`, :mod:`guard.sweeps.executors`).
        ``executor=None``: no sweep can run, so a cordoned node stays cordoned (its reason
        and the log say what to configure) — nothing passes a sweep it did not get.
    publish
        Receives every node state and sweep result, in order (Kafka producer, list, ...).
    clock
        Current time in the flags' time base (see the module docstring).
    nodes
        Node inventory: sweep peers and the cluster size for the cordon cap. Default:
        ``settings.nodes``, else the scheduler's inventory, else the nodes seen so far.
    listeners
        Also called with every published message (the demo's progress, the webhook).
    inline_sweeps
        Run sweeps synchronously inside ``tick`` (tests, doctests) instead of in threads.
    stop_listeners
        Called with ``(True, why)`` when too many recent sweeps failed and Guard stops
        cordoning and sweeping (:class:`~guard.sweeps.policy.SweepFailureStop`), and with
        ``(False, why)`` when it goes on (the webhook's fleet alert).
    """

    def __init__(
        self,
        settings: OrchestratorSettings,
        *,
        scheduler: SchedulerAdapter,
        executor: SweepExecutor | None,
        publish: Publish,
        clock: Callable[[], float] = time.time,
        nodes: Sequence[str] | None = None,
        listeners: Iterable[Callable[[GuardMessage], None]] = (),
        inline_sweeps: bool = False,
        stop_listeners: Iterable[StopListener] = (),
    ) -> None:
        self.settings = settings
        self.policy = SweepPolicy.from_settings(settings)
        self.scheduler = scheduler
        self.executor = executor
        self._publish = publish
        self.clock = clock
        self.listeners = list(listeners)
        self.actor = settings.actor
        self._inventory: list[str] | None = list(nodes or settings.nodes) or None
        self._inventory_asked = self._inventory_fixed = self._inventory is not None
        self._next_node_watch = time.monotonic() + settings.node_watch_s
        self.records: dict[str, NodeRecord] = {}
        self._jobs: dict[str, _SweepJob] = {}
        self._scheduler_todo: dict[str, tuple[str, str, float]] = {}
        self._release_after_uncordon: dict[str, str] = {}
        #: what a cordoned node's sweep will say when it starts (the jobs isolated on it)
        self._sweep_notes: dict[str, str] = {}
        self._sweeps: dict[str, collections.deque[SweepResult]] = {}
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.RLock()
        self._pool = (
            None
            if inline_sweeps
            else ThreadPoolExecutor(
                max_workers=settings.sweep_workers, thread_name_prefix="guard-sweep"
            )
        )
        self.stats: collections.Counter[str] = collections.Counter()
        #: qualified suspects the cordon cap (or the stop) holds back now (as of the last tick)
        self.held_back: list[str] = []
        #: qualified suspects waiting, not cordoned, for a free sweep worker (the last tick)
        self.queued: list[str] = []
        self.failure_stop = SweepFailureStop.from_settings(settings)
        self.stop_listeners = list(stop_listeners)
        #: why Guard stopped cordoning and sweeping (as of the last tick), None while it sweeps
        self.sweeps_stopped: str | None = None
        self._next_operator_check = 0.0
        self._warned_time_base = False
        if executor is None:
            log.warning("%s", NO_EXECUTOR_HINT)

    # --- inputs -------------------------------------------------------------------------------

    def recover(self, states: Iterable[NodeState]) -> list[NodeState]:
        """Rebuild node records from the node-state topic (in order); returns the operator
        requests that came after the last orchestrator state of their node (to apply)."""
        with self._lock:
            pending = []
            states = list(states)
            for state in states:  # the sweeps of the stop's window, as far as compaction left them
                if is_operator(state.actor):
                    continue
                if state.state == "failed" or (state.state, state.prev) == ("healthy", "sweeping"):
                    self.failure_stop.record(state.ts, state.state == "healthy")
            for node, view in recover_views(states).items():
                if view.state is not None:
                    rec = self.records[node] = NodeRecord.from_state(view.state)
                    if rec.state == "healthy" and rec.reason.startswith(REASON_PUT_BACK):
                        rec.hold_off_until = rec.since + self.settings.operator_holdoff_s
                if view.pending is not None:
                    pending.append(view.pending)
            self.stats["recovered_nodes"] = len(self.records)
            return pending

    def resume(self, pending: Iterable[NodeState] = ()) -> None:
        """After :meth:`recover`: re-assert cordons, carry interrupted work on, apply requests."""
        with self._lock:
            self._judge_failure_rate(self.clock())  # the recovered failures may stop it at once
            self._watch_nodes()
            for rec in list(self.records.values()):
                if rec.state in OUT_OF_POOL:
                    done = self._call_scheduler(rec.node, "reassert", rec.reason)
                    if done == "resumed-by-other":
                        self._put_back_by_operator(rec, self._who_put_back(rec.node))
                        continue
                if rec.state == "sweeping":
                    self._start_sweep(rec, "single", [], restarted=True)
                elif rec.state == "failed":
                    self._transition(
                        rec, "repair", "sent to repair (failed a sweep before a restart)"
                    )
            for request in pending:
                self.handle_operator(request)

    def handle_flag(self, flag: Flag) -> str:
        """Apply the policy to one flag. Returns what it did (for counters and tests):
        ``observation``, ``duplicate``, ``stale``, ``suspect``, ``qualified``, ``evidence``
        (the node is already out of the pool) or ``repair`` (flagged again soon after a pass).
        """
        with self._lock:
            outcome = self._handle_flag(flag)
            self.stats[f"flags_{outcome}"] += 1
            return outcome

    def _handle_flag(self, flag: Flag) -> str:
        if not self.policy.is_claim(flag) or flag.node is None:
            return "observation"
        if flag.id in self._seen:
            return "duplicate"
        self._seen[flag.id] = None
        if len(self._seen) > _SEEN_FLAG_IDS:
            self._seen.popitem(last=False)
        now = self.clock()
        rec = self._record(flag.node)
        if now - flag.ts > self.policy.max_flag_age_s or (
            rec.released_ts is not None and flag.ts <= rec.released_ts
        ):
            if now - flag.ts > 10 * self.policy.max_flag_age_s and not self._warned_time_base:
                self._warned_time_base = True
                log.warning(
                    "flag %s is %.0f s older than the orchestrator's clock: is the clock in "
                    "the flags' time base (SimulatedClock for a simulated cluster)?",
                    flag.id,
                    now - flag.ts,
                )
            return "stale"
        if rec.state in OUT_OF_POOL:
            return "evidence"
        if rec.hold_off_until is not None:
            if now < rec.hold_off_until:
                return "held-off"  # an operator put it back in service: their word wins
            rec.hold_off_until = None
        self._add_claim(rec, flag)
        if rec.state == "healthy":
            if (
                rec.passed_sweep_ts is not None
                and flag.ts - rec.passed_sweep_ts <= self.policy.cooldown_s
            ):
                rec.to_repair = rec.qualified = True
                after = flag.ts - rec.passed_sweep_ts
                self._transition(
                    rec,
                    "suspect",
                    f"{REASON_AWAITING_REPAIR}: flagged again {after:.0f} s after passing a "
                    f"sweep ({_describe(flag)})",
                )
                return "repair"
            if self.policy.qualifies(rec):
                rec.qualified = True
                self._transition(rec, "suspect", f"{REASON_AWAITING_CORDON}: {_describe(flag)}")
                return "qualified"
            self._transition(rec, "suspect", _describe(flag))
            return "suspect"
        # suspect
        if not rec.qualified and self.policy.qualifies(rec):
            rec.qualified = True
            self._transition(
                rec,
                "suspect",
                f"{REASON_AWAITING_CORDON}: {len(rec.claims)} flags, latest {_describe(flag)}",
            )
            return "qualified"
        return "suspect"

    def handle_operator(self, request: NodeState) -> None:
        """An operator's request: ``healthy`` releases the node, ``repair`` sends it to repair.

        Applied whatever the node's state (a running sweep is abandoned) and always
        acknowledged with a state of the orchestrator's own, so the request is not pending
        any more on the compacted topic.
        """
        with self._lock:
            rec = self._record(request.node)
            who = request.actor
            why = f": {request.reason}" if request.reason else ""
            self.stats[f"operator_{request.state}"] += 1
            if request.state == "healthy":
                self._abandon_sweep(rec.node)
                if rec.state in OUT_OF_POOL:
                    self._call_scheduler(rec.node, "uncordon")
                rec.reset_claims()
                rec.passed_sweep_ts = None
                self._transition(rec, "healthy", f"released by {who}{why}", operator=True)
                rec.released_ts = rec.since
            elif request.state == "repair":
                self._abandon_sweep(rec.node)
                reason = f"sent to repair by {who}{why}"
                self._transition(rec, "repair", reason, operator=True)
                self._call_scheduler(rec.node, "cordon", reason)
            else:
                self._transition(
                    rec,
                    rec.state,
                    f"ignored {who}'s request for {request.state!r}: operators may ask for "
                    "healthy (release) or repair",
                    operator=True,
                )

    def tick(self) -> None:
        """Advance time: scheduler retries, finished and timed-out sweeps, suspects that did
        not persist, and cordons of qualified suspects while the cap allows."""
        with self._lock:
            now = self.clock()
            self._retry_scheduler()
            self._collect_sweeps()
            self._check_operator_undo()
            if time.monotonic() >= self._next_node_watch:
                self._watch_nodes()
            self._judge_failure_rate(now)
            for rec in list(self.records.values()):
                if rec.state == "cordoned" and rec.node not in self._jobs:
                    if rec.to_repair:
                        self._send_to_repair(rec, rec.reason.split(": ", 1)[-1])
                    elif (
                        rec.node not in self._scheduler_todo
                        and self.executor is not None
                        and self._can_start_sweep()
                    ):
                        self._start_sweep(
                            rec, "single", [], note=self._sweep_notes.pop(rec.node, "")
                        )
                elif (
                    rec.state == "suspect"
                    and not rec.qualified
                    and now - (rec.last_claim_ts or rec.since) > self.policy.suspect_ttl_s
                ):
                    count = len(rec.claims)
                    rec.reset_claims()
                    self._transition(
                        rec,
                        "healthy",
                        f"flags did not persist ({count} in the last "
                        f"{self.policy.suspect_ttl_s:.0f} s)",
                    )
            self._cordon_qualified()

    def close(self) -> None:
        """Stop the sweep threads (running sweeps are abandoned; a restart sweeps again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- views --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, NodeSummary]:
        """Every node the orchestrator has acted on, with its state and its recent sweeps."""
        with self._lock:
            return {
                node: NodeSummary(
                    node,
                    rec.state,
                    rec.since,
                    rec.reason,
                    len(rec.claims),
                    tuple(self._sweeps.get(node, ())),
                )
                for node, rec in self.records.items()
            }

    def state_of(self, node: str) -> str:
        with self._lock:
            rec = self.records.get(node)
            return rec.state if rec else "healthy"

    def sweeping(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def cluster_size(self) -> int:
        if self.settings.cluster_size:
            return self.settings.cluster_size
        inventory = self.inventory()
        return max(len(inventory or ()), len(self.records), 1)

    def inventory(self) -> list[str] | None:
        if not self._inventory_asked:
            self._inventory_asked = True
            self._inventory = self.scheduler.inventory()
        return self._inventory

    # --- internals ----------------------------------------------------------------------------

    def _record(self, node: str) -> NodeRecord:
        rec = self.records.get(node)
        if rec is None:
            rec = self.records[node] = NodeRecord(node)
        return rec

    def _add_claim(self, rec: NodeRecord, flag: Flag) -> None:
        rec.claims[flag.id] = flag
        rec.first_claim_ts = min(rec.first_claim_ts or flag.ts, flag.ts)
        rec.last_claim_ts = max(rec.last_claim_ts or flag.ts, flag.ts)
        rec.severity_rank = max(rec.severity_rank, SEVERITY_RANK[flag.severity])

    def _transition(self, rec: NodeRecord, state: str, reason: str, operator: bool = False) -> None:
        if not operator and state not in ALLOWED[rec.state]:
            raise InvalidTransition(f"{rec.node}: {rec.state} -> {state} is not allowed")
        if state in OUT_OF_POOL and not FLAG_IN_REASON.search(reason):
            # the flags stay named on the latest state: compaction and restarts keep them
            note = flags_note(self._flag_kinds(rec))
            reason = f"{reason}; {note}" if note else reason
        message = NodeState(
            ts=self.clock(),
            node=rec.node,
            state=state,
            prev=rec.state,
            reason=reason[:4096],
            actor=self.actor,
        )
        rec.prev, rec.state, rec.reason, rec.since = rec.state, state, message.reason, message.ts
        self.stats[f"to_{state}"] += 1
        log.info("%s: %s -> %s (%s)", rec.node, message.prev, state, reason)
        self._emit(message)

    def _flag_kinds(self, rec: NodeRecord) -> list[tuple[str, str]]:
        """(severity, category) of the node's claims, the most severe per category, in the
        order first seen; the ones a restart read back from its last reason first."""
        kinds = dict((c, s) for s, c in rec.flag_kinds)
        for flag in sorted(rec.claims.values(), key=lambda f: f.ts):
            was = kinds.get(flag.category)
            if was is None or SEVERITY_RANK[flag.severity] > SEVERITY_RANK[was]:
                kinds[flag.category] = flag.severity
        rec.flag_kinds = [(s, c) for c, s in kinds.items()]
        return rec.flag_kinds

    def _emit(self, message: GuardMessage) -> None:
        self._publish(message)
        for listener in self.listeners:
            try:
                listener(message)
            except Exception:
                log.exception("orchestrator listener failed on %s", message.kind)

    def _call_scheduler(self, node: str, action: str, reason: str = "") -> str | None:
        """What the scheduler did (its word, or ``done``); ``None`` when it failed (retried)."""
        try:
            if action == "cordon":
                done = self.scheduler.cordon(node, reason)
            elif action == "reassert":
                done = self.scheduler.reassert(node, reason)
            else:
                done = self.scheduler.uncordon(node)
        except SchedulerError as exc:
            log.error(
                "%s %s failed (retrying in %.0f s): %s", action, node, _SCHEDULER_RETRY_S, exc
            )
            self.stats["scheduler_errors"] += 1
            self._scheduler_todo[node] = (action, reason, time.monotonic() + _SCHEDULER_RETRY_S)
            return None
        self._scheduler_todo.pop(node, None)
        if done == "foreign":
            self.stats["scheduler_foreign"] += 1
        return done or "done"

    def _watch_nodes(self) -> None:
        """At start and every ``node_watch_s``: the scheduler marks every node Guard watches
        (Kubernetes: the condition False, as node-problem-detector does), the nodes Guard
        holds excepted, so that nodes that joined later are marked too; and the inventory
        (peers, cluster size), unless configured, is read again."""
        self._next_node_watch = time.monotonic() + self.settings.node_watch_s
        if not self._inventory_fixed and self._inventory_asked:
            try:
                self._inventory = self.scheduler.inventory() or self._inventory
            except SchedulerError as exc:  # the inventory read last stays
                log.warning("could not list the nodes in %s: %s", self.scheduler.name, exc)
        watch = getattr(self.scheduler, "watch", None)
        if watch is None:
            return
        held = {n for n, r in self.records.items() if r.state in OUT_OF_POOL}
        try:
            watch(held)
        except SchedulerError as exc:
            log.warning("could not mark the watched nodes in %s: %s", self.scheduler.name, exc)

    def _check_operator_undo(self) -> None:
        """Every ``operator_check_s``: has an operator put a node Guard holds back in service
        (kubectl uncordon, scontrol update State=RESUME)? That is a cancel."""
        overridden = getattr(self.scheduler, "overridden", None)
        if overridden is None or time.monotonic() < self._next_operator_check:
            return
        self._next_operator_check = time.monotonic() + self.settings.operator_check_s
        for rec in list(self.records.values()):
            if rec.state not in OUT_OF_POOL or rec.node in self._scheduler_todo:
                continue
            try:
                note = overridden(rec.node)
            except SchedulerError as exc:
                log.warning("could not read %s from %s: %s", rec.node, self.scheduler.name, exc)
                continue
            if note:
                self._put_back_by_operator(rec, note)

    def _who_put_back(self, node: str) -> str:
        """What the scheduler says of a node found back in service at start."""
        overridden = getattr(self.scheduler, "overridden", None)
        try:
            note = overridden(node) if overridden is not None else None
        except SchedulerError:
            note = None
        return f"while Guard was away; {note}" if note else "while Guard was away"

    def _put_back_by_operator(self, rec: NodeRecord, note: str) -> None:
        """An operator put a node Guard holds back in service: a cancel. Guard lifts its own
        marks (never the operator's change), records what the scheduler says of who and when,
        and does not cordon the node again for ``operator_holdoff_s``."""
        self._abandon_sweep(rec.node)
        lift = getattr(self.scheduler, "lift", None)
        if lift is not None:
            try:
                lift(rec.node)
            except SchedulerError as exc:  # its marks stay; the node is in service anyway
                log.warning("%s: could not lift Guard's marks: %s", rec.node, exc)
        rec.reset_claims()
        rec.passed_sweep_ts = None
        holdoff = self.settings.operator_holdoff_s
        self.stats["operator_put_back"] += 1
        self._transition(
            rec,
            "healthy",
            f"{REASON_PUT_BACK} in {self.scheduler.name} ({note}): Guard lifted its marks and "
            f"does not cordon it again for {holdoff:g} s",
            operator=True,
        )
        rec.released_ts = rec.since
        rec.hold_off_until = rec.since + holdoff

    def _opted_out(self, node: str) -> str | None:
        """Why Guard must never touch the node (config, or the scheduler's per-node mark)."""
        if node in self.settings.opt_out_nodes:
            return "listed in orchestrator.opt_out_nodes"
        opted_out = getattr(self.scheduler, "opted_out", None)
        if opted_out is None:
            return None
        try:
            why: str | None = opted_out(node)
        except SchedulerError as exc:  # cannot tell: the cordon itself will fail and be retried
            log.warning("could not read %s from %s: %s", node, self.scheduler.name, exc)
            return None
        return why

    def _isolate(self, node: str) -> str:
        """Apply ``isolate_policy`` to the jobs on a node just taken out; a note for its state."""
        policy = self.policy.isolate
        if policy == "off":
            return ""
        try:
            jobs = self.scheduler.isolate(node, policy)
        except SchedulerError as exc:
            log.error("%s: could not %s the jobs on it: %s", node, policy, exc)
            self.stats["isolate_errors"] += 1
            return f"; jobs on the node unknown ({exc})"[:300]
        if not jobs:
            return ""
        self.stats[f"jobs_{'requeued' if policy == 'requeue' else 'notified'}"] += len(jobs)
        shown = ", ".join(jobs[:20]) + (f" and {len(jobs) - 20} more" if len(jobs) > 20 else "")
        return f"; jobs on the node: {shown}" + (" (requeued)" if policy == "requeue" else "")

    def _retry_scheduler(self) -> None:
        for node, (action, reason, due) in list(self._scheduler_todo.items()):
            if time.monotonic() < due:
                continue
            if self._call_scheduler(node, action, reason) and node in self._release_after_uncordon:
                self._release(self.records[node], self._release_after_uncordon.pop(node))

    def _cordon_qualified(self) -> None:
        waiting = [r for r in self.records.values() if r.state == "suspect" and r.qualified]
        held: list[str] = []
        queued: list[str] = []
        try:
            self._cordon_within_cap(waiting, held, queued)
        finally:
            self._report_held_back(held)
            self.queued = queued

    def _report_held_back(self, held: list[str]) -> None:
        """Say when the cap starts and stops holding qualified suspects back (the gauge
        ``guard_cordons_held_back`` and each node's reason say how many and which)."""
        if held and not self.held_back:
            log.warning(
                "cordon cap of %d of %d nodes reached: holding back %d qualified suspect(s) "
                "(%s); they are cordoned as nodes come back to the pool",
                self.policy.cordon_limit(self.cluster_size()),
                self.cluster_size(),
                len(held),
                ", ".join(held[:10]) + (", ..." if len(held) > 10 else ""),
            )
        elif self.held_back and not held:
            log.warning("cordon cap no longer holds any suspect back")
        self.held_back = held

    def _judge_failure_rate(self, now: float) -> None:
        """Stop cordoning and sweeping while too many recent sweeps failed; say so once."""
        why = self.failure_stop.reason(now)
        if why == self.sweeps_stopped or (why is not None and self.sweeps_stopped is not None):
            return
        was = self.sweeps_stopped
        self.sweeps_stopped = why
        if why is not None:
            self.stats["sweeps_stopped"] += 1
            log.error(
                "sweeping stopped: %s; a check that fails healthy nodes must not drain the "
                "fleet. Nodes already out stay out; look at the failing checks (`guard node "
                "show NODE`), fix or release. Sweeping goes on once the share of failures within "
                "%g s is back at or under %g %%",
                why,
                self.failure_stop.window_s,
                self.failure_stop.fraction * 100,
            )
        else:
            log.warning("sweeping goes on: the failed sweeps behind the stop (%s) aged out", was)
        for listener in self.stop_listeners:
            try:
                listener(why is not None, why or was or "")
            except Exception:
                log.exception("orchestrator stop listener failed")

    def _cordon_within_cap(
        self, waiting: list[NodeRecord], held: list[str], queued: list[str]
    ) -> None:
        """Cordon qualified suspects, most urgent first, while the cap, the failure-rate stop
        and the sweep workers allow. A node to sweep is cordoned only when a worker is free
        to take it; the rest stay qualified suspects (``awaiting cordon``, which a restart
        reads back), so that the stop is judged again before each new cordon: a burst of
        flags with a broken check takes out at most ``sweep_workers`` more nodes than the
        stop's threshold, not the whole cap."""
        if not waiting:
            return
        waiting.sort(key=lambda r: (not r.to_repair, -r.severity_rank, r.first_claim_ts or r.since))
        limit = self.policy.cordon_limit(self.cluster_size())
        out = sum(self.policy.counts_against_cap(r.state) for r in self.records.values())
        free = self._free_sweep_workers()
        for rec in waiting:
            if self.sweeps_stopped is not None or out >= limit:
                note = (
                    f"sweeping stopped: {self.sweeps_stopped}"
                    if self.sweeps_stopped is not None
                    else f"cap of {limit} of {self.cluster_size()} nodes out of the pool reached"
                )
                self._note_hold(rec, note)
                self.stats["cordons_deferred"] += 1
                held.append(rec.node)
                continue
            if not rec.to_repair and free is not None and free <= 0:
                workers = self.settings.sweep_workers
                self._note_hold(rec, f"queued: all {workers} sweep workers busy")
                queued.append(rec.node)
                continue
            evidence = _without_hold_note(rec.reason.split(": ", 1)[-1])
            opted_out = self._opted_out(rec.node)
            if opted_out:
                rec.reset_claims()
                self.stats["opted_out"] += 1
                self._transition(
                    rec, "healthy", f"opted out of Guard ({opted_out}): left alone; {evidence}"
                )
                continue
            prefix = REASON_CORDONED_FOR_REPAIR if rec.to_repair else "cordoned for sweep"
            unswept = "" if rec.to_repair or self.executor is not None else f"; {NO_EXECUTOR_HINT}"
            self._transition(rec, "cordoned", f"{prefix}: {evidence}{unswept}")
            out += 1
            cordoned = self._call_scheduler(rec.node, "cordon", rec.reason)
            if cordoned in ("foreign", "ineligible"):
                self._send_to_repair(
                    rec,
                    f"{evidence}; already taken out by someone else in "
                    f"{self.scheduler.name} (or not a node Guard manages), left as it is",
                )
            elif rec.to_repair:
                self._send_to_repair(rec, evidence)
            elif cordoned:
                note = self._isolate(rec.node)
                if self._can_start_sweep():
                    self._start_sweep(rec, "single", [], note=note)
                else:  # a later tick starts it, when a sweep worker is free
                    self._sweep_notes[rec.node] = note
            free = self._free_sweep_workers()  # an inline sweep has ended by now

    def _note_hold(self, rec: NodeRecord, note: str) -> None:
        """Say on a waiting suspect's state what holds it back (once per change)."""
        if note not in rec.reason:
            self._transition(rec, "suspect", f"{_without_hold_note(rec.reason)}; {note}")

    def _free_sweep_workers(self) -> int | None:
        """Sweep workers free for a node cordoned now: ``sweep_workers`` less the running
        sweeps and the nodes already cordoned for a sweep that has not started (a scheduler
        retry, a restart). ``None`` without an executor: nothing is ever swept, the cap alone
        bounds the nodes held."""
        if self.executor is None:
            return None
        waiting = sum(
            r.state == "cordoned" and not r.to_repair and r.node not in self._jobs
            for r in self.records.values()
        )
        return self.settings.sweep_workers - len(self._jobs) - waiting

    def _can_start_sweep(self) -> bool:
        """A sweep may start now: sweeping has not stopped and a sweep worker is free (a
        node waits cordoned, not sweeping, until its sweep really starts)."""
        return self.sweeps_stopped is None and (
            self._pool is None or len(self._jobs) < self.settings.sweep_workers
        )

    def _send_to_repair(self, rec: NodeRecord, why: str) -> None:
        reason = f"sent to repair: {why}"
        self._transition(rec, "repair", reason)
        self._call_scheduler(rec.node, "cordon", reason)  # the drain reason now says repair

    def _start_sweep(
        self, rec: NodeRecord, sweep: str, peers: list[str], restarted: bool = False, note: str = ""
    ) -> None:
        if self.executor is None:
            log.warning("%s stays %s: %s", rec.node, rec.state, NO_EXECUTOR_HINT)
            self.stats["sweeps_unconfigured"] += 1
            if rec.state == "sweeping":  # a sweep interrupted by a restart cannot go on
                self._transition(rec, "sweeping", f"sweep not resumed: {NO_EXECUTOR_HINT}")
            return
        if sweep == "single":
            what = "single-node sweep"
            reason = f"{what} (restarted after an orchestrator restart)" if restarted else what
            self._transition(rec, "sweeping", reason + note)
        now = self.clock()
        job = _SweepJob(rec.node, sweep, peers, now, time.monotonic() + self._sweep_budget_s())
        self._jobs[rec.node] = job
        self.stats[f"sweeps_{sweep}"] += 1
        if self._pool is None:
            job.checks = self._run_executor(job, now)
            del self._jobs[rec.node]
            self._finish_sweep(rec, job)
        else:
            job.future = self._pool.submit(self._run_executor, job, now)

    def _sweep_budget_s(self) -> float:
        """``sweep_timeout_s``, plus the wait for the node's jobs to end: the executor's own
        (the Slurm and Kubernetes executors' ``drain_wait_s``) or :meth:`_wait_for_jobs`."""
        wait = getattr(self.executor, "drain_wait_s", None)
        if wait is None and self._waits_for_jobs():
            wait = self.settings.drain_timeout_s
        return self.settings.sweep_timeout_s + float(wait or 0.0)

    def _waits_for_jobs(self) -> bool:
        """The orchestrator waits for a node's jobs before its single-node sweep where the
        executor does not (ssh, commands) and the scheduler can list them (Slurm, Kubernetes)."""
        return not hasattr(self.executor, "drain_wait_s") and hasattr(self.scheduler, "jobs_on")

    def _wait_for_jobs(self, job: _SweepJob) -> SweepCheck | None:
        """Wait until the scheduler lists no job on the node just taken out (a sweep beside a
        job measures the sharing and disturbs the job); a failed check when some are still
        there after ``drain_timeout_s``, or when the sweep was abandoned meanwhile."""
        jobs_on = self.scheduler.jobs_on  # type: ignore[attr-defined]
        timeout = self.settings.drain_timeout_s
        deadline = time.monotonic() + timeout
        backoff = JobsPollBackoff(min(_JOBS_POLL_S, timeout / 10), _JOBS_POLL_MAX_S, deadline)
        left: list[str] | str = []
        while self._jobs.get(job.node) is job:
            try:
                left = list(jobs_on(job.node))
            except SchedulerError as exc:  # asked again until the deadline
                left = f"the jobs on it unknown ({exc})"
            if not left:
                return None
            if time.monotonic() > deadline:
                shown = left if isinstance(left, str) else "jobs " + ", ".join(left[:20])
                return SweepCheck(
                    name="drain_timeout",
                    passed=False,
                    detail=f"untested: {job.node} still runs {shown} {timeout:g} s after it "
                    f"was taken out in {self.scheduler.name}"[:4000],
                )
            backoff.sleep()
        return SweepCheck(name="sweep_abandoned", passed=False, detail="abandoned while waiting")

    def _run_executor(self, job: _SweepJob, now: float) -> list[SweepCheck]:
        assert self.executor is not None  # _start_sweep runs none without one
        node, sweep, peers = job.node, job.sweep, job.peers
        try:
            if sweep == "single" and self._waits_for_jobs():
                waited = self._wait_for_jobs(job)
                if waited is not None:
                    return [waited]
            return self.executor.run(node, sweep, peers, now)
        except Exception as exc:
            log.exception("%s sweep of %s raised", sweep, node)
            return [
                SweepCheck(name="sweep_error", passed=False, detail=f"{type(exc).__name__}: {exc}")
            ]

    def _collect_sweeps(self) -> None:
        for node, job in list(self._jobs.items()):
            if job.checks is None and job.future is not None and job.future.done():
                job.checks = job.future.result()
            if job.checks is None and time.monotonic() > job.deadline:
                if job.future is not None:
                    job.future.cancel()
                job.checks = [
                    SweepCheck(
                        name="sweep_timeout",
                        passed=False,
                        detail=f"no result within {self._sweep_budget_s():g} s",
                    )
                ]
            if job.checks is not None and self._jobs.get(node) is job:
                del self._jobs[node]
                self._finish_sweep(self.records[node], job)

    def _finish_sweep(self, rec: NodeRecord, job: _SweepJob) -> None:
        checks = job.checks or []
        result = SweepResult(
            id=stable_id("sweep", job.node, job.sweep, job.started),
            ts=self.clock(),
            node=job.node,
            sweep=job.sweep,
            peers=job.peers,
            checks=checks,
            passed=bool(checks) and all(c.passed for c in checks),
        )
        self._sweeps.setdefault(job.node, collections.deque(maxlen=10)).append(result)
        self._emit(result)
        sweep_finished(job.sweep, result.passed, result.ts - job.started)
        self.stats[f"sweeps_{'passed' if result.passed else 'failed'}"] += 1
        self.failure_stop.record(result.ts, result.passed)
        self._judge_failure_rate(result.ts)
        if not result.passed:
            failing = [c for c in checks if not c.passed]
            summary = ", ".join(_describe_check(c) for c in failing[:4]) or "no checks ran"
            self._transition(rec, "failed", f"failed the {job.sweep}-node sweep: {summary}")
            self._send_to_repair(rec, f"failed the {job.sweep}-node sweep ({summary})")
            return
        network = sorted({c for _, c in self._flag_kinds(rec)} & NETWORK_CATEGORIES)
        multi = bool(self.executor and "multi" in self.executor.sweep_kinds)
        if job.sweep == "single" and multi:
            peers = self._choose_peers(rec.node)
            if peers:
                self._start_sweep(rec, "multi", peers)
                return
        if job.sweep == "single" and network:  # a link is only tested between two nodes
            why = (
                "no healthy peer for it"
                if multi
                else getattr(
                    self.executor, "single_only_why", "this executor runs single-node ones only"
                )
            )
            summary = f"untested: a {'/'.join(network)} flag needs a multi-node sweep, {why}"
            self._transition(rec, "failed", f"passed the single-node sweep; {summary}")
            self._send_to_repair(rec, summary)
            return
        if job.sweep == "single" and multi and self.settings.multi_sweep_peers > 0:
            self._release(rec, "passed the single-node sweep; no healthy peer for a multi-node one")
            return
        self._release(
            rec,
            "passed the single-node and multi-node sweeps"
            if job.sweep == "multi"
            else "passed the single-node sweep",
        )

    def _release(self, rec: NodeRecord, reason: str) -> None:
        if not self._call_scheduler(rec.node, "uncordon"):
            self._release_after_uncordon[rec.node] = reason
            return
        rec.reset_claims()
        self._transition(rec, "healthy", reason)
        rec.passed_sweep_ts = rec.released_ts = rec.since

    def _abandon_sweep(self, node: str) -> None:
        job = self._jobs.pop(node, None)
        if job is not None and job.future is not None:
            job.future.cancel()
        self._release_after_uncordon.pop(node, None)
        self._sweep_notes.pop(node, None)

    def _choose_peers(self, node: str) -> list[str]:
        want = self.settings.multi_sweep_peers
        if want == 0:
            return []
        candidates = set(self.inventory() or ()) | set(self.records)
        healthy = [
            n
            for n in candidates
            if n != node and self.state_of(n) == "healthy" and n not in self._jobs
        ]
        # A stable but node-specific order spreads the peer load over the healthy nodes.
        healthy.sort(key=lambda n: stable_id("peer", node, n))
        idle_peers = getattr(self.scheduler, "idle_peers", None)
        if idle_peers is not None and healthy:
            try:
                idle: list[str] = idle_peers(healthy, want)
            except SchedulerError as exc:
                log.warning(
                    "could not tell which nodes are idle in %s: %s", self.scheduler.name, exc
                )
                idle = []
            if idle:  # never drain a busy peer while an idle one would do (even if fewer)
                return idle
        return healthy[:want]  # none idle: busy peers, drained for the sweep by the executor


def _without_hold_note(reason: str) -> str:
    """A waiting suspect's reason without the note of what holds it back."""
    return _HOLD_NOTE.split(reason, 1)[0]


def _describe(flag: Flag) -> str:
    where = (
        f" gpu{flag.gpu}"
        if flag.gpu is not None
        else f" {flag.device}"
        if flag.device
        else f" rank{flag.rank}"
        if flag.rank is not None
        else ""
    )
    return (
        f"{flag.severity} {flag.category} flag{where} from {flag.detector} (score {flag.score:.3g})"
    )


def _describe_check(check: SweepCheck) -> str:
    if check.value is None:
        return f"{check.name} ({check.detail[:120]})"
    base = f" vs {check.baseline:g}" if check.baseline is not None else ""
    return f"{check.name} {check.value:g} {check.unit}{base}".rstrip()

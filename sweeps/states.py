"""Node-health states, the transitions between them, and recovery from the compacted topic.

The life of a node::

    healthy → suspect → cordoned → sweeping → healthy          (passed both sweeps)
                                            → failed → repair   (a sweep failed)
    suspect → healthy                                           (flags did not persist)
    cordoned → repair                                           (flagged again soon after a pass)
    any → healthy | repair                                      (an operator's decision)

Every transition is published as a :class:`~guard.schemas.NodeState` on ``guard.node-state``
(compacted, key = node), so the latest state per node is the orchestrator's durable memory.
What recovery needs beyond the state itself is carried by the state's ``prev`` and by a
fixed prefix of its ``reason`` (see the ``REASON_*`` constants).

Example
-------
>>> from guard.schemas import NodeState
>>> views = recover_views([
...     NodeState(ts=10.0, node="n1", state="suspect", prev="healthy", actor="orchestrator"),
...     NodeState(ts=20.0, node="n1", state="healthy", prev="suspect", actor="orchestrator"),
...     NodeState(ts=30.0, node="n2", state="repair", prev="failed", actor="orchestrator"),
...     NodeState(ts=40.0, node="n2", state="healthy", prev="repair", actor="operator:ann"),
... ])
>>> views["n1"].state.state, views["n1"].pending is None
('healthy', True)
>>> views["n2"].state.state, views["n2"].pending.state
('repair', 'healthy')
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from guard.schemas import CATEGORIES, Flag, NodeState

__all__ = [
    "ALLOWED",
    "FLAG_IN_REASON",
    "NETWORK_CATEGORIES",
    "OUT_OF_POOL",
    "REASON_AWAITING_CORDON",
    "REASON_AWAITING_REPAIR",
    "REASON_CORDONED_FOR_REPAIR",
    "REASON_PUT_BACK",
    "InvalidTransition",
    "NodeRecord",
    "NodeView",
    "flag_kinds",
    "flags_note",
    "is_operator",
    "recover_views",
]

#: Edges the orchestrator itself may take (operators may move any node to healthy or repair).
ALLOWED: dict[str, frozenset[str]] = {
    "healthy": frozenset({"suspect"}),
    "suspect": frozenset({"suspect", "healthy", "cordoned"}),
    "cordoned": frozenset({"sweeping", "repair"}),
    "sweeping": frozenset({"sweeping", "healthy", "failed"}),
    "failed": frozenset({"repair"}),
    "repair": frozenset(),
}

#: Flags about the network: a single-node sweep cannot clear them (the link is between nodes).
NETWORK_CATEGORIES = frozenset({"nic", "link", "comm_slow", "comm_hang"})

#: States in which the node is drained in the scheduler.
OUT_OF_POOL = frozenset({"cordoned", "sweeping", "failed", "repair"})

# Reason prefixes that recovery reads back (the wire contract has no structured field for them).
REASON_AWAITING_CORDON = "awaiting cordon"
REASON_AWAITING_REPAIR = "awaiting cordon for repair"
REASON_CORDONED_FOR_REPAIR = "cordoned for repair"
#: An operator put a node Guard held back in service in the scheduler: a cancel (hold-off).
REASON_PUT_BACK = "put back in service by an operator"

OPERATOR_PREFIX = "operator"

#: A flag as a reason names it ("critical nic flag"): what recovery and the webhook read back.
FLAG_IN_REASON = re.compile(r"\b(info|warning|critical) ([a-z_]+) flag\b")


def flag_kinds(reason: str) -> list[tuple[str, str]]:
    """The (severity, category) of each flag a reason names, first mention of a category.

    >>> flag_kinds("sent to repair: x; after a critical nic flag, a warning thermal flag")
    [('critical', 'nic'), ('warning', 'thermal')]
    """
    seen: dict[str, str] = {}
    for severity, category in FLAG_IN_REASON.findall(reason):
        if category in CATEGORIES:
            seen.setdefault(category, severity)
    return [(sev, cat) for cat, sev in seen.items()]


def flags_note(kinds: Iterable[tuple[str, str]]) -> str:
    """``after a critical nic flag, ...``: the flags behind a node's time out of the pool,
    appended to the reasons that name none (so that they survive compaction and restarts)."""
    named = [f"a {severity} {category} flag" for severity, category in kinds]
    return f"after {', '.join(named)}" if named else ""


class InvalidTransition(ValueError):
    """A state change the state machine does not allow."""


def is_operator(actor: str) -> bool:
    """Operators sign their requests ``operator`` or ``operator:<name>``."""
    return actor == OPERATOR_PREFIX or actor.startswith(OPERATOR_PREFIX + ":")


@dataclass(slots=True)
class NodeRecord:
    """What the orchestrator knows about one node (in memory; rebuilt on restart)."""

    node: str
    state: str = "healthy"
    prev: str | None = None
    reason: str = ""
    since: float = 0.0
    #: claim flags since the node last became suspect, by id
    claims: dict[str, Flag] = field(default_factory=dict)
    first_claim_ts: float | None = None
    last_claim_ts: float | None = None
    severity_rank: int = 0
    qualified: bool = False
    to_repair: bool = False
    #: when the node last passed a sweep (the cooldown clock) and last went back to the pool
    passed_sweep_ts: float | None = None
    released_ts: float | None = None
    #: an operator put the node back in service: no cordon before this time
    hold_off_until: float | None = None
    #: (severity, category) of the claims as the last state's reason named them (a restart
    #: rebuilds no claims): a network flag keeps needing its multi-node sweep
    flag_kinds: list[tuple[str, str]] = field(default_factory=list)

    def reset_claims(self) -> None:
        self.flag_kinds = []
        self.claims.clear()
        self.first_claim_ts = self.last_claim_ts = None
        self.severity_rank = 0
        self.qualified = self.to_repair = False

    @classmethod
    def from_state(cls, state: NodeState) -> NodeRecord:
        """The record a persisted state implies (used on restart)."""
        rec = cls(state.node, state.state, state.prev, state.reason, state.ts)
        if state.state != "healthy":
            rec.flag_kinds = flag_kinds(state.reason)
        if state.state == "healthy":
            rec.released_ts = state.ts
            if state.prev == "sweeping":
                rec.passed_sweep_ts = state.ts
        elif state.state == "suspect":
            rec.first_claim_ts = rec.last_claim_ts = state.ts
            rec.qualified = state.reason.startswith(REASON_AWAITING_CORDON)
            rec.to_repair = state.reason.startswith(REASON_AWAITING_REPAIR)
        elif state.state == "cordoned":
            rec.to_repair = state.reason.startswith(REASON_CORDONED_FOR_REPAIR)
        return rec


@dataclass(slots=True)
class NodeView:
    """A node as the compacted topic shows it: the latest orchestrator state, and an
    operator request that came after it and is not yet applied (``pending``)."""

    node: str
    state: NodeState | None = None
    pending: NodeState | None = None
    history: list[NodeState] = field(default_factory=list)


def recover_views(messages: Iterable[NodeState], keep_history: bool = False) -> dict[str, NodeView]:
    """Fold node-state messages (in topic order per node) into one view per node."""
    views: dict[str, NodeView] = {}
    for msg in messages:
        view = views.setdefault(msg.node, NodeView(msg.node))
        if keep_history:
            view.history.append(msg)
        if is_operator(msg.actor):
            view.pending = msg
        else:
            view.state = msg
            view.pending = None
    return views

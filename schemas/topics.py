"""Which topic carries which message kind: the one topic map every producer and consumer uses.

Names are suffixes after the configured prefix (default ``guard.``).

>>> TOPIC_BY_KIND["step"], KIND_BY_TOPIC["collectives"]
('steps', 'collective')
>>> [TOPIC_BY_KIND[k] for k in JOB_KINDS]
['steps', 'collectives']
"""

from __future__ import annotations

__all__ = [
    "CONTROL_TOPICS",
    "INTERNAL_TOPICS",
    "JOB_KINDS",
    "KIND_BY_TOPIC",
    "NODE_KINDS",
    "TELEMETRY_TOPICS",
    "TOPIC_BY_KIND",
]

#: Topic suffix for each message kind.
TOPIC_BY_KIND: dict[str, str] = {
    "gpu": "gpu",
    "nic": "nic",
    "step": "steps",
    "collective": "collectives",
    "flag": "remediation",
    "sweep": "sweeps",
    "node_state": "node-state",
    "advice": "advice",
    "finding": "findings",  # streams-internal
    "window_features": "findings",  # streams-internal
    # Batches (guard.schemas.batches) travel with their single kinds.
    "gpu_batch": "gpu",
    "nic_batch": "nic",
    "step_batch": "steps",
    "collective_batch": "collectives",
}
#: Topic suffix -> the single kind it carries (its batch kind travels there too); the
#: streams-internal topics are not stored.
KIND_BY_TOPIC: dict[str, str] = {
    topic: kind
    for kind, topic in TOPIC_BY_KIND.items()
    if not kind.endswith("_batch") and topic != "findings"
}
#: Telemetry keyed by node (per-node detectors) and by job (peer comparison within a job).
NODE_KINDS = ("gpu", "nic")
JOB_KINDS = ("step", "collective")
TELEMETRY_TOPICS = tuple(TOPIC_BY_KIND[k] for k in NODE_KINDS + JOB_KINDS)
#: Streams-internal: findings repartitioned by node (co-partitioned with the telemetry).
INTERNAL_TOPICS = ("findings",)
CONTROL_TOPICS = ("remediation", "sweeps", "node-state", "dlq", "advice")

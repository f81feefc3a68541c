"""The broker a benchmark runs against: ``GUARD_KAFKA_BOOTSTRAP``'s, else an embedded Tansu."""

from __future__ import annotations

import os
from typing import Any


def bootstrap_or_embedded() -> tuple[str, Any]:
    """(bootstrap, the embedded broker started for this run or None); stop the broker at the end."""
    bootstrap = os.environ.get("GUARD_KAFKA_BOOTSTRAP")
    if bootstrap:
        return bootstrap, None
    from guard.broker import EmbeddedBroker

    broker = EmbeddedBroker().start()
    return broker.bootstrap, broker


def fresh_settings(home: Any, bootstrap: str, prefix: str, partitions: int) -> Any:
    """Settings on ``bootstrap`` with topics of their own (a random ``prefix``ed name: a
    shared broker keeps the topics of earlier runs)."""
    import uuid

    from guard.config import load_settings

    return load_settings(
        home=home,
        kafka={
            "bootstrap": bootstrap,
            "topic_prefix": f"{prefix}{uuid.uuid4().hex[:6]}.",
            "telemetry_partitions": partitions,
        },
    )

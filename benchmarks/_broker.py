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

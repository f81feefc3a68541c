"""Shared fixtures: a real Kafka broker for the session and isolated settings per test.

The broker is the one ``GUARD_KAFKA_BOOTSTRAP`` names (CI: real Apache Kafka started by
``.ci/run``); without it the session starts the embedded Tansu broker itself. Each test
gets its own topic prefix and data directory, so tests never see each other's messages.

The suite runs on two pytest-xdist workers (``-n 2`` in pyproject.toml): each worker is its own
process with its own embedded broker and chDB engine. ``--dist loadfile`` keeps each file on one
worker: the one-host Slurm is one per host, and its session fixture (tests/sweeps/test_slurm.py)
starts and stops it, so all its tests must run in one process (``loadgroup`` with an
``xdist_group`` mark did not keep them together under pytest-xdist 3.8: tried, they split).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.config import Settings, load_settings

#: The broker's address and security (CI runs the Kafka tests against a SASL listener too):
#: kept from the environment, every other GUARD_* variable is dropped.
KAFKA_ENV = {
    f"GUARD_KAFKA_{name}"
    for name in (
        "BOOTSTRAP",
        "SECURITY_PROTOCOL",
        "SASL_MECHANISM",
        "SASL_USERNAME",
        "SASL_PASSWORD",
        "SSL_CA_LOCATION",
        "SSL_CERTIFICATE_LOCATION",
        "SSL_KEY_LOCATION",
        "SSL_KEY_PASSWORD",
    )
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that reaches a broker is a ``kafka`` test (``-m kafka`` selects them all, as
    CI does to run them on the embedded broker too)."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "kafka_bootstrap" in names and not item.get_closest_marker("kafka"):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    bootstrap = os.environ.get("GUARD_KAFKA_BOOTSTRAP")
    if bootstrap:
        yield bootstrap
        return
    from guard.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings with a private data directory and topic prefix; Kafka not started."""
    for name in list(os.environ):
        if name.startswith("GUARD_") and name not in KAFKA_ENV:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return load_settings(
        home=tmp_path / "home",
        kafka={
            "bootstrap": os.environ.get("GUARD_KAFKA_BOOTSTRAP", "127.0.0.1:9"),
            "topic_prefix": f"t{uuid.uuid4().hex[:10]}.",
            "telemetry_partitions": 3,
            "control_partitions": 2,
        },
    )


@pytest.fixture
def kafka_settings(settings: Settings, kafka_bootstrap: str) -> Settings:
    """Settings pointing at the session's real broker, with Guard's topics created."""
    from guard.kafka import create_topics

    settings.kafka.bootstrap = kafka_bootstrap
    create_topics(settings)
    return settings


@pytest.fixture(scope="session")
def chdb_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One chDB engine for the session: a process can hold only one chDB path at a time."""
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('chdb')}")
    yield client
    client.close()


@pytest.fixture
def store(settings: Settings, chdb_client: object) -> tuple[object, Settings]:
    """The session's chDB client and settings with a private, migrated database."""
    from guard.store import migrate

    settings.clickhouse.database = f"t_{uuid.uuid4().hex[:10]}"
    migrate(chdb_client, settings)
    return chdb_client, settings

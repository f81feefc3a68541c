"""The streams state key: configured, generated in embedded mode, or a clear error."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from guard.config import STATE_KEY_FILE, ConfigError, load_settings, streams_state_key


def test_a_broker_off_loopback_needs_a_configured_key(tmp_path: Path) -> None:
    settings = load_settings(home=tmp_path, kafka={"bootstrap": "127.0.0.1:9092,kafka-2:9092"})
    with pytest.raises(ConfigError, match="GUARD_STREAMS_STATE_KEY"):
        streams_state_key(settings)
    assert not (tmp_path / STATE_KEY_FILE).exists()  # never generated for a shared cluster
    settings.streams.state_key = "too short"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="at least 32"):
        streams_state_key(settings)
    settings.streams.state_key = "k" * 40  # type: ignore[assignment]
    assert streams_state_key(settings) == b"k" * 40
    assert "k" * 40 not in str(settings.masked())


@pytest.mark.parametrize("bootstrap", ["127.0.0.1:9092", "localhost:1234", "[::1]:9092"])
def test_embedded_mode_generates_one_private_key_per_home(tmp_path: Path, bootstrap: str) -> None:
    settings = load_settings(home=tmp_path / "home", kafka={"bootstrap": bootstrap})
    key = streams_state_key(settings)
    path = tmp_path / "home" / STATE_KEY_FILE
    assert len(key) == 64 and path.read_text().strip().encode() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert streams_state_key(settings) == key  # a second worker of that home: the same key
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    other = load_settings(home=tmp_path / "other", kafka={"bootstrap": bootstrap})
    assert streams_state_key(other) != key


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    settings = load_settings(home=tmp_path, kafka={"bootstrap": "127.0.0.1:9092"})
    streams_state_key(settings)
    (tmp_path / STATE_KEY_FILE).chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        streams_state_key(settings)

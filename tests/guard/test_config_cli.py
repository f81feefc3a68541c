"""Settings from TOML + GUARD_* environment, and the small CLI commands."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from guard.cli import main
from guard.config import load_settings
from guard.schemas import MODELS


def test_toml_then_env_then_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "guard.toml"
    config.write_text(
        'home = "/srv/guard"\n[kafka]\nbootstrap = "kafka-1:9092"\ntelemetry_partitions = 48\n'
        'security_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\n'
        'sasl_username = "guard"\n'
        'sasl_password = "hunter2"\n[kafka.extra]\n"socket.keepalive.enable" = true\n'
        '[clickhouse]\ndsn = "https://guard:pw@ch:8443"\n'
    )
    monkeypatch.setenv("GUARD_KAFKA_BOOTSTRAP", "kafka-2:9092")
    monkeypatch.setenv("GUARD_KAFKA_TOPIC_PREFIX", "prod.guard.")
    settings = load_settings(config)
    assert settings.kafka.bootstrap == "kafka-2:9092"  # env beats the file
    assert settings.kafka.telemetry_partitions == 48  # file beats the default
    assert settings.topic("gpu") == "prod.guard.gpu"
    assert str(settings.home) == "/srv/guard"
    from guard.kafka import client_config

    conf = client_config(settings)
    assert conf["sasl.password"] == "hunter2" and conf["socket.keepalive.enable"] is True
    masked = settings.masked()
    assert masked["kafka"]["sasl_password"] == "***"
    assert masked["clickhouse"]["dsn"] == "https://guard:***@ch:8443"
    assert "hunter2" not in json.dumps(masked)


def test_default_dsn_is_chdb_under_home(tmp_path: Path) -> None:
    settings = load_settings(home=tmp_path)
    assert settings.clickhouse_dsn == f"chdb://{tmp_path.resolve()}/chdb"


def test_bad_config_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka]\ntelemetry_partitions = 0\n")
    assert main(["--config", str(bad), "config", "show"]) == 1
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "telemetry_partitions" in err
    assert main(["--config", str(tmp_path / "missing.toml"), "config", "show"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_config_show_masks_secrets(
    settings: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GUARD_ORCHESTRATOR_WEBHOOK_SECRET", "s3cret")
    assert main(["config", "show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["orchestrator"]["webhook_secret"] == "***"


def test_schema_export_writes_one_file_per_kind(tmp_path: Path) -> None:
    assert main(["schema", "export", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(f"{kind}.schema.json" for kind in MODELS)
    schema = json.loads((tmp_path / "out" / "nic.schema.json").read_text())
    assert schema["properties"]["kind"]["const"] == "nic"


def test_unreachable_broker_is_a_one_line_error(
    settings: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GUARD_KAFKA_BOOTSTRAP", "127.0.0.1:9")
    assert main(["topics", "create", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "no Kafka broker answered at 127.0.0.1:9" in err and "guard broker" in err


def test_db_migrate_command(settings: object, capsys: pytest.CaptureFixture[str]) -> None:
    # A subprocess: this test process already holds another chDB path open.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "guard.cli", "db", "migrate"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "gpu_1m_mv" in out and "chdb://" in out


def test_config_show_masks_every_secret_and_the_credentials_in_urls(
    settings: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = {
        "GUARD_ORCHESTRATOR_WEBHOOK_URL": "https://hooks.example/services/T0/B0/hooktoken1",
        "GUARD_STREAMS_STATE_KEY": "statekey" * 5,
        "GUARD_KAFKA_SASL_PASSWORD": "saslpass1",
        "GUARD_KAFKA_SSL_KEY_PASSWORD": "sslkeypass1",
        "GUARD_CLICKHOUSE_DSN": "https://guard:chpass1@ch:8443/?password=chpass2&x=1",
        "GUARD_AGENT_DCGM_URL": "http://exporter:9400/metrics?access_token=dcgmtoken1",
        "GUARD_KAFKA_EXTRA": '{"sasl.oauthbearer.client.secret": "oauth1", '
        '"sasl.jaas.config": "user=x password=jaas1", "socket.keepalive.enable": true}',
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    for leaked in ("hooktoken1", "statekey", "saslpass1", "sslkeypass1", "chpass1", "chpass2"):
        assert leaked not in out
    for leaked in ("dcgmtoken1", "oauth1", "jaas1"):
        assert leaked not in out
    shown = json.loads(out)
    assert shown["orchestrator"]["webhook_url"] == "https://hooks.example/***"
    assert shown["clickhouse"]["dsn"] == "https://guard:***@ch:8443/?password=***&x=1"
    assert shown["agent"]["dcgm_url"] == "http://exporter:9400/metrics?access_token=***"
    assert shown["kafka"]["extra"]["socket.keepalive.enable"] is True
    assert shown["kafka"]["bootstrap"] == os.environ.get("GUARD_KAFKA_BOOTSTRAP", "127.0.0.1:9092")

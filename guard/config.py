"""One settings object for every Guard service: a TOML file plus ``GUARD_*`` environment.

Precedence (highest first): keyword arguments, ``GUARD_<SECTION>_<FIELD>`` environment
variables (e.g. ``GUARD_KAFKA_BOOTSTRAP``, ``GUARD_CLICKHOUSE_DSN``), the TOML file
(``--config``, else ``$GUARD_CONFIG``, else ``./guard.toml`` if present), the defaults.
The object is built once by the CLI and passed in; nothing reads it from a global.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from guard.errors import GuardError
from guard.schemas import CATEGORIES
from guard.schemas.nvml_codes import APPLICATION_XIDS

__all__ = ["ConfigError", "Settings", "load_settings"]


class ConfigError(GuardError):
    """The configuration file is missing or a setting is invalid."""


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "guard"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KafkaSettings(Section):
    bootstrap: str = Field(
        "127.0.0.1:9092", description="bootstrap servers, comma-separated host:port"
    )
    client_id: str = "guard"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = Field(None, description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ...")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    extra: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="passed through to librdkafka as they are"
    )
    topic_prefix: str = "guard."
    telemetry_partitions: int = Field(12, ge=1)
    control_partitions: int = Field(3, ge=1, description="remediation, sweeps, node-state, dlq")
    replication_factor: int = Field(1, ge=1)
    telemetry_retention_hours: float = Field(72, gt=0)
    dlq_retention_hours: float = Field(24 * 14, gt=0)
    session_timeout_ms: int = Field(
        6000, ge=1000, description="consumer session timeout; low keeps first joins fast"
    )


class ClickHouseSettings(Section):
    dsn: str | None = Field(
        None,
        description="clickhouse-connect DSN; default chdb://<data_dir>/chdb (in-process chDB). "
        "For a server: http://user:password@host:8123",
    )
    database: str = "guard"
    ttl_days: int = Field(30, ge=0, description="raw telemetry retention, 0 keeps forever")
    rollup_ttl_days: int = Field(365, ge=0)
    batch_rows: int = Field(50_000, ge=1)
    batch_seconds: float = Field(2.0, gt=0)


class AgentSettings(Section):
    interval_s: float = Field(1.0, gt=0)
    job: str | None = Field(None, description="explicit job label for this node's telemetry")
    socket_path: str = "/run/guard/agent.sock"
    spool_dir: str | None = Field(None, description="default <data_dir>/spool")
    spool_max_bytes: int = Field(256 << 20, ge=0)
    node: str | None = Field(None, description="node name; default the host name")
    gpu_source: Literal["nvml", "dcgm", "none"] = "nvml"
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    sysfs_root: str = "/sys"
    delivery_timeout_s: float = Field(
        10.0, gt=0, description="a record not delivered by then is spooled (broker away)"
    )
    client_queue_max: int = Field(100_000, ge=1, description="training-client messages held")


class StreamsSettings(Section):
    app_id: str = "guard-streams"
    engine: Literal["faust", "native"] = Field(
        "native",
        description="transport: librdkafka batches (native, ~15x faust here), or faust agents",
    )
    workers: int = Field(1, ge=1)
    checkpoint_s: float = Field(
        30.0,
        gt=0,
        description="how often a key's detector state goes to its changelog table, s "
        "(a restarted worker resumes from state at most this old)",
    )
    progress_s: float = Field(10.0, gt=0, description="period of the progress line, s")
    batch_max: int = Field(2000, ge=1, description="most records a worker handles at once")
    batch_within_s: float = Field(0.1, gt=0, description="longest wait to fill a batch, s")
    web_port: int = Field(6066, ge=0)


class DetectorSettings(Section):
    """``[detectors]``: what the detection engine runs and how (streams, backtest, demo)."""

    tick_s: float = Field(
        5.0, gt=0, description="event-time period of the hang and lost-GPU checks, s"
    )
    node_telemetry: bool = Field(True, description="run the gpu/nic rules")
    stragglers: bool = Field(True, description="run the peer straggler detector")
    collectives: bool = Field(True, description="run C4D collective homogeneity")
    step_regression: bool = Field(True, description="run the job step-time regression")
    peer_anomaly: bool = Field(
        True,
        description="run the river models over peer residuals (info findings that "
        "corroborate claims; never a claim)",
    )
    ignore_xids: list[int] = Field(
        default_factory=list, description="Xids that give no finding at all"
    )
    info_xids: list[int] = Field(
        default_factory=lambda: list(APPLICATION_XIDS),
        description="Xids that are info observations, not claims (default: the "
        "application-caused 13, 31, 43, 45)",
    )
    args: dict[str, dict[str, float | int | bool | str | list[int]]] = Field(
        default_factory=dict,
        description="thresholds and windows per detector, e.g. [detectors.args.thermal] "
        "peer_delta_c = 12; detectors: thermal, power, clocks, gpu_errors, nic, "
        "peer_straggler, c4d, step_regression, peer_anomaly (docs/operations.md)",
    )


class OrchestratorSettings(Section):
    scheduler: Literal["dry-run", "slurm", "kubernetes"] = "dry-run"
    max_cordoned_fraction: float = Field(
        0.05,
        gt=0,
        le=1,
        description="cap on nodes out of the pool on suspicion (cordoned, sweeping, failed) at "
        "once, as a fraction of the cluster; at least one node is always allowed",
    )
    cooldown_s: float = Field(
        3600,
        ge=0,
        description="a node flagged again this soon after passing a sweep goes to repair",
    )
    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    # policy
    min_severity: Literal["warning", "critical"] = Field(
        "warning", description="weakest flag severity that makes a node suspect (info never does)"
    )
    sweep_categories: list[str] = Field(
        # every category but the job-level observation of stage imbalance
        default_factory=lambda: [c for c in CATEGORIES if c != "imbalance"],
        description="flag categories that can start a sweep",
    )
    persist_flags: int = Field(
        1,
        ge=1,
        description="distinct warning flags that make a suspect node worth a sweep (1: the "
        "detectors' own m-of-n persistence is enough)",
    )
    persistence_s: float = Field(
        120, ge=0, description="or: warning evidence spanning this long (window and repeats), s"
    )
    suspect_ttl_s: float = Field(
        600, gt=0, description="a suspect node with no new flag for this long is healthy again"
    )
    max_flag_age_s: float = Field(
        1800, gt=0, description="flags older than this (event time vs now) are ignored as stale"
    )
    cap_counts_repair: bool = Field(
        False, description="count nodes in repair against max_cordoned_fraction"
    )
    cluster_size: int | None = Field(
        None,
        ge=1,
        description="nodes in the cluster; default: len(nodes), the scheduler's "
        "inventory, else the nodes seen so far",
    )
    nodes: list[str] = Field(default_factory=list, description="node inventory (sweep peers)")
    # sweeps
    executor: Literal["local", "simulated"] = Field(
        "local", description="local: run sweep_checks as commands; simulated: from a truth file"
    )
    sweep_checks: list[dict[str, Any]] = Field(
        default_factory=list,
        description="local executor checks: {name, command, unit, baseline, min|max, sweep, "
        "timeout_s, pattern}; empty: the built-in host checks",
    )
    simulated_truth: str | None = Field(
        None, description="simulator TRUTH.json for the simulated executor"
    )
    multi_sweep_peers: int = Field(2, ge=0, le=2, description="healthy peers in a multi sweep")
    sweep_timeout_s: float = Field(1800, gt=0)
    sweep_workers: int = Field(4, ge=1, description="sweeps run at once (threads)")
    # scheduler adapters
    slurm_scontrol: str = Field("scontrol", description="scontrol executable")
    kubeconfig: str | None = Field(None, description="default: in-cluster, else ~/.kube/config")
    kube_context: str | None = None
    kube_taint_key: str = "guard.io/suspect"
    # webhook
    webhook_retries: int = Field(5, ge=0, description="retries after the first attempt")
    webhook_backoff_s: float = Field(0.5, gt=0, description="first retry delay, doubled each time")
    webhook_timeout_s: float = Field(5.0, gt=0)
    webhook_queue: int = Field(1000, ge=1, description="pending notifications kept; oldest dropped")
    # runtime
    group_id: str = "guard-orchestrator"
    actor: str = Field("orchestrator", description="actor written on node states")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GUARD_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        validate_assignment=True,
    )

    home: Path = Field(default_factory=_default_data_dir, description="data directory")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    detectors: DetectorSettings = Field(default_factory=DetectorSettings)
    orchestrator: OrchestratorSettings = Field(default_factory=OrchestratorSettings)

    _toml_file: Path | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _CONFIG_FILE.get("path")
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse.dsn or f"chdb://{(self.home / 'chdb').resolve()}"

    def topic(self, name: str) -> str:
        """Full topic name: ``topic("gpu")`` is ``guard.gpu`` with the default prefix."""
        return f"{self.kafka.topic_prefix}{name}"

    def masked(self) -> dict[str, Any]:
        """The effective settings as plain data, secrets shown as ``***``."""
        data = json.loads(self.model_dump_json())
        data["clickhouse"]["dsn"] = _mask_dsn(self.clickhouse_dsn)
        for section in data.values():
            if isinstance(section, dict):
                for key in section:
                    if _is_secret(key) and section[key] is not None:
                        section[key] = "***"
                if isinstance(section.get("extra"), dict):
                    for key in section["extra"]:
                        if _is_secret(key):
                            section["extra"][key] = "***"
        return data


_CONFIG_FILE: dict[str, Path | None] = {"path": None}


def _is_secret(key: str) -> bool:
    return any(word in key.lower() for word in ("password", "secret", "token"))


def _mask_dsn(dsn: str) -> str:
    # scheme://user:password@host -> scheme://user:***@host
    if "://" in dsn and "@" in dsn.split("://", 1)[1]:
        scheme, rest = dsn.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        if ":" in creds:
            creds = creds.split(":", 1)[0] + ":***"
        return f"{scheme}://{creds}@{host}"
    return dsn


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from a TOML file (if any), ``GUARD_*`` env and ``overrides``."""
    path: Path | None = None
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
    elif os.environ.get("GUARD_CONFIG"):
        path = Path(os.environ["GUARD_CONFIG"])
        if not path.is_file():
            raise ConfigError(f"GUARD_CONFIG={path} does not exist")
    elif Path("guard.toml").is_file():
        path = Path("guard.toml")
    _CONFIG_FILE["path"] = path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(
            f"invalid configuration: {exc}\n(read from the TOML file and "
            "GUARD_<SECTION>_<FIELD> environment variables; `guard config show` prints "
            "the fields)"
        ) from None
    finally:
        _CONFIG_FILE["path"] = None

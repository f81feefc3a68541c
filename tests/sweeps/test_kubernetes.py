"""The Kubernetes adapter and sweep executor against a recording stand-in for the API server
(no API server can run here). Every request body Guard sends is deserialised into the official
client's model (V1Node, V1Taint, V1NodeCondition, CoreV1Event, V1Eviction, V1Job) and must
keep every field it carried (a misspelt field would be dropped by the model).

Like the API server, the stand-in bumps a node's ``resourceVersion`` on every write, answers
409 to a patch that carries an older one, and records each writer (the ``fieldManager`` of
the request) in the node's ``managedFields``.

What the stand-in plays besides the API server, and says so: the Job controller and kubelet of
a sweep Job (the Job succeeds at once, its pod logs the ``sweep`` line the test sets), and a
training Job's controller (an evicted pod is recreated on another node).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from guard.config import ConfigError, OrchestratorSettings, Settings
from guard.schemas import Flag, GuardMessage, NodeState, SweepCheck, SweepResult
from guard.sweeps.executors import CommandExecutor, make_executor
from guard.sweeps.kubernetes import (
    ANNOTATION_BEFORE,
    ANNOTATION_REASON,
    KubernetesScheduler,
    KubernetesSweepExecutor,
    reason_tag,
)
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.scheduler import SchedulerError, make_scheduler
from guard.sweeps.slurm import SweepJob

_MODELS = client.ApiClient()


def as_model(body: Any, model: str) -> Any:
    """``body`` as the official client's ``model``; fails when a field is invalid or unknown."""
    parsed = _MODELS.deserialize(json.dumps(body), model, "application/json")
    back = _MODELS.sanitize_for_serialization(parsed)
    assert _paths(body) == _paths(back), f"fields the {model} model does not know"
    return parsed


def _paths(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        out = set()
        for k, v in value.items():
            if v is not None:
                out |= {f"{prefix}/{k}"} | _paths(v, f"{prefix}/{k}")
        return out
    if isinstance(value, list):
        return set().union(*(_paths(v, f"{prefix}[]") for v in value)) if value else set()
    return set()


def gpu_node(name: str, gpus: str = "8", **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {},
            "annotations": {},
            "resourceVersion": "1",
        },
        "spec": {},
        "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": gpus}, "conditions": []},
    }
    for key, value in extra.items():
        node[key].update(value)
    return node


def pod(name: str, node: str, *, gpus: str | None = "8", owner: str | None = "Job", **meta: Any):  # type: ignore[no-untyped-def]
    limits = {"nvidia.com/gpu": gpus} if gpus else {}
    owners = [
        {"apiVersion": "v1", "kind": owner, "name": f"{name}-owner", "uid": "u", "controller": True}
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "train",
            "ownerReferences": owners if owner else [],
            **meta,
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "i", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Running"},
    }


class StandInApiServer:
    """Nodes, node status, events, pods, evictions, Jobs and pod logs; records every request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.nodes = {
            "gpu-a": gpu_node(
                "gpu-a",
                spec={
                    "taints": [
                        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
                    ]
                },
            ),
            "gpu-b": gpu_node("gpu-b"),
            "cpu-1": gpu_node("cpu-1", gpus="0"),
            "cp-1": gpu_node(
                "cp-1", metadata={"labels": {"node-role.kubernetes.io/control-plane": ""}}
            ),
        }
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.sweep_line = ""
        self.recreated: dict[str, float] = {}
        #: run once before the next node patch is applied (another writer at the same moment)
        self.race: Any = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def bodies(self, method: str, suffix: str) -> list[Any]:
        return [
            r["body"] for r in self.requests if r["method"] == method and r["path"].endswith(suffix)
        ]

    def route(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        if path == "/api/v1/nodes":
            return 200, {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {},
                "items": list(self.nodes.values()),
            }
        if parts[:3] == ["api", "v1", "nodes"]:
            node = self.nodes.get(parts[3])
            if node is None:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if method == "PATCH" and self.race is not None:
                race, self.race = self.race, None
                race(node)
                self._written(node, "other-controller", "f:spec")
            wanted = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if method == "PATCH" and wanted and wanted != node["metadata"]["resourceVersion"]:
                return 409, {"kind": "Status", "code": 409, "reason": "Conflict"}
            if method == "PATCH":
                written = (
                    "f:status" if len(parts) == 5 else "f:spec" if "spec" in body else "f:metadata"
                )
                self._written(node, query.get("fieldManager", ["unknown"])[0], written)
            if method == "PATCH" and len(parts) == 5:  # status: conditions merge by type
                conditions = {c["type"]: c for c in node["status"]["conditions"]}
                conditions.update({c["type"]: c for c in body["status"]["conditions"]})
                node["status"]["conditions"] = list(conditions.values())
            elif method == "PATCH":
                for key, value in (body.get("metadata", {}).get("annotations") or {}).items():
                    if value is None:
                        node["metadata"]["annotations"].pop(key, None)
                    else:
                        node["metadata"]["annotations"][key] = value
                for key, value in body.get("spec", {}).items():
                    if value is None:
                        node["spec"].pop(key, None)
                    else:
                        node["spec"][key] = value
            return 200, node
        if path == "/api/v1/pods":
            on = query.get("fieldSelector", [""])[0].removeprefix("spec.nodeName=")
            items = [p for p in self.pods.values() if p["spec"]["nodeName"] == on]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if parts[-1] == "events":
            self.events.append(body)
            return 201, body
        if parts[-1] == "eviction":
            return self._evict(parts[5])
        if parts[:2] == ["apis", "batch"]:
            return self._job(method, parts, body)
        if parts[-1] == "pods":  # a Job's pods, by label
            job = query.get("labelSelector", [""])[0].removeprefix("job-name=")
            items = [self.jobs[job]["_pod"]] if job in self.jobs else []
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if parts[-1] == "log":
            return 200, self.sweep_line
        return 404, {"kind": "Status", "code": 404, "reason": f"no route {method} {path}"}

    @staticmethod
    def _written(node: dict[str, Any], manager: str, fields: str) -> None:
        meta = node["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        entries = [
            e
            for e in meta.get("managedFields", [])
            if (e["manager"], *e["fieldsV1"]) != (manager, fields)
        ]
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        entries.append({"manager": manager, "operation": "Update", "apiVersion": "v1",
                        "time": stamp, "fieldsType": "FieldsV1",
                        "fieldsV1": {fields: {}}})  # fmt: skip
        meta["managedFields"] = entries

    def _evict(self, name: str) -> tuple[int, Any]:
        victim = self.pods[name]
        if victim["metadata"].get("labels", {}).get("pdb") == "blocks":
            return 429, {"kind": "Status", "code": 429, "reason": "TooManyRequests"}
        del self.pods[name]
        # the stand-in's Job controller recreates the pod on a node that is not cordoned
        elsewhere = next(
            n
            for n, v in self.nodes.items()
            if not v["spec"].get("unschedulable") and n.startswith("gpu")
        )
        again = json.loads(json.dumps(victim))
        again["metadata"]["name"] = f"{name}-r"
        again["spec"]["nodeName"] = elsewhere
        self.pods[again["metadata"]["name"]] = again
        self.recreated[name] = time.monotonic()
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    def _job(self, method: str, parts: list[str], body: Any) -> tuple[int, Any]:
        if method == "POST":
            name = body["metadata"]["name"]
            job = dict(body, status={"succeeded": 1})
            job["_pod"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-x", "namespace": parts[4]},
            }
            self.jobs[name] = job
            return 201, {k: v for k, v in job.items() if k != "_pod"}
        name = parts[6]
        if method == "DELETE":
            self.jobs.pop(name, None)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 200, {k: v for k, v in self.jobs[name].items() if k != "_pod"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append(
                    {
                        "method": self.command,
                        "path": url.path,
                        "content_type": self.headers.get("Content-Type"),
                        "authorization": self.headers.get("Authorization"),
                        "body": body,
                    }
                )
                code, reply = server.route(self.command, url.path, parse_qs(url.query), body)
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(code)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(reply, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = do_DELETE = _serve

        return Handler


@pytest.fixture
def apiserver() -> Iterator[StandInApiServer]:
    server = StandInApiServer()
    yield server
    server.close()


def kubeconfig(tmp_path: Path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {"token": "guard-token"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        "current-context": "t",
    }
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def kube(apiserver: StandInApiServer, tmp_path: Path) -> KubernetesScheduler:
    return KubernetesScheduler(kubeconfig=kubeconfig(tmp_path, apiserver.url), namespace="guard")


REASON = "cordoned for sweep: critical thermal flag gpu3 from thermal (score 3)"


def test_cordon_taints_with_the_reason_adds_a_condition_and_an_event(
    apiserver: StandInApiServer, tmp_path: Path, settings: Settings
) -> None:
    settings.orchestrator.scheduler = "kubernetes"
    settings.orchestrator.kubeconfig = kubeconfig(tmp_path, apiserver.url)
    kube = make_scheduler(settings)
    assert isinstance(kube, KubernetesScheduler)
    assert kube.cordon("gpu-a", REASON) == "cordoned"

    (patch,) = apiserver.bodies("PATCH", "/nodes/gpu-a")
    node = as_model(patch, "V1Node")
    assert node.spec.unschedulable is True
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [
        ("nvidia.com/gpu", "present", "NoSchedule"),
        ("guard.io/suspect", reason_tag(REASON), "NoSchedule"),
    ]
    assert node.metadata.annotations == {
        ANNOTATION_BEFORE: '{"unschedulable": false}',
        ANNOTATION_REASON: REASON,
    }
    cordon_patch = next(r for r in apiserver.requests if r["method"] == "PATCH")
    assert cordon_patch["content_type"] == "application/strategic-merge-patch+json"
    assert cordon_patch["authorization"] == "Bearer guard-token"
    (status,) = apiserver.bodies("PATCH", "/nodes/gpu-a/status")
    (condition,) = as_model(status, "V1Node").status.conditions
    assert (condition.type, condition.status, condition.reason) == (
        "GuardSuspect",
        "True",
        "GuardCordoned",
    )
    assert condition.message == REASON
    (event,) = [as_model(e, "CoreV1Event") for e in apiserver.events]
    assert (event.involved_object.kind, event.involved_object.name) == ("Node", "gpu-a")
    assert (event.type, event.reason, event.message) == ("Warning", "GuardCordoned", REASON)
    assert event.metadata.namespace == "guard"

    kube.cordon("gpu-a", "sent to repair: failed the single-node sweep")  # idempotent
    taints = apiserver.nodes["gpu-a"]["spec"]["taints"]
    assert [t["key"] for t in taints] == ["nvidia.com/gpu", "guard.io/suspect"]
    assert taints[1]["value"] == "sent-to-repair-failed-the-single-node-sweep"
    assert apiserver.nodes["gpu-a"]["status"]["conditions"][0]["reason"] == "GuardRepair"
    assert (
        apiserver.nodes["gpu-a"]["metadata"]["annotations"][ANNOTATION_BEFORE]
        == '{"unschedulable": false}'
    )


def test_uncordon_removes_only_what_guard_added(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    kube.cordon("gpu-a", REASON)
    assert kube.uncordon("gpu-a") == "resumed"
    body = apiserver.bodies("PATCH", "/nodes/gpu-a")[-1]
    assert body["metadata"]["annotations"] == {ANNOTATION_BEFORE: None, ANNOTATION_REASON: None}
    node = as_model({"spec": body["spec"]}, "V1Node")  # null annotations: deletions in a patch
    assert node.spec.unschedulable is False
    assert [t.key for t in node.spec.taints] == ["nvidia.com/gpu"]
    assert apiserver.nodes["gpu-a"]["metadata"]["annotations"] == {}
    (condition,) = apiserver.nodes["gpu-a"]["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "GuardReleased")
    assert [e["reason"] for e in apiserver.events] == ["GuardCordoned", "GuardReleased"]

    # an administrator's earlier cordon stays after Guard's release
    apiserver.nodes["gpu-b"]["spec"]["unschedulable"] = True
    kube.cordon("gpu-b", REASON)
    assert kube.uncordon("gpu-b") == "foreign"
    assert apiserver.nodes["gpu-b"]["spec"] == {"unschedulable": True}


def test_a_node_guard_did_not_cordon_is_left_alone(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    apiserver.nodes["gpu-b"]["spec"]["unschedulable"] = True  # an administrator's cordon
    assert kube.uncordon("gpu-b") == "in-service"
    assert [r["method"] for r in apiserver.requests] == ["GET"]
    assert apiserver.nodes["gpu-b"]["spec"] == {"unschedulable": True}
    assert kube.reassert("gpu-b", REASON) == "foreign"  # a restart does not take it over

    apiserver.nodes["gpu-b"]["spec"] = {}
    kube.cordon("gpu-a", REASON)
    apiserver.nodes["gpu-a"]["spec"] = {"unschedulable": False}  # an admin undid Guard's cordon
    before = len(apiserver.requests)
    assert kube.reassert("gpu-a", REASON) == "resumed-by-other"
    assert [r["method"] for r in apiserver.requests[before:]] == ["GET"]
    with pytest.raises(SchedulerError, match="reading node gpu-z: 404"):
        kube.cordon("gpu-z", "x")


def test_cpu_and_control_plane_nodes_are_not_managed(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    assert sorted(kube.inventory() or []) == ["gpu-a", "gpu-b"]
    assert kube.cordon("cpu-1", REASON) == "ineligible"
    assert kube.cordon("cp-1", REASON) == "ineligible"
    assert [r["method"] for r in apiserver.requests if r["method"] != "GET"] == []


def test_isolate_lists_or_evicts_the_training_pods_through_the_eviction_api(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    apiserver.pods = {
        p["metadata"]["name"]: p
        for p in (
            pod("trainer-0", "gpu-a"),
            pod("agent-x", "gpu-a", owner="DaemonSet"),
            pod("web", "gpu-a", gpus=None),
            pod("bare", "gpu-a", owner=None),
            pod("held", "gpu-a", labels={"pdb": "blocks"}),
            pod("guard-sweep-x", "gpu-a", labels={"app.kubernetes.io/name": "guard-sweep"}),
        )
    }
    listed = kube.isolate("gpu-a", "notify")
    assert listed == [
        "train/trainer-0 (Job trainer-0-owner)",
        "train/bare",
        "train/held (Job held-owner)",
    ]
    assert apiserver.bodies("POST", "/eviction") == []

    kube.cordon("gpu-a", REASON)
    requeued = kube.isolate("gpu-a", "requeue")
    assert requeued == [
        "train/trainer-0 (Job trainer-0-owner) (evicted)",
        "train/bare (no controller: not evicted)",
        "train/held (Job held-owner) (eviction refused now by a PodDisruptionBudget)",
    ]
    evictions = [as_model(b, "V1Eviction") for b in apiserver.bodies("POST", "/eviction")]
    assert [(e.metadata.name, e.metadata.namespace) for e in evictions] == [
        ("trainer-0", "train"),
        ("held", "train"),
    ]
    assert apiserver.pods["trainer-0-r"]["spec"]["nodeName"] == "gpu-b"


def test_a_missing_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"no usable Kubernetes credentials in .*nope.*set orchestrator\.kubeconfig",
    ):
        KubernetesScheduler(kubeconfig=str(tmp_path / "nope"))


def sweep_line(node: str, passed: bool, gpus_seen: int = 8, expected: int = 8) -> str:
    """What ``guard sweep run --json`` prints on an 8-GPU node (the pod sees ``gpus_seen``)."""
    checks = [
        SweepCheck(
            name="gemm_tflops_gpu0",
            value=700.0 if passed else 300.0,
            unit="TFLOPS",
            baseline=650.0,
            passed=passed,
        ),
        SweepCheck(
            name="sweep_coverage",
            value=gpus_seen,
            unit="gpus",
            baseline=expected,
            passed=gpus_seen == expected,
        ),
    ]
    return SweepResult(
        id="s1", ts=time.time(), node=node, sweep="single", checks=checks, passed=passed
    ).model_dump_json()


def test_the_sweep_runs_as_a_job_pinned_to_the_node_that_tolerates_guard(
    apiserver: StandInApiServer, kube: KubernetesScheduler, settings: Settings
) -> None:
    settings.orchestrator.executor = "kubernetes"
    apiserver.sweep_line = sweep_line("gpu-a", passed=True)
    executor = KubernetesSweepExecutor(
        kube, image="registry.example/guard:1", job=SweepJob(poll_s=0.05)
    )
    checks = executor.run("gpu-a", "single", [], time.time())
    assert [(c.name, c.passed, c.value) for c in checks] == [
        ("gemm_tflops_gpu0", True, 700.0),
        ("sweep_coverage", True, 8.0),
    ]

    (body,) = apiserver.bodies("POST", "/jobs")
    job = as_model(body, "V1Job")
    spec = job.spec.template.spec
    assert spec.node_selector == {"kubernetes.io/hostname": "gpu-a"}
    assert {(t.key, t.operator, t.effect) for t in spec.tolerations} == {
        ("guard.io/suspect", "Exists", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "Exists", "NoSchedule"),
        ("nvidia.com/gpu", "Exists", "NoSchedule"),
    }
    (container,) = spec.containers
    assert container.command == ["guard", "sweep", "run", "--json", "--node", "gpu-a"]
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    # judged against the node's allocatable GPUs; a memory /dev/shm for NCCL
    assert {e.name: e.value for e in container.env}["GUARD_SWEEP_EXPECTED_GPUS"] == "8"
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [("dshm", "/dev/shm")]
    assert [(v.name, v.empty_dir.medium) for v in spec.volumes] == [("dshm", "Memory")]
    assert job.spec.backoff_limit == 0
    assert apiserver.jobs == {}  # deleted after reading its result

    # a pod that saw 4 of the node's 8 GPUs, by a sweep that was told to expect 4: not a pass
    apiserver.sweep_line = sweep_line("gpu-a", passed=True, gpus_seen=4, expected=4)
    short = {c.name: c for c in executor.run("gpu-a", "single", [], time.time())}
    assert not short["sweep_gpus_expected"].passed
    assert "has 8 GPUs; the sweep was judged against 4 expected GPUs, it saw 4" in (
        short["sweep_gpus_expected"].detail
    )

    apiserver.sweep_line = "Traceback: no GPU"
    (bad,) = executor.run("gpu-a", "single", [], time.time())
    assert bad.name == "sweep_error" and not bad.passed and "without a sweep line" in bad.detail
    with pytest.raises(ConfigError, match="kube_sweep_image"):
        make_executor(settings)


def test_flag_to_restarted_training_pod_end_to_end(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    apiserver.pods = {"trainer-0": pod("trainer-0", "gpu-a")}
    apiserver.sweep_line = sweep_line("gpu-a", passed=True)
    out: list[GuardMessage] = []
    orch = Orchestrator(
        OrchestratorSettings(multi_sweep_peers=0, isolate_policy="requeue"),
        scheduler=kube,
        executor=KubernetesSweepExecutor(kube, image="guard:1", job=SweepJob(poll_s=0.05)),
        publish=out.append,
        inline_sweeps=True,
    )
    flagged = time.monotonic()
    flag = Flag(
        id="f1",
        ts=time.time(),
        node="gpu-a",
        gpu=3,
        detector="thermal",
        category="thermal",
        severity="critical",
        score=3.0,
    )
    assert orch.handle_flag(flag) == "qualified"
    orch.tick()
    assert [m.state for m in out if isinstance(m, NodeState)] == [
        "suspect",
        "cordoned",
        "sweeping",
        "healthy",
    ]
    sweeping = next(m for m in out if isinstance(m, NodeState) and m.state == "sweeping")
    assert "train/trainer-0 (Job trainer-0-owner) (evicted)" in sweeping.reason
    assert apiserver.pods["trainer-0-r"]["spec"]["nodeName"] == "gpu-b"
    restarted_s = apiserver.recreated["trainer-0"] - flagged
    assert "guard.io/suspect" not in json.dumps(apiserver.nodes["gpu-a"]["spec"])
    print(
        "\nflag -> training pod recreated elsewhere (stand-in controller): "
        f"{restarted_s * 1000:.0f} ms"
    )


RBAC = Path(__file__).resolve().parents[2] / "deploy/kubernetes/orchestrator-rbac.yaml"


def _rbac_rules() -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    import yaml

    docs = list(yaml.safe_load_all(RBAC.read_text()))
    cluster = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    namespaced: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        if d["kind"] == "Role":
            namespaced.setdefault(d["metadata"]["namespace"], []).extend(d["rules"])
    bound = {d["roleRef"]["name"] for d in docs if d["kind"].endswith("Binding")}
    assert bound == {d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "Role")}
    return cluster, namespaced


def _authorization(method: str, path: str) -> tuple[str, str, str, str | None]:
    """(apiGroup, resource[/subresource], verb, namespace) of a request to the API server."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    namespace = None
    if rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"GET": "get" if named else "list", "PATCH": "patch", "POST": "create"}.get(
        method, "delete"
    )
    return group, resource, verb, namespace


def test_the_shipped_rbac_allows_every_request_guard_makes(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    apiserver.pods = {"trainer-0": pod("trainer-0", "gpu-a")}
    apiserver.sweep_line = sweep_line("gpu-a", passed=True)
    kube.inventory()
    kube.cordon("gpu-a", REASON)
    kube.isolate("gpu-a", "requeue")
    KubernetesSweepExecutor(kube, image="guard:1", job=SweepJob(poll_s=0.05)).run(
        "gpu-a", "single", [], 0.0
    )
    kube.uncordon("gpu-a")
    cluster, namespaced = _rbac_rules()
    seen = set()
    for r in apiserver.requests:
        group, resource, verb, ns = _authorization(r["method"], r["path"])
        rules = cluster + (namespaced.get(ns, []) if ns else [])
        allowed = any(
            group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            for rule in rules
        )
        assert allowed, f"{r['method']} {r['path']} needs {verb} on {group}/{resource} in {ns}"
        seen.add((resource, verb))
    assert {("nodes", "patch"), ("nodes/status", "patch"), ("events", "create")} <= seen
    assert {("pods/eviction", "create"), ("jobs", "create"), ("pods/log", "get")} <= seen


def test_a_taint_another_controller_adds_meanwhile_is_kept(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    def other_controller(node: dict[str, Any]) -> None:  # writes between Guard's read and patch
        maintenance = {"key": "example.io/maintenance", "value": "bios", "effect": "NoSchedule"}
        node["spec"]["taints"] = [*node["spec"]["taints"], maintenance]

    apiserver.race = other_controller
    assert kube.cordon("gpu-a", REASON) == "cordoned"
    first, second = apiserver.bodies("PATCH", "/nodes/gpu-a")
    assert first["metadata"]["resourceVersion"] == "1"  # refused: 409, read again
    assert second["metadata"]["resourceVersion"] == "2"
    assert [t["key"] for t in apiserver.nodes["gpu-a"]["spec"]["taints"]] == [
        "nvidia.com/gpu",
        "example.io/maintenance",
        "guard.io/suspect",
    ]
    apiserver.race = other_controller  # again on the way out: Guard removes only its own
    apiserver.nodes["gpu-a"]["spec"]["taints"].pop(1)
    assert kube.uncordon("gpu-a") == "resumed"
    assert [t["key"] for t in apiserver.nodes["gpu-a"]["spec"]["taints"]] == [
        "nvidia.com/gpu",
        "example.io/maintenance",
    ]


def kubectl(apiserver: StandInApiServer, node: str, body: dict[str, Any]) -> None:
    """A patch as kubectl sends it (``kubectl uncordon``: field manager kubectl-cordon)."""
    api = client.CoreV1Api(client.ApiClient(client.Configuration(host=apiserver.url)))
    api.patch_node(node, body, field_manager="kubectl-cordon")


def held_off_orchestrator(
    kube: KubernetesScheduler, out: list[GuardMessage], clock: Any
) -> Orchestrator:
    return Orchestrator(
        OrchestratorSettings(operator_holdoff_s=3600, operator_check_s=0.01),
        scheduler=kube,
        executor=None,  # no sweep: the node stays cordoned until someone acts
        publish=out.append,
        clock=clock,
        inline_sweeps=True,
    )


def thermal(node: str, fid: str, ts: float) -> Flag:
    return Flag(id=fid, ts=ts, node=node, gpu=3, detector="thermal", category="thermal",
                severity="critical", score=3.0)  # fmt: skip


def test_a_manual_uncordon_is_a_cancel_that_guard_does_not_fight(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    now = [time.time()]
    out: list[GuardMessage] = []
    orch = held_off_orchestrator(kube, out, lambda: now[0])
    assert orch.handle_flag(thermal("gpu-b", "f1", now[0] - 1)) == "qualified"
    orch.tick()
    assert orch.state_of("gpu-b") == "cordoned"
    assert apiserver.nodes["gpu-b"]["spec"]["unschedulable"] is True

    kubectl(apiserver, "gpu-b", {"spec": {"unschedulable": None}})  # kubectl uncordon gpu-b
    time.sleep(0.02)
    orch.tick()
    last = [m for m in out if isinstance(m, NodeState)][-1]
    assert (last.prev, last.state) == ("cordoned", "healthy")
    assert last.reason.startswith(
        "put back in service by an operator in kubernetes (uncordoned: last spec change by "
        "kubectl-cordon at 20"
    )
    assert "does not cordon it again for 3600 s" in last.reason
    node = apiserver.nodes["gpu-b"]
    assert "taints" not in node["spec"] and "unschedulable" not in node["spec"]  # as they left it
    assert ANNOTATION_REASON not in node["metadata"]["annotations"]
    (condition,) = node["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "GuardCancelled")
    assert apiserver.events[-1]["reason"] == "GuardCancelled"

    # New evidence within the hold-off changes nothing, also after a restart.
    now[0] += 60
    assert orch.handle_flag(thermal("gpu-b", "f2", now[0] - 1)) == "held-off"
    again = held_off_orchestrator(kube, [], lambda: now[0])
    again.resume(again.recover(m for m in out if isinstance(m, NodeState)))
    assert again.handle_flag(thermal("gpu-b", "f3", now[0] - 1)) == "held-off"
    assert apiserver.nodes["gpu-b"]["spec"] == {}
    now[0] += 3600  # the hold-off is over: a new flag is a claim again
    assert again.handle_flag(thermal("gpu-b", "f4", now[0] - 1)) == "qualified"


def test_an_uncordon_while_guard_was_away_is_a_cancel_too(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    out: list[GuardMessage] = []
    orch = held_off_orchestrator(kube, out, time.time)
    orch.handle_flag(thermal("gpu-b", "f1", time.time() - 1))
    orch.tick()
    assert orch.state_of("gpu-b") == "cordoned"
    # The orchestrator is down; kubectl uncordon clears spec.unschedulable and leaves Guard's
    # taint on the node. A restart must not cordon it again.
    kubectl(apiserver, "gpu-b", {"spec": {"unschedulable": None}})
    after: list[GuardMessage] = []
    again = held_off_orchestrator(kube, after, time.time)
    again.resume(again.recover(m for m in out if isinstance(m, NodeState)))
    [back] = [m for m in after if isinstance(m, NodeState)]
    assert back.state == "healthy"
    assert back.reason.startswith(
        "put back in service by an operator in kubernetes (while Guard was away; uncordoned: "
        "last spec change by kubectl-cordon at "
    )
    assert apiserver.nodes["gpu-b"]["spec"] == {}  # Guard's taint lifted, nothing re-cordoned
    time.sleep(0.05)  # a flag from after the release
    assert again.handle_flag(thermal("gpu-b", "f2", time.time())) == "held-off"


def test_an_opted_out_node_is_never_touched_and_watched_nodes_get_the_condition_false(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    apiserver.nodes["gpu-b"]["metadata"]["labels"]["guard.io/opt-out"] = "true"
    out: list[GuardMessage] = []
    orch = held_off_orchestrator(kube, out, time.time)
    orch.resume([])  # start: every watched node's condition False, as node-problem-detector
    assert apiserver.nodes["gpu-a"]["status"]["conditions"] == [
        {**apiserver.nodes["gpu-a"]["status"]["conditions"][0], "status": "False",
         "reason": "GuardWatching", "type": "GuardSuspect"}
    ]  # fmt: skip
    for untouched in ("gpu-b", "cpu-1", "cp-1"):
        assert apiserver.nodes[untouched]["status"]["conditions"] == []
    assert kube.inventory() == ["gpu-a"]

    writes = len([r for r in apiserver.requests if r["method"] != "GET"])
    assert orch.handle_flag(thermal("gpu-b", "f1", time.time() - 1)) == "qualified"
    orch.tick()
    assert [m.state for m in out if isinstance(m, NodeState)] == ["suspect", "healthy"]
    assert out[-1].reason.startswith(  # type: ignore[union-attr]
        "opted out of Guard (label guard.io/opt-out=true): left alone"
    )
    assert len([r for r in apiserver.requests if r["method"] != "GET"]) == writes
    orch.resume([])  # a second start finds the condition already False: no write
    assert len([r for r in apiserver.requests if r["method"] != "GET"]) == writes


def test_a_node_that_joins_later_gets_the_condition_false_and_joins_the_inventory(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    orch = Orchestrator(
        OrchestratorSettings(node_watch_s=0.05),
        scheduler=kube,
        executor=None,
        publish=[].append,
        inline_sweeps=True,
    )
    orch.resume([])
    assert orch.inventory() == ["gpu-a", "gpu-b"]
    apiserver.nodes["gpu-c"] = gpu_node("gpu-c")  # a node added to the cluster later
    orch.tick()  # before node_watch_s: not read again
    assert apiserver.nodes["gpu-c"]["status"]["conditions"] == []
    time.sleep(0.06)
    orch.tick()
    [condition] = apiserver.nodes["gpu-c"]["status"]["conditions"]
    assert (condition["type"], condition["status"]) == ("GuardSuspect", "False")
    assert orch.inventory() == ["gpu-a", "gpu-b", "gpu-c"]
    assert orch.cluster_size() == 3


def test_an_ssh_or_commands_sweep_waits_until_the_training_pods_are_gone(
    apiserver: StandInApiServer, kube: KubernetesScheduler
) -> None:
    def orchestrate(drain_timeout_s: float) -> list[GuardMessage]:
        out: list[GuardMessage] = []
        orch = Orchestrator(
            OrchestratorSettings(drain_timeout_s=drain_timeout_s),
            scheduler=kube,
            executor=CommandExecutor([{"name": "ok", "command": "echo 0", "max": 0}]),
            publish=out.append,
            inline_sweeps=True,
        )
        orch.handle_flag(thermal("gpu-b", f"w{drain_timeout_s}", time.time() - 1))
        orch.tick()
        return out

    apiserver.pods = {"trainer-0": pod("trainer-0", "gpu-b")}
    threading.Timer(1.5, apiserver.pods.clear).start()  # the training pod ends meanwhile
    passed = orchestrate(drain_timeout_s=30)
    [sweep] = [m for m in passed if isinstance(m, SweepResult)]
    assert [c.name for c in sweep.checks] == ["ok"] and sweep.passed
    assert [m.state for m in passed if isinstance(m, NodeState)][-1] == "healthy"
    apiserver.pods = {"trainer-0": pod("trainer-0", "gpu-b")}
    stays = orchestrate(drain_timeout_s=1.0)
    [sweep] = [m for m in stays if isinstance(m, SweepResult)]
    assert [c.name for c in sweep.checks] == ["drain_timeout"]
    assert sweep.checks[0].detail == (
        "untested: gpu-b still runs jobs train/trainer-0 1 s after it was taken out in kubernetes"
    )


def test_a_sweep_released_by_an_operator_while_it_waits_for_the_pods_never_runs(
    apiserver: StandInApiServer, kube: KubernetesScheduler, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    apiserver.pods = {"trainer-0": pod("trainer-0", "gpu-b")}  # it stays
    out: list[GuardMessage] = []
    orch = Orchestrator(
        OrchestratorSettings(drain_timeout_s=60),
        scheduler=kube,
        executor=CommandExecutor([{"name": "ran", "command": f"touch {ran}", "max": 0}]),
        publish=out.append,
    )
    try:
        orch.handle_flag(thermal("gpu-b", "w-op", time.time() - 1))
        orch.tick()
        assert orch.sweeping() == ["gpu-b"]  # waiting for trainer-0 in a sweep worker
        orch.handle_operator(
            NodeState(ts=time.time(), node="gpu-b", state="healthy", actor="operator:ann")
        )
        apiserver.pods.clear()  # the job ends after the release
        time.sleep(2.5)  # more than one poll of the pods: the wait has seen it abandoned
        orch.tick()
    finally:
        orch.close()
    assert not ran.exists()  # the sweep never started on a node back in service
    assert [m for m in out if isinstance(m, SweepResult)] == []
    assert orch.state_of("gpu-b") == "healthy"

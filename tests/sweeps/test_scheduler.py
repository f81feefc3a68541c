"""Scheduler adapters: a failing ``scontrol`` (the real Slurm is in test_slurm.py) and a
stand-in Kubernetes API server (test_kubernetes.py has the full one)."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from guard.config import Settings
from guard.sweeps.kubernetes import KubernetesScheduler
from guard.sweeps.scheduler import SchedulerError, make_scheduler
from guard.sweeps.slurm import SlurmScheduler

# --- Slurm ----------------------------------------------------------------------------------

FAKE_SCONTROL = """#!{python}
import json, os, sys
log = os.environ["FAKE_SCONTROL_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_SCONTROL_FAIL"):
    sys.stderr.write("slurm_update error: Invalid node name specified\\n")
    sys.exit(1)
if sys.argv[1:3] == ["show", "nodes"]:
    print("NodeName=gpu-001 Arch=x86_64 State=IDLE")
    print("NodeName=gpu-002 Arch=x86_64 State=ALLOCATED")
"""


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    return log


def test_make_scheduler_builds_slurm_with_its_settings(settings: Settings) -> None:
    settings.orchestrator.scheduler = "slurm"
    settings.orchestrator.slurm_node_map = {"gpu-001": "sl-gpu-001"}
    settings.orchestrator.slurm_user = "guard"
    slurm = make_scheduler(settings)
    assert isinstance(slurm, SlurmScheduler)
    assert slurm.names.slurm("gpu-001") == "sl-gpu-001"
    assert slurm.names.agent("sl-gpu-001") == "gpu-001"
    assert slurm.names.slurm("gpu-002") == "gpu-002"
    assert slurm.user == "guard"


def test_a_scontrol_failure_is_a_scheduler_error(
    fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SCONTROL_FAIL", "1")
    with pytest.raises(SchedulerError, match="exited 1: slurm_update error: Invalid node name"):
        SlurmScheduler().cordon("nope", "x")
    # it read the node before changing anything, and changed nothing
    assert [json.loads(x) for x in fake_scontrol.read_text().splitlines()] == [
        ["show", "node", "-o", "nope"]
    ]
    assert SlurmScheduler().inventory() is None
    with pytest.raises(SchedulerError, match="No such file"):
        SlurmScheduler("/nonexistent/scontrol").uncordon("gpu-001")


# --- Kubernetes -----------------------------------------------------------------------------


class StandInApiServer:
    """Just enough of the Kubernetes API for nodes: GET, PATCH (merge of spec), list."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.nodes: dict[str, dict[str, Any]] = {
            name: {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "resourceVersion": "1"},
                "spec": {
                    "taints": [
                        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
                    ]
                }
                if name == "gpu-a"
                else {},
            }
            for name in ("gpu-a", "gpu-b")
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self, body: Any = None) -> None:
                server.requests.append(
                    {
                        "method": self.command,
                        "path": self.path.split("?")[0],
                        "content_type": self.headers.get("Content-Type"),
                        "authorization": self.headers.get("Authorization"),
                        "body": body,
                    }
                )

            def _node(self) -> dict[str, Any] | None:
                name = self.path.split("?")[0].rsplit("/", 1)[-1]
                return server.nodes.get(name)

            def do_GET(self) -> None:
                self._record()
                if self.path.split("?")[0] == "/api/v1/nodes":
                    self._reply(
                        200,
                        {
                            "apiVersion": "v1",
                            "kind": "NodeList",
                            "metadata": {},
                            "items": list(server.nodes.values()),
                        },
                    )
                    return
                node = self._node()
                if node is None:
                    self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                else:
                    self._reply(200, node)

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._record(body)
                node = self._node()
                if node is None:
                    self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                for key, value in body.get("spec", {}).items():
                    if value is None:
                        node["spec"].pop(key, None)
                    else:
                        node["spec"][key] = value
                self._reply(200, node)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def apiserver() -> Iterator[StandInApiServer]:
    server = StandInApiServer()
    yield server
    server.close()


def kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "t", "cluster": {"server": url}}],
                "users": [{"name": "t", "user": {"token": "guard-token"}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
                "current-context": "t",
            }
        )
    )
    return path


def test_kubernetes_cordon_taints_and_keeps_other_taints(
    apiserver: StandInApiServer, tmp_path: Path, settings: Settings
) -> None:
    settings.orchestrator.scheduler = "kubernetes"
    settings.orchestrator.kubeconfig = str(kubeconfig(tmp_path, apiserver.url))
    kube = make_scheduler(settings)
    assert isinstance(kube, KubernetesScheduler)

    kube.cordon("gpu-a", "cordoned for sweep")
    patch = apiserver.requests[-1]
    assert patch["method"] == "PATCH" and patch["path"] == "/api/v1/nodes/gpu-a"
    assert patch["content_type"] == "application/strategic-merge-patch+json"
    assert patch["authorization"] == "Bearer guard-token"
    assert patch["body"] == {
        "spec": {
            "unschedulable": True,
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "guard.io/suspect", "value": "true", "effect": "NoSchedule"},
            ],
        }
    }
    kube.cordon("gpu-a", "sent to repair")  # idempotent: one Guard taint, not two
    taints = apiserver.nodes["gpu-a"]["spec"]["taints"]
    assert [t["key"] for t in taints] == ["nvidia.com/gpu", "guard.io/suspect"]

    kube.uncordon("gpu-a")
    assert apiserver.requests[-1]["body"] == {
        "spec": {
            "unschedulable": False,
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        }
    }
    assert apiserver.nodes["gpu-a"]["spec"]["unschedulable"] is False
    assert sorted(kube.inventory() or []) == ["gpu-a", "gpu-b"]


def test_kubernetes_leaves_a_cordon_it_did_not_make(
    apiserver: StandInApiServer, tmp_path: Path
) -> None:
    kube = KubernetesScheduler(kubeconfig=str(kubeconfig(tmp_path, apiserver.url)))
    apiserver.nodes["gpu-b"]["spec"]["unschedulable"] = True  # an administrator's cordon
    kube.uncordon("gpu-b")
    assert [r["method"] for r in apiserver.requests] == ["GET"]
    assert apiserver.nodes["gpu-b"]["spec"]["unschedulable"] is True

    kube.cordon("gpu-b", "x")
    kube.uncordon("gpu-b")
    assert apiserver.nodes["gpu-b"]["spec"] == {"unschedulable": False}

    with pytest.raises(SchedulerError, match="reading node gpu-z: 404"):
        kube.cordon("gpu-z", "x")

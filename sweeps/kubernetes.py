"""Kubernetes: cordon with a reason anyone can read, sweep in a Job pinned to the node, and
undo only what Guard added.

Cordon (:meth:`KubernetesScheduler.cordon`):

- ``spec.unschedulable: true`` and the taint ``guard.io/suspect=<reason tag>:NoSchedule``
  (other taints kept: ``Node.spec.taints`` has no merge key, so the list is sent whole);
- the annotation ``guard.io/cordon-before`` records whether the node was already
  unschedulable (an administrator's cordon), ``guard.io/reason`` the full reason;
- a node condition ``GuardSuspect=True`` (reason ``GuardCordoned`` or ``GuardRepair``) and a
  ``Warning`` Event on the node carry the reason into ``kubectl describe node``.

Uncordon removes Guard's taint and annotations, sets the condition ``False``, and makes the
node schedulable again only if it was schedulable before Guard came. A node without Guard's
taint is not Guard's: uncordon leaves it alone, and a restart does not cordon again a node
someone uncordoned (``reassert`` answers ``resumed-by-other``).

Only GPU nodes (allocatable ``nvidia.com/gpu`` > 0) that are not control-plane nodes are
managed: the others are not in the inventory (cordon cap, sweep peers) and are never cordoned.

The agent DaemonSet (and dcgm-exporter) must tolerate Guard's taint to stay on, and come back
to, a cordoned node: ``tolerations: [{key: guard.io/suspect, operator: Exists, effect:
NoSchedule}]`` (see deploy/kubernetes/orchestrator-rbac.yaml and docs/orchestrator.md).

Isolate (``isolate_policy``): the training pods on the node (not DaemonSet or mirror pods) are
listed (``notify``) or evicted through the Eviction API (``requeue``), which honours
PodDisruptionBudgets; their controller (Job, JobSet, PyTorchJob, StatefulSet) recreates them
on another node. A pod without a controller is named but not evicted (nothing would restart it).

Example
-------
>>> reason_tag("cordoned for sweep: critical thermal flag gpu3 from thermal (score 3)")  # 63 chars
'cordoned-for-sweep-critical-thermal-flag-gpu3-from-thermal-scor'
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from guard.config import ConfigError, OrchestratorSettings
from guard.schemas import SweepCheck

from .executors import parse_sweep_output
from .scheduler import SchedulerError
from .slurm import SweepJob

__all__ = [
    "ANNOTATION_BEFORE",
    "ANNOTATION_REASON",
    "CONDITION_TYPE",
    "KubernetesScheduler",
    "KubernetesSweepExecutor",
    "reason_tag",
]

log = logging.getLogger(__name__)

CONDITION_TYPE = "GuardSuspect"
ANNOTATION_BEFORE = "guard.io/cordon-before"
ANNOTATION_REASON = "guard.io/reason"
_CONTROL_PLANE = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
_STRATEGIC = "application/strategic-merge-patch+json"
SWEEP_LABEL = "guard-sweep"  # app.kubernetes.io/name of the sweep Jobs and their pods


def reason_tag(reason: str) -> str:
    """A reason as a taint value (a label value: <= 63 of ``[A-Za-z0-9_.-]``)."""
    tag = re.sub(r"[^A-Za-z0-9_.]+", "-", reason).strip("-_.")
    return tag[:63].rstrip("-_.") or "flagged"


def _count(quantity: str) -> int | None:
    """An allocatable GPU count (``"8"``); None when it is not a whole number."""
    try:
        return int(quantity)
    except ValueError:
        return None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load_api_client(kubeconfig: str | None, context: str | None) -> Any:
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ConfigError(
            "scheduler = kubernetes needs the Kubernetes client: pip install 'guard-telemetry"
            "[kubernetes]'"
        ) from exc
    try:
        if kubeconfig is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(context=context)
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or "~/.kube/config (and no in-cluster service account)"
        raise ConfigError(
            f"no usable Kubernetes credentials in {where}: {exc}; set orchestrator.kubeconfig "
            "(GUARD_ORCHESTRATOR_KUBECONFIG) and kube_context, or run the orchestrator in the "
            "cluster with the service account of deploy/kubernetes/orchestrator-rbac.yaml"
        ) from exc
    return client.ApiClient()


class KubernetesScheduler:
    """Cordons, taints and annotates Kubernetes GPU nodes; undoes only what Guard added."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        taint_key: str = "guard.io/suspect",
        *,
        namespace: str = "default",
        gpu_resource: str = "nvidia.com/gpu",
        actor: str = "guard-orchestrator",
    ) -> None:
        if api_client is None:
            api_client = _load_api_client(kubeconfig, context)
        from kubernetes import client

        self._api_client = api_client
        self.api = client.CoreV1Api(api_client)
        self.taint_key = taint_key
        self.namespace = namespace
        self.gpu_resource = gpu_resource
        self.actor = actor

    @classmethod
    def from_settings(cls, o: OrchestratorSettings) -> KubernetesScheduler:
        return cls(
            kubeconfig=o.kubeconfig,
            context=o.kube_context,
            taint_key=o.kube_taint_key,
            namespace=o.kube_namespace,
            gpu_resource=o.kube_gpu_resource,
        )

    # --- API calls with clear errors -----------------------------------------------------------

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise SchedulerError(f"{what}: {exc.status} {exc.reason}") from exc
        except Exception as exc:  # urllib3 connection errors and the like
            raise SchedulerError(f"{what}: {exc}") from exc

    def _read(self, node: str) -> dict[str, Any]:
        current = self._call(f"reading node {node}", self.api.read_node, node)
        out: dict[str, Any] = self._api_client.sanitize_for_serialization(current)
        return out

    def _patch(self, node: str, body: dict[str, Any]) -> None:
        self._call(
            f"patching node {node}", self.api.patch_node, node, body, _content_type=_STRATEGIC
        )

    def _condition(self, node: str, status: str, reason: str, message: str) -> None:
        now = _now()
        condition = {
            "type": CONDITION_TYPE,
            "status": status,
            "reason": reason,
            "message": message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        self._call(
            f"setting the {CONDITION_TYPE} condition of node {node}",
            self.api.patch_node_status,
            node,
            {"status": {"conditions": [condition]}},
            _content_type=_STRATEGIC,
        )

    def _event(self, node: dict[str, Any], reason: str, message: str, kind: str) -> None:
        meta = node.get("metadata", {})
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name')}.guard.{uuid.uuid4().hex[:12]}",
                "namespace": self.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": meta.get("name"),
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": self.actor},
            "reportingComponent": self.actor,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call("creating an event", self.api.create_namespaced_event, self.namespace, body)
        except SchedulerError as exc:  # the node's state is what matters; the event is a note
            log.warning("node %s: %s", meta.get("name"), exc)

    # --- node ownership ------------------------------------------------------------------------

    def eligible(self, node: dict[str, Any]) -> bool:
        """A GPU node (allocatable GPUs) that is not a control-plane node."""
        labels = node.get("metadata", {}).get("labels") or {}
        if any(key in labels for key in _CONTROL_PLANE):
            return False
        taints = node.get("spec", {}).get("taints") or []
        if any(t.get("key") in _CONTROL_PLANE for t in taints):
            return False
        gpus = (node.get("status", {}).get("allocatable") or {}).get(self.gpu_resource, "0")
        try:
            return int(str(gpus)) > 0
        except ValueError:
            return False

    def _guard_taint(self, node: dict[str, Any]) -> dict[str, Any] | None:
        taints = node.get("spec", {}).get("taints") or []
        return next((t for t in taints if t.get("key") == self.taint_key), None)

    def cordon(self, node: str, reason: str) -> str:
        current = self._read(node)
        if not self.eligible(current):
            log.warning("%s is not a GPU worker node: Guard does not cordon it", node)
            return "ineligible"
        spec = current.get("spec") or {}
        annotations = current.get("metadata", {}).get("annotations") or {}
        before = annotations.get(ANNOTATION_BEFORE)
        if before is None or self._guard_taint(current) is None:
            before = json.dumps({"unschedulable": bool(spec.get("unschedulable"))})
        taints = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
        taints.append({"key": self.taint_key, "value": reason_tag(reason), "effect": "NoSchedule"})
        self._patch(
            node,
            {
                "metadata": {"annotations": {ANNOTATION_BEFORE: before, ANNOTATION_REASON: reason}},
                "spec": {"unschedulable": True, "taints": taints},
            },
        )
        why = "GuardRepair" if "repair" in reason else "GuardCordoned"
        self._condition(node, "True", why, reason)
        self._event(current, why, reason, "Warning")
        return "cordoned"

    def reassert(self, node: str, reason: str) -> str:
        current = self._read(node)
        if self._guard_taint(current) is not None:
            return self.cordon(node, reason)
        if (current.get("spec") or {}).get("unschedulable"):
            return "foreign"  # cordoned again by someone else, without Guard's taint
        return "resumed-by-other"

    def uncordon(self, node: str) -> str:
        current = self._read(node)
        if self._guard_taint(current) is None:
            return "in-service"  # not Guard's cordon (or already undone): leave it
        spec = current.get("spec") or {}
        annotations = current.get("metadata", {}).get("annotations") or {}
        try:
            was = bool(json.loads(annotations.get(ANNOTATION_BEFORE) or "{}").get("unschedulable"))
        except (ValueError, AttributeError):
            was = False
        others = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
        self._patch(
            node,
            {
                "metadata": {"annotations": {ANNOTATION_BEFORE: None, ANNOTATION_REASON: None}},
                "spec": {"unschedulable": was, "taints": others or None},
            },
        )
        note = "released by Guard" + ("; the earlier cordon stays" if was else "")
        self._condition(node, "False", "GuardReleased", note)
        self._event(current, "GuardReleased", note, "Normal")
        return "foreign" if was else "resumed"

    def inventory(self) -> list[str] | None:
        try:
            items = self._call("listing nodes", self.api.list_node).items
        except SchedulerError as exc:
            log.warning("cannot list Kubernetes nodes: %s", exc)
            return None
        nodes = [self._api_client.sanitize_for_serialization(n) for n in items]
        return [n["metadata"]["name"] for n in nodes if self.eligible(n)] or None

    # --- jobs on the node ----------------------------------------------------------------------

    def training_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods on the node that use GPUs, are running or pending, and are not DaemonSet or
        mirror pods (nor Guard's sweep)."""
        listed = self._call(
            f"listing the pods on {node}",
            self.api.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node}",
        )
        pods = []
        for pod in (self._api_client.sanitize_for_serialization(p) for p in listed.items):
            meta = pod.get("metadata", {})
            owners = meta.get("ownerReferences") or []
            if any(o.get("kind") == "DaemonSet" for o in owners):
                continue
            if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
                continue
            if (meta.get("labels") or {}).get("app.kubernetes.io/name") == SWEEP_LABEL:
                continue  # Guard's own sweep
            if (pod.get("status") or {}).get("phase") not in ("Running", "Pending"):
                continue
            containers = (pod.get("spec") or {}).get("containers") or []
            wants = [
                ((c.get("resources") or {}).get("limits") or {}).get(self.gpu_resource)
                or ((c.get("resources") or {}).get("requests") or {}).get(self.gpu_resource)
                for c in containers
            ]
            if any(w and str(w) != "0" for w in wants):
                pods.append(pod)
        return pods

    def isolate(self, node: str, policy: str) -> list[str]:
        out = []
        for pod in self.training_pods(node):
            meta = pod["metadata"]
            ns, name = meta.get("namespace", "default"), meta["name"]
            owner = next(
                (o for o in meta.get("ownerReferences") or [] if o.get("controller")), None
            )
            what = f"{ns}/{name}" + (f" ({owner['kind']} {owner['name']})" if owner else "")
            if policy == "requeue":
                what += self._evict(ns, name) if owner else " (no controller: not evicted)"
            out.append(what)
        return out

    def _evict(self, namespace: str, pod: str) -> str:
        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": "policy/v1", "kind": "Eviction"}
        body["metadata"] = {"name": pod, "namespace": namespace}  # type: ignore[assignment]
        try:
            self.api.create_namespaced_pod_eviction(pod, namespace, body)
        except ApiException as exc:
            if exc.status == 429:
                return " (eviction refused now by a PodDisruptionBudget)"
            raise SchedulerError(f"evicting {namespace}/{pod}: {exc.status} {exc.reason}") from exc
        except Exception as exc:
            raise SchedulerError(f"evicting {namespace}/{pod}: {exc}") from exc
        return " (evicted)"


class KubernetesSweepExecutor:
    """Runs the sweep as a Job pinned to the node (``kubernetes.io/hostname``), tolerating the
    cordon and Guard's taint, once the node's training pods are gone; the checks come from the
    one ``sweep`` line the pod logs (``guard sweep run --json``)."""

    sweep_kinds: tuple[str, ...] = ("single", "multi")  # multi: guard.sweeps.multinode

    def __init__(
        self,
        scheduler: KubernetesScheduler,
        image: str,
        job: SweepJob | None = None,
        rendezvous_port: int = 29500,
    ) -> None:
        from kubernetes import client

        self.scheduler = scheduler
        self.batch = client.BatchV1Api(scheduler._api_client)
        self.image = image
        self.job = job or SweepJob(poll_s=2.0)
        self.rendezvous_port = rendezvous_port
        self.peers_lock = threading.Lock()  # multinode.return_stranded_kube_peers runs once
        self.stranded_peers_checked = False

    @property
    def drain_wait_s(self) -> float:
        """How long ``run`` may wait before the sweep starts (the orchestrator allows it)."""
        return self.job.drain_timeout_s

    def job_manifest(self, node: str, name: str, gpus: str = "0") -> dict[str, Any]:
        tolerations = [
            {"key": self.scheduler.taint_key, "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "node.kubernetes.io/unschedulable",
                "operator": "Exists",
                "effect": "NoSchedule",
            },
            # GPU nodes are commonly tainted for GPU pods only (the GPU operator's default)
            {"key": self.scheduler.gpu_resource, "operator": "Exists", "effect": "NoSchedule"},
        ]
        limits = {self.scheduler.gpu_resource: gpus}  # every GPU of the node: all free by now
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": SWEEP_LABEL}},
            "spec": {
                "backoffLimit": 0,
                "activeDeadlineSeconds": int(self.job.sweep_timeout_s),
                "ttlSecondsAfterFinished": 3600,
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/name": SWEEP_LABEL}},
                    "spec": {
                        "restartPolicy": "Never",
                        "nodeSelector": {"kubernetes.io/hostname": node},
                        "tolerations": tolerations,
                        "containers": [
                            {
                                "name": "sweep",
                                "image": self.image,
                                "command": shlex.split(self.job.command.format(node=node)),
                                "env": [
                                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                    # judged against the node's allocatable GPUs, not what
                                    # the pod happens to see
                                    {"name": "GUARD_SWEEP_EXPECTED_GPUS", "value": gpus},
                                ],
                                "resources": {"limits": limits},
                                "securityContext": {"privileged": True},
                                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                            }
                        ],
                        # NCCL's shared-memory transport needs more than the runtime's 64 MiB
                        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                    },
                },
            },
        }

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        if sweep == "multi":
            from .multinode import run_kubernetes_multi

            return run_kubernetes_multi(self, node, peers)
        deadline = time.monotonic() + self.job.drain_timeout_s
        while pods := self.scheduler.training_pods(node):
            if time.monotonic() > deadline:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                detail = (
                    f"{node} still runs {names} {self.job.drain_timeout_s:g} s after the cordon"
                )
                return [SweepCheck(name="kube_drain_timeout", passed=False, detail=detail)]
            time.sleep(self.job.poll_s)
        ns = self.scheduler.namespace
        allocatable = self.scheduler._read(node).get("status", {}).get("allocatable") or {}
        gpus = str(allocatable.get(self.scheduler.gpu_resource, "0"))
        name = f"guard-sweep-{reason_tag(node)[:40].lower()}-{uuid.uuid4().hex[:6]}"
        call = self.scheduler._call
        call(
            f"creating Job {name}",
            self.batch.create_namespaced_job,
            ns,
            self.job_manifest(node, name, gpus),
        )
        try:
            return self._wait_and_read(ns, name, node, _count(gpus))
        finally:
            call(
                f"deleting Job {name}",
                self.batch.delete_namespaced_job,
                name,
                ns,
                propagation_policy="Background",
            )

    def _wait_and_read(self, ns: str, name: str, node: str, gpus: int | None) -> list[SweepCheck]:
        try:
            code, logs = self._wait_and_read_log(ns, name)
        except TimeoutError as exc:
            return [SweepCheck(name="sweep_job", passed=False, detail=str(exc))]
        except LookupError as exc:
            return [SweepCheck(name="sweep_job", passed=False, detail=str(exc))]
        return parse_sweep_output(node, [f"job/{name}"], code, logs, "", expected_gpus=gpus)

    def _wait_and_read_log(self, ns: str, name: str) -> tuple[int, str]:
        """The Job's exit (0 succeeded, 1 failed) and its pod's log, once it finished.

        Raises :class:`TimeoutError` past ``sweep_timeout_s`` and :class:`LookupError` when
        the Job left no pod."""
        call = self.scheduler._call
        deadline = time.monotonic() + self.job.sweep_timeout_s
        while True:
            job = call(f"reading Job {name}", self.batch.read_namespaced_job_status, name, ns)
            status = job.status
            if status is not None and (status.succeeded or status.failed):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"Job {name} did not finish in {self.job.sweep_timeout_s:g} s")
            time.sleep(self.job.poll_s)
        api = self.scheduler.api
        pods = call(
            f"listing Job {name}'s pods",
            api.list_namespaced_pod,
            ns,
            label_selector=f"job-name={name}",
        )
        if not pods.items:
            raise LookupError(f"Job {name} left no pod")
        pod = pods.items[0].metadata.name
        logs = call(f"reading the log of {pod}", api.read_namespaced_pod_log, pod, ns)
        return (0 if status.succeeded else 1), str(logs)

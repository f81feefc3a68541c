"""Kubernetes: cordon with a reason anyone can read, sweep in a Job pinned to the node, and
undo only what Guard added.

Cordon (:meth:`KubernetesScheduler.cordon`):

- ``spec.unschedulable: true`` and the taint ``guard.io/suspect=<reason tag>:NoSchedule``
  (other taints kept: ``Node.spec.taints`` has no merge key, so the list is sent whole);
- the annotation ``guard.io/cordon-before`` records whether the node was already
  unschedulable (an administrator's cordon), ``guard.io/reason`` the full reason;
- a node condition ``GuardSuspect=True`` (reason ``GuardCordoned`` or ``GuardRepair``) and a
  ``Warning`` Event on the node carry the reason into ``kubectl describe node``.

Every change to a node is a patch that carries the ``resourceVersion`` Guard read: when anyone
changed the node in between (another controller adding a taint: the taint list is sent whole),
the API server answers 409 and Guard reads again and rebuilds the patch (optimistic
concurrency). Guard's writes carry the field manager ``guard-orchestrator``.

The operator's word wins: a node Guard holds that someone uncordoned (``kubectl uncordon``:
``spec.unschedulable`` cleared while Guard's annotations are on it) is reported by
:meth:`KubernetesScheduler.overridden`, with the last writer other than Guard and when from
the node's ``managedFields`` (who exactly is in the audit log only), and
:meth:`KubernetesScheduler.lift` then removes Guard's taint and annotations without touching
``spec.unschedulable``. A node labelled ``guard.io/opt-out=true`` is never touched. At start
every watched node gets the condition ``GuardSuspect=False`` (:meth:`watch`), as
node-problem-detector does for its conditions.

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
from collections.abc import Callable, Sequence
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
#: Nodes a multi-node sweep's peer choice asks for their pods at most (one list each).
_IDLE_LOOKUPS = 16
#: Patches in a row refused with 409 (the node changed meanwhile) before Guard gives up for now.
CONFLICT_RETRIES = 5
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
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config(context=context)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or "~/.kube/config (and no in-cluster service account)"
        raise ConfigError(
            f"no usable Kubernetes credentials in {where}: {exc}; set orchestrator.kubeconfig "
            "(GUARD_ORCHESTRATOR_KUBECONFIG) and kube_context, or run the orchestrator in the "
            "cluster with the service account of deploy/kubernetes/orchestrator-rbac.yaml"
        ) from exc
    return client.ApiClient()


class Conflict(SchedulerError):
    """409: the node changed since Guard read it (its patch carried the old resourceVersion)."""


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
        opt_out_label: str = "guard.io/opt-out",
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
        self.opt_out_label = opt_out_label

    @classmethod
    def from_settings(cls, o: OrchestratorSettings) -> KubernetesScheduler:
        return cls(
            kubeconfig=o.kubeconfig,
            context=o.kube_context,
            taint_key=o.kube_taint_key,
            namespace=o.kube_namespace,
            gpu_resource=o.kube_gpu_resource,
            opt_out_label=o.kube_opt_out_label,
        )

    # --- API calls with clear errors -----------------------------------------------------------

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{what}: 409 {exc.reason}") from exc
            raise SchedulerError(f"{what}: {exc.status} {exc.reason}") from exc
        except Exception as exc:  # urllib3 connection errors and the like
            raise SchedulerError(f"{what}: {exc}") from exc

    def _read(self, node: str) -> dict[str, Any]:
        current = self._call(f"reading node {node}", self.api.read_node, node)
        out: dict[str, Any] = self._api_client.sanitize_for_serialization(current)
        return out

    def _patch(self, node: str, body: dict[str, Any]) -> None:
        self._call(
            f"patching node {node}",
            self.api.patch_node,
            node,
            body,
            _content_type=_STRATEGIC,
            field_manager=self.actor,
        )

    def _patch_read(
        self, node: str, build: Callable[[dict[str, Any]], tuple[dict[str, Any] | None, str]]
    ) -> tuple[dict[str, Any], str]:
        """Read the node, build a patch from what was read (``None``: nothing to change) and
        send it with the ``resourceVersion`` read; on 409 read again and rebuild. Returns the
        node as read and ``build``'s word."""
        for _ in range(CONFLICT_RETRIES):
            current = self._read(node)
            body, word = build(current)
            if body is None:
                return current, word
            version = (current.get("metadata") or {}).get("resourceVersion")
            if version:
                body.setdefault("metadata", {})["resourceVersion"] = version
            try:
                self._patch(node, body)
                return current, word
            except Conflict:
                log.info("node %s changed while Guard patched it: reading it again", node)
        raise SchedulerError(
            f"node {node} changed under Guard {CONFLICT_RETRIES} times in a row (409 Conflict); "
            "retried later"
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
        """A GPU node (allocatable GPUs) that is not a control-plane node nor opted out."""
        labels = node.get("metadata", {}).get("labels") or {}
        if any(key in labels for key in _CONTROL_PLANE):
            return False
        if str(labels.get(self.opt_out_label, "")).lower() == "true":
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
        def build(current: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            if not self.eligible(current):
                return None, "ineligible"
            spec = current.get("spec") or {}
            annotations = current.get("metadata", {}).get("annotations") or {}
            before = annotations.get(ANNOTATION_BEFORE)
            if before is None or self._guard_taint(current) is None:
                before = json.dumps({"unschedulable": bool(spec.get("unschedulable"))})
            taints = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
            mark = {"key": self.taint_key, "value": reason_tag(reason), "effect": "NoSchedule"}
            annotated = {ANNOTATION_BEFORE: before, ANNOTATION_REASON: reason}
            return {
                "metadata": {"annotations": annotated},
                "spec": {"unschedulable": True, "taints": [*taints, mark]},
            }, "cordoned"

        current, word = self._patch_read(node, build)
        if word == "ineligible":
            log.warning(
                "%s is not a GPU worker node (or opted out): Guard does not cordon it", node
            )
            return word
        why = "GuardRepair" if "repair" in reason else "GuardCordoned"
        self._condition(node, "True", why, reason)
        self._event(current, why, reason, "Warning")
        return "cordoned"

    def reassert(self, node: str, reason: str) -> str:
        current = self._read(node)
        unschedulable = (current.get("spec") or {}).get("unschedulable")
        if self._guard_taint(current) is not None:
            if not unschedulable:  # kubectl uncordon leaves Guard's taint: not a cordon to redo
                return "resumed-by-other"
            return self.cordon(node, reason)
        if unschedulable:
            return "foreign"  # cordoned again by someone else, without Guard's taint
        return "resumed-by-other"

    def uncordon(self, node: str) -> str:
        def build(current: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            if self._guard_taint(current) is None:
                return None, "in-service"  # not Guard's cordon (or already undone): leave it
            annotations = current.get("metadata", {}).get("annotations") or {}
            try:
                before = json.loads(annotations.get(ANNOTATION_BEFORE) or "{}")
                was = bool(before.get("unschedulable"))
            except (ValueError, AttributeError):
                was = False
            body = self._unmarked(current)
            body["spec"]["unschedulable"] = was
            return body, "foreign" if was else "resumed"

        current, word = self._patch_read(node, build)
        if word == "in-service":
            return word
        was = word == "foreign"
        note = "released by Guard" + ("; the earlier cordon stays" if was else "")
        self._condition(node, "False", "GuardReleased", note)
        self._event(current, "GuardReleased", note, "Normal")
        return word

    def _unmarked(self, current: dict[str, Any]) -> dict[str, Any]:
        """The patch that removes Guard's taint and annotations (and nothing else)."""
        spec = current.get("spec") or {}
        others = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
        return {
            "metadata": {"annotations": {ANNOTATION_BEFORE: None, ANNOTATION_REASON: None}},
            "spec": {"taints": others or None},
        }

    # --- the operator's word -------------------------------------------------------------------

    def opted_out(self, node: str) -> str | None:
        labels = self._read(node).get("metadata", {}).get("labels") or {}
        if str(labels.get(self.opt_out_label, "")).lower() == "true":
            return f"label {self.opt_out_label}=true"
        return None

    def overridden(self, node: str) -> str | None:
        """A note when someone made a node Guard holds schedulable again (kubectl uncordon):
        who last changed the node's spec and when, from its managedFields."""
        current = self._read(node)
        annotations = current.get("metadata", {}).get("annotations") or {}
        if ANNOTATION_REASON not in annotations or (current.get("spec") or {}).get("unschedulable"):
            return None
        return f"uncordoned: {self._last_writer(current)}"

    def _last_writer(self, current: dict[str, Any]) -> str:
        """The latest spec writer other than Guard, as the node's managedFields say."""
        fields = current.get("metadata", {}).get("managedFields") or []
        others = [
            f
            for f in fields
            if f.get("manager") != self.actor and "f:spec" in (f.get("fieldsV1") or {})
        ]
        if not others:
            return "the API does not say who (no other writer of the node's spec in managedFields)"
        last = max(others, key=lambda f: str(f.get("time") or ""))
        return (
            f"last spec change by {last.get('manager') or 'an unnamed manager'} at "
            f"{last.get('time') or 'an unknown time'} (managedFields; the user is in the audit log)"
        )

    def lift(self, node: str) -> None:
        """Remove Guard's taint and annotations; ``spec.unschedulable`` stays as the operator
        left it. The condition goes False."""
        current, word = self._patch_read(
            node,
            lambda c: (
                (None, "none")
                if ANNOTATION_REASON not in (c.get("metadata", {}).get("annotations") or {})
                and self._guard_taint(c) is None
                else (self._unmarked(c), "lifted")
            ),
        )
        note = "put back in service by an operator: Guard lifted its taint and stands back"
        self._condition(node, "False", "GuardCancelled", note)
        if word == "lifted":
            self._event(current, "GuardCancelled", note, "Normal")

    def watch(self, held: set[str]) -> int:
        """Set ``GuardSuspect=False`` on every watched node that shows no such condition or a
        stale True (Guard holds none of them); returns how many were set."""
        nodes = self._call("listing nodes", self.api.list_node).items
        marked = 0
        for item in nodes:
            node = self._api_client.sanitize_for_serialization(item)
            name = node["metadata"]["name"]
            if name in held or not self.eligible(node):
                continue
            conditions = (node.get("status") or {}).get("conditions") or []
            ours = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
            if ours is None or ours.get("status") != "False":
                self._condition(name, "False", "GuardWatching", "watched by Guard: no suspicion")
                marked += 1
        return marked

    def inventory(self) -> list[str] | None:
        try:
            items = self._call("listing nodes", self.api.list_node).items
        except SchedulerError as exc:
            log.warning("cannot list Kubernetes nodes: %s", exc)
            return None
        nodes = [self._api_client.sanitize_for_serialization(n) for n in items]
        return [n["metadata"]["name"] for n in nodes if self.eligible(n)] or None

    # --- jobs on the node ----------------------------------------------------------------------

    def idle_peers(self, candidates: Sequence[str], want: int) -> list[str]:
        """Up to ``want`` of ``candidates`` (in their order) with no workload pod (running or
        pending, DaemonSet and mirror pods aside): a multi-node sweep takes those first, so
        that no job is moved for it while an idle node would do. At most
        ``_IDLE_LOOKUPS`` nodes are asked (one pod list each)."""
        idle: list[str] = []
        for node in candidates[:_IDLE_LOOKUPS]:
            if not self.workload_pods(node, gpu_only=False):
                idle.append(node)
                if len(idle) == want:
                    break
        return idle

    def jobs_on(self, node: str) -> list[str]:
        """The training pods on the node, as ``namespace/name``."""
        return [
            f"{p['metadata'].get('namespace', 'default')}/{p['metadata']['name']}"
            for p in self.training_pods(node)
        ]

    def training_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods on the node that use GPUs, are running or pending, and are not DaemonSet or
        mirror pods (nor Guard's sweep)."""
        return self.workload_pods(node, gpu_only=True)

    def workload_pods(self, node: str, gpu_only: bool) -> list[dict[str, Any]]:
        """Running or pending pods on the node that are not DaemonSet or mirror pods (nor
        Guard's sweep); with ``gpu_only``, those that ask for GPUs."""
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
            if not gpu_only:
                pods.append(pod)
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
        from kubernetes.client import V1Eviction, V1ObjectMeta
        from kubernetes.client.exceptions import ApiException

        body = V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=V1ObjectMeta(name=pod, namespace=namespace),
        )
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
        backoff = self.job.jobs_backoff(deadline)
        while pods := self.scheduler.training_pods(node):
            if time.monotonic() > deadline:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                detail = (
                    f"{node} still runs {names} {self.job.drain_timeout_s:g} s after the cordon"
                )
                return [SweepCheck(name="kube_drain_timeout", passed=False, detail=detail)]
            backoff.sleep()
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

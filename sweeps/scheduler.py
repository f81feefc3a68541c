"""Scheduler adapters: take a node out of the pool (cordon) and put it back (uncordon).

Every adapter is idempotent — cordoning a cordoned node updates its reason, uncordoning
a node Guard did not cordon changes nothing it should not — because the orchestrator
re-asserts the scheduler side after a restart.

- :class:`DryRunScheduler` (default) records what it would do.
- :class:`SlurmScheduler`: ``scontrol update NodeName=X State=DRAIN Reason=...`` and
  ``State=RESUME``.
- :class:`KubernetesScheduler`: ``spec.unschedulable`` plus a ``guard.io/suspect:NoSchedule``
  taint, through the official client; uncordon only undoes a cordon that carries Guard's taint.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from guard.config import Settings

__all__ = [
    "DryRunScheduler",
    "KubernetesScheduler",
    "SchedulerAction",
    "SchedulerAdapter",
    "SchedulerError",
    "SlurmScheduler",
    "make_scheduler",
]

log = logging.getLogger(__name__)


class SchedulerError(RuntimeError):
    """The scheduler refused or could not be reached; the orchestrator retries later."""


class SchedulerAdapter(Protocol):
    name: str

    def cordon(self, node: str, reason: str) -> None: ...

    def uncordon(self, node: str) -> None: ...

    def inventory(self) -> list[str] | None:
        """Every node the scheduler knows, or ``None`` when it cannot tell."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerAction:
    ts: float
    action: str  # cordon | uncordon
    node: str
    reason: str = ""


class DryRunScheduler:
    """Changes nothing; keeps the actions it would have taken (``actions``, ``cordoned``)."""

    name = "dry-run"

    def __init__(self, nodes: list[str] | None = None) -> None:
        self._nodes = list(nodes) if nodes else None
        self._lock = threading.Lock()
        self.actions: list[SchedulerAction] = []
        self.cordoned: set[str] = set()

    def cordon(self, node: str, reason: str) -> None:
        with self._lock:
            self.actions.append(SchedulerAction(time.time(), "cordon", node, reason))
            self.cordoned.add(node)
        log.info("dry-run: would cordon %s (%s)", node, reason)

    def uncordon(self, node: str) -> None:
        with self._lock:
            self.actions.append(SchedulerAction(time.time(), "uncordon", node))
            self.cordoned.discard(node)
        log.info("dry-run: would uncordon %s", node)

    def inventory(self) -> list[str] | None:
        return self._nodes


class SlurmScheduler:
    """Drains and resumes Slurm nodes with ``scontrol``."""

    name = "slurm"

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 30.0) -> None:
        self.scontrol = scontrol
        self.timeout_s = timeout_s

    def _run(self, *args: str) -> str:
        argv = [self.scontrol, *args]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SchedulerError(f"{' '.join(argv)}: {exc}") from exc
        if done.returncode != 0:
            raise SchedulerError(
                f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[:500]}"
            )
        return done.stdout

    def cordon(self, node: str, reason: str) -> None:
        # Slurm keeps the reason verbatim; one line keeps `sinfo -R` readable.
        text = "guard: " + " ".join(reason.split())
        self._run("update", f"NodeName={node}", "State=DRAIN", f"Reason={text[:250]}")

    def uncordon(self, node: str) -> None:
        self._run("update", f"NodeName={node}", "State=RESUME")

    def inventory(self) -> list[str] | None:
        try:
            out = self._run("show", "nodes", "--oneliner")
        except SchedulerError as exc:
            log.warning("cannot list Slurm nodes: %s", exc)
            return None
        nodes = []
        for line in out.splitlines():
            for word in line.split():
                if word.startswith("NodeName="):
                    nodes.append(word.split("=", 1)[1])
        return nodes or None


class KubernetesScheduler:
    """Cordons a Kubernetes node and taints it ``<taint_key>=<reason tag>:NoSchedule``."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        taint_key: str = "guard.io/suspect",
    ) -> None:
        from kubernetes import client, config

        if api_client is None:
            if kubeconfig is None:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config(context=context)
            else:
                config.load_kube_config(config_file=kubeconfig, context=context)
            api_client = client.ApiClient()
        self._api_client = api_client
        self.api = client.CoreV1Api(api_client)
        self.taint_key = taint_key

    def _taints(self, node: str) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        try:
            current = self.api.read_node(node)
        except ApiException as exc:
            raise SchedulerError(f"reading node {node}: {exc.status} {exc.reason}") from exc
        except Exception as exc:  # urllib3 connection errors and the like
            raise SchedulerError(f"reading node {node}: {exc}") from exc
        taints = (current.spec.taints if current.spec else None) or []
        return [self._api_client.sanitize_for_serialization(t) for t in taints]

    def _patch(self, node: str, spec: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.patch_node(
                node, {"spec": spec}, _content_type="application/strategic-merge-patch+json"
            )
        except ApiException as exc:
            raise SchedulerError(f"patching node {node}: {exc.status} {exc.reason}") from exc
        except Exception as exc:
            raise SchedulerError(f"patching node {node}: {exc}") from exc

    def cordon(self, node: str, reason: str) -> None:
        # Node.spec.taints has no merge key: a patch replaces the list, so keep the others.
        taints = [t for t in self._taints(node) if t.get("key") != self.taint_key]
        taints.append({"key": self.taint_key, "value": "true", "effect": "NoSchedule"})
        self._patch(node, {"unschedulable": True, "taints": taints})

    def uncordon(self, node: str) -> None:
        taints = self._taints(node)
        others = [t for t in taints if t.get("key") != self.taint_key]
        if len(others) == len(taints):
            return  # not Guard's cordon (or already undone): leave it to whoever made it
        self._patch(node, {"unschedulable": False, "taints": others or None})

    def inventory(self) -> list[str] | None:
        try:
            items = self.api.list_node().items
            return [n.metadata.name for n in items if n.metadata and n.metadata.name]
        except Exception as exc:
            log.warning("cannot list Kubernetes nodes: %s", exc)
            return None


def make_scheduler(settings: Settings) -> SchedulerAdapter:
    """The adapter ``settings.orchestrator.scheduler`` names."""
    o = settings.orchestrator
    if o.scheduler == "slurm":
        return SlurmScheduler(o.slurm_scontrol)
    if o.scheduler == "kubernetes":
        return KubernetesScheduler(
            kubeconfig=o.kubeconfig, context=o.kube_context, taint_key=o.kube_taint_key
        )
    return DryRunScheduler(o.nodes or None)

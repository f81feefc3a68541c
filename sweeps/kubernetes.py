"""Kubernetes adapter (placeholder move; see below)."""

from __future__ import annotations

import logging
from typing import Any

from .scheduler import SchedulerError

__all__ = ["KubernetesScheduler"]

log = logging.getLogger(__name__)


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

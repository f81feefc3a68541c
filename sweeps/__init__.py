"""Sweep orchestrator: policy, node-state machine, scheduler adapters, sweep checks, webhook.

- :mod:`.states`: the states, allowed transitions, recovery from the compacted topic.
- :mod:`.policy`: which flags make a node suspect and worth a sweep; the cordon cap.
- :mod:`.orchestrator`: :class:`Orchestrator`, the core (no Kafka), and :class:`SimulatedClock`.
- :mod:`.service`: :class:`KafkaOrchestrator` (``guard orchestrator``) and the reads and
  operator requests behind ``guard node``.
- :mod:`.scheduler`: the adapter interface and the dry-run adapter; :mod:`.slurm` and
  :mod:`.kubernetes`: the Slurm (drain, reservation, sweep job, requeue) and Kubernetes adapters.
- :mod:`.executors`: the ssh, commands and (demo) simulated sweep executors.
- :mod:`.checks`: the checks ``guard sweep run`` runs on the node; :mod:`.baselines`: floors
  and the fleet median.
- :mod:`.webhook`: signed Alertmanager-shaped notifications.

See docs/orchestrator.md.
"""

from .executors import CommandExecutor, SimulatedFault, SimulatedSweepExecutor, SshExecutor
from .kubernetes import KubernetesScheduler
from .orchestrator import NodeSummary, Orchestrator, SimulatedClock
from .scheduler import DryRunScheduler
from .service import KafkaOrchestrator, read_node_states, read_sweeps, request_operator_action
from .slurm import SlurmScheduler, SlurmSweepExecutor
from .webhook import WebhookNotifier

__all__ = [
    "CommandExecutor",
    "DryRunScheduler",
    "KafkaOrchestrator",
    "KubernetesScheduler",
    "NodeSummary",
    "Orchestrator",
    "SimulatedClock",
    "SimulatedFault",
    "SimulatedSweepExecutor",
    "SlurmScheduler",
    "SlurmSweepExecutor",
    "SshExecutor",
    "WebhookNotifier",
    "read_node_states",
    "read_sweeps",
    "request_operator_action",
]

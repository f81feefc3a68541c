"""Pure, event-time detection logic: objects fed messages in ``ts`` order that return flags.

Start at :class:`~guard.detectors.engine.DetectionEngine` (what ``guard backtest`` runs) or,
in a partitioned streams worker, at :class:`~guard.detectors.engine.NodeDetectors` (key:
node), :class:`~guard.detectors.engine.JobDetectors` (key: job) and
:class:`~guard.detectors.fusion.NodeFusion` (key: node). One concept per module; every
module's docstring has an example that runs (``tests/detectors/test_doctests.py``). Every
detector has the same verbs (:class:`~guard.detectors.findings.Detector`): ``update(message)``,
``tick(now)``, ``flush()``.
"""

from .engine import DetectionEngine, EngineConfig, JobDetectors, NodeDetectors
from .findings import Detector, Finding
from .fusion import JobFusion, NodeFusion, to_flag

__all__ = [
    "DetectionEngine",
    "Detector",
    "EngineConfig",
    "Finding",
    "JobDetectors",
    "JobFusion",
    "NodeDetectors",
    "NodeFusion",
    "to_flag",
]

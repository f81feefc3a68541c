"""Pure, event-time detection logic: objects fed messages in ``ts`` order that return flags.

Start at :class:`~guard.detectors.core.DetectionCore`: the one core that ``guard backtest``,
the native worker and the faust app run (telemetry records and findings in, findings and
flags out), over :class:`~guard.detectors.engine.NodeDetectors` (key: node),
:class:`~guard.detectors.engine.JobDetectors` (key: job) and
:class:`~guard.detectors.fusion.NodeFusion` (key: node). One concept per module; every
module's docstring has an example that runs (``tests/detectors/test_doctests.py``). Every
detector has the same verbs (:class:`~guard.detectors.findings.Detector`): ``update(message)``,
``tick(now)``, ``flush()``.
"""

from .core import DetectionCore, MessageFeed
from .engine import EngineConfig, JobDetectors, NodeDetectors
from .findings import Detector, Finding
from .fusion import JobFusion, NodeFusion, to_flag

__all__ = [
    "DetectionCore",
    "Detector",
    "EngineConfig",
    "Finding",
    "JobDetectors",
    "JobFusion",
    "MessageFeed",
    "NodeDetectors",
    "NodeFusion",
    "to_flag",
]

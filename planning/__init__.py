"""Planning collective traffic over the fabric (C4P): pure, no I/O, no clock.

Not detection: detectors find what is wrong; planning decides where traffic should go and
what an operator can change. :mod:`.paths` compiles a topology to links and chooses paths
(ECMP hashing, the min-max planner, the bottleneck model that judges them); :mod:`.advice`
turns the concurrent jobs' patterns into :class:`~guard.schemas.Advice`. The live producer
is ``guard.streams.advisor``; the simulator's fabric (``agents/simulator/fabric.py``) is an
independent model that judges the advice without sharing its cost function.
"""

from .advice import JobPattern, JobPatterns, advise, leaf_ring_order

__all__ = ["JobPattern", "JobPatterns", "advise", "leaf_ring_order"]

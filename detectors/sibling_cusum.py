"""A one-sided CUSUM per GPU on its deficit against its sibling GPUs, over sampling rounds.

The node rules' holds (:mod:`guard.detectors.hold`) raise when a deficit is past a fixed bar
(10 % of SM clock, 25 % of power) in two of three rounds. A smaller deficit that does not go
away (a GPU 5 % below its siblings' clock, round after round) is as real and never passes
that bar. This is the sequential test the steps' stragglers use
(:class:`~guard.detectors.persistent_deviation.SequentialTest`), on a GPU's deficit instead:

* a round's *standardised deficit* is ``z = d / s``, with ``d`` the fraction the GPU is below
  its siblings' median (``1 - clock / median``) and ``s`` the siblings' robust spread of ``d``
  in that round, never less than ``min_deficit / k`` (``k`` standard deviations are at least
  ``min_deficit``: a quiet node does not turn a 1 % wobble into evidence);
* ``S = max(0, S + min(z, clip) - k)``, capped at twice the threshold so that a recovered GPU
  drains within a few rounds; a round the rule does not judge (an idle GPU, a GPU at its
  power limit) leaves ``S`` as it was;
* the GPU is claimed once ``S >= threshold``. ``clip`` makes one round, however far below its
  siblings (a hiccup), add less than ``1 / (rounds - 1)`` of the threshold.

The threshold, ``clip`` and ``rounds`` come from the false-alarm rate wanted per 1,000
node-hours (:func:`~guard.detectors.persistent_deviation.cusum_limits`) with a round per
sampling interval of 1 s and eight GPUs a node (:data:`ROUND_TEST`): the shortest interval
an agent samples at, so a slower one only makes false alarms rarer.

State: four numbers per GPU, a row ``(S, rounds, since, deficit sum)`` of an array
(:data:`CUSUM_FIELDS`), updated for many GPUs at once by :func:`step_cusums`.

Example
-------
>>> import numpy as np
>>> d = np.array([[0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # GPU 0 5 % below
>>> z = sibling_z(d, np.ones_like(d, dtype=bool), min_deficit=0.02, k=ROUND_TEST.k)
>>> float(z[0, 0])  # 5 % against a floor of 2 % / 2.5
6.25
>>> state = np.zeros((1, 4))
>>> [bool(step_cusums(state, z[0, :1], d[0, :1], np.array([float(t)]), ROUND_TEST)[0])
...  for t in range(4)]
[False, False, True, True]
>>> state[0].tolist()  # S (capped at 2 x 5.5), rounds, since, deficit sum
[8.8, 4.0, 0.0, 0.2]
"""

from __future__ import annotations

import numpy as np

from .persistent_deviation import SequentialTest
from .robust import MAD_TO_SIGMA, row_medians

__all__ = ["CUSUM_FIELDS", "ROUND_TEST", "sibling_z", "step_cusums"]

#: the columns of a GPU's CUSUM in an array (one row per GPU): see :func:`step_cusums`
CUSUM_FIELDS = ("cusum", "rounds", "since", "deficit_sum")
#: the sequential test of a node's GPU rounds: eight GPUs, a round every second (the
#: shortest sampling interval), 0.05 false claims per 1,000 node-hours per rule
ROUND_TEST = SequentialTest(ranks_per_node=8, step_s=1.0)


def sibling_z(deficit: np.ndarray, judged: np.ndarray, min_deficit: float, k: float) -> np.ndarray:
    """Each judged cell's deficit in units of its round's robust spread (rows: rounds,
    columns: GPUs); NaN where not judged. The spread is 1.4826 x the median absolute
    deficit of the round's judged GPUs (their median is the reference, so ``d`` is already
    centred), never below ``min_deficit / k``."""
    spread = np.where(judged, np.abs(deficit), np.nan)
    sigma = MAD_TO_SIGMA * row_medians(spread)[0]
    scale = np.maximum(np.where(np.isnan(sigma), 0.0, sigma), min_deficit / k)[:, None]
    return np.where(judged, deficit / scale, np.nan)


def step_cusums(
    state: np.ndarray, z: np.ndarray, deficit: np.ndarray, ts: np.ndarray, test: SequentialTest
) -> np.ndarray:
    """One round of the CUSUM of many GPUs: ``state`` rows ``(S, rounds, since, deficit
    sum)`` (:data:`CUSUM_FIELDS`, updated in place), ``z`` each GPU's standardised deficit
    (NaN: not judged this round), ``deficit`` its deficit, ``ts`` its sample time. Returns
    whether each GPU's ``S`` is at or past the threshold."""
    k, h = test.k, test.threshold
    judged = ~np.isnan(z)
    step = np.where(judged, np.minimum(np.where(judged, z, k), test.clip) - k, 0.0)
    s = state[:, 0] + step
    drained = s <= 0.0
    starts = ~drained & (state[:, 1] == 0)
    counted = judged & ~drained
    state[:, 0] = np.where(drained, 0.0, np.minimum(s, 2.0 * h))
    state[:, 1] = np.where(drained, 0.0, state[:, 1] + counted)
    state[:, 2] = np.where(starts, ts, state[:, 2])
    state[:, 3] = np.where(drained | starts, 0.0, state[:, 3]) + np.where(counted, deficit, 0.0)
    crossed: np.ndarray = state[:, 0] >= h
    return crossed

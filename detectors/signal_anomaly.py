"""A signal against its own recent past: river's GaussianScorer with a hold and a quiet period.

For a metric with no peers to compare with (a single sensor, a machine's only temperature),
the only reference is its own history. :class:`SignalAnomalyDetector` scores each value with
:class:`river.anomaly.GaussianScorer` over a rolling window (a two-sided tail probability of
the value under a normal fitted to the window), raises an alarm when the score stays at or
above ``threshold`` for ``hold`` values in a row, and stays quiet for ``refractory_s`` after
an alarm (one alarm per episode, as an operator wants it). Values that raised the score are
not learned, so a long excursion does not teach the model that it is normal.

It stays a library piece, not wired into the engine: its rolling window is about 35 KB
pickled per signal (three per GPU would be ten times the 10 KB per-GPU state budget), and
in a training cluster every GPU has siblings, so the engine's river model compares it with
them instead (:mod:`~guard.detectors.peer_anomaly`: one model per node or job stage, a few
KB per GPU), which a whole-node or whole-job change does not fool. The quality benchmark
runs this detector on the NAB machine-temperature series and on SMD, where a machine has no
peers. Its alarms are ``info`` observations: an anomaly without impact is no claim.

Parameters
----------
window
    Rolling window of the Gaussian, in values.
grace
    Values learned before scoring starts.
threshold
    Score (0..1) at or above which a value is anomalous.
hold
    Anomalous values in a row that raise an alarm.
refractory_s
    Quiet time after an alarm, seconds of event time.

References
----------
Lavin and Ahmad, "Evaluating Real-time Anomaly Detection Algorithms — the Numenta Anomaly
Benchmark" (2015). river ``anomaly.GaussianScorer``.

Example
-------
>>> from guard.detectors.signal_anomaly import SignalAnomalyDetector
>>> det = SignalAnomalyDetector(window=50, grace=20, hold=2, refractory_s=100.0)
>>> values = [60.0 + (i % 5) * 0.5 for i in range(60)] + [20.0] * 5 + [60.0] * 20
>>> [i for i, v in enumerate(values) if det.update(float(i), v, node="m1") is not None]
[61]

"""

from __future__ import annotations

from river import anomaly

from .findings import Finding

__all__ = ["SignalAnomalyDetector"]


class SignalAnomalyDetector:
    """One signal's temporal anomaly alarm."""

    name = "signal_anomaly"

    def __init__(
        self,
        window: int = 2016,
        grace: int = 288,
        threshold: float = 0.995,
        hold: int = 12,
        refractory_s: float = 86400.0,
    ) -> None:
        self.model = anomaly.GaussianScorer(  # type: ignore[no-untyped-call]
            window_size=window, grace_period=grace
        )
        self.threshold = threshold
        self.hold = hold
        self.refractory_s = refractory_s
        self.run = 0
        self.run_since = 0.0
        self.last_alarm: float | None = None

    def update(
        self, ts: float, value: float, node: str | None = None, metric: str = "value"
    ) -> Finding | None:
        """Score and learn one value; return an ``anomaly`` finding when an alarm is raised."""
        try:
            score = float(self.model.score_one(None, value))  # type: ignore[no-untyped-call]
        except (TypeError, ZeroDivisionError, ValueError):
            score = 0.0  # a flat window: river's sigma is 0 or (rounding) imaginary
        if score >= self.threshold:
            if self.run == 0:
                self.run_since = ts
            self.run += 1
        else:
            self.run = 0
            self.model.learn_one(None, value)  # type: ignore[no-untyped-call]
        if self.run < self.hold:
            return None
        if self.last_alarm is not None and ts - self.last_alarm < self.refractory_s:
            return None
        self.last_alarm = ts
        return Finding(
            detector=self.name,
            category="anomaly",
            severity="info",
            node=node,
            ts=ts,
            since=self.run_since,
            score=round(score, 6),
            evidence={"metric": metric, "value": value, "anomalous_values": self.run},
        )

"""Peer anomaly: one shared river HalfSpaceTrees per peer group, over windowed peer residuals.

The rule-based detectors each watch one signal against one threshold. A GPU that is a little
hot, draws a little less power *and* clocks a little lower than its siblings may pass every
rule while being unlike every other GPU. :class:`PeerAnomalyDetector` scores the *joint*
picture: per event-time window of ``window_s`` it averages each component's raw metrics,
normalises them against the component's peers in the same window (the residual against the
peer median: in degrees for temperature, as a fraction for power, clocks and compute time;
NIC error rates as they are), and scores the vector with one river
:class:`~river.anomaly.HalfSpaceTrees` shared by the whole peer group. Residuals make the
model shareable: a hot aisle, a whole-job slowdown or a new SKU moves the median, not the
residuals. Vectors that score as anomalous are not learned, so a long fault does not teach
the model that it is normal.

The threshold is calibrated per component: a window is anomalous when its features differ
materially from the peers' (the sum of their distances in units of each feature's ``notable``
magnitude is at least 1: jitter is no anomaly however rare) and its score is at least
``min_score`` and ``k`` spreads above the component's own score baseline (an exponentially
weighted mean and spread, with the arithmetic of :class:`river.stats.EWMean` and
:class:`river.stats.EWVar`, over its earlier, non-anomalous windows). A GPU that always differs
from its siblings the same way — the one by the chassis' warm exhaust, 10 degrees above the
rest at full clocks — is therefore its own normal, and a change in how it differs is what
stands out. A component must be anomalous in ``raise_after`` of ``within`` windows
(:class:`~guard.detectors.hold.Hold`). Findings are
``info`` (category ``anomaly``): an observation that fusion lists beside a claim as
corroboration and Grafana shows, never a claim by itself. The evidence carries the window's
feature vector, the score, the threshold and the features that stand out.

Two feeds share the class:

* the GPU feed, in two halves: :class:`GpuWindows` on the node (each GPU's window means of
  ``temp_c``, ``power`` and ``sm_clock`` against the node's siblings, every ``sample_s``, as
  arrays, and the node's NIC error rate over the same window, from its NIC samples) and
  :class:`GpuJobAnomaly` on the job: one model for all the job's GPUs, which scores and
  learns each window once. The node's windows reach the job's model as
  ``window_features`` records on the findings topic keyed ``anomaly:<job>``
  (the fusion table holds the model), and its findings go back keyed by the GPU's node, so
  the design's "models over windows grouped by job" is what runs, and a node's own state
  holds no river model;
* :class:`RankPeerAnomaly` — a job's ranks, per step timing (``compute`` residual against
  the ranks of the same pipeline stage); one model per job and stage.

State: one model per group (8 trees of height 5: about 23 KB pickled) and a few numbers per
component (about 0.6 KB per GPU in the job's model; the node's window sums about 0.1 KB
per GPU).

Parameters
----------
features
    Feature name -> (kind, low, high, notable, direction): ``kind`` is ``"diff"`` (value
    minus the peer median), ``"ratio"`` (value over the peer median, minus 1) or ``"level"``
    (as it is); values are clipped into ``low``..``high``; ``notable`` is the magnitude of a
    material difference; ``direction`` says which side is trouble (1 above, -1 below, 0
    either). The trees see each feature's distance from the peers on its side of trouble,
    in ``notable`` units.
window_s
    Event-time window over which metrics are averaged, learned and scored.
n_trees, height, model_window
    HalfSpaceTrees size, and the number of learned vectors after which its reference mass
    is renewed.
warmup
    Vectors a group's model learns before it scores.
min_score, k, min_spread, fading, settle
    Calibrated threshold: at least ``min_score``, and ``k`` times the spread (at least
    ``min_spread``) above the component's baseline score, which fades by ``fading`` per
    window and judges after ``settle`` windows.
min_peers
    Components of a group that must report a metric in the window to normalise it.
raise_after, within, clear_after
    Hysteresis, in windows.
sample_s, step_every
    The feeds' cadence: :class:`GpuWindows` adds one sampling round every ``sample_s``
    seconds, :class:`RankPeerAnomaly` every ``step_every``-th step.
slack
    :class:`GpuJobAnomaly` scores a window once a window ``slack`` later has arrived.

References
----------
Tan, Ting and Liu, "Fast Anomaly Detection for Streaming Data" (IJCAI 2011): half-space
trees. river ``anomaly.HalfSpaceTrees``; ``stats.EWMean`` and ``stats.EWVar`` (the
baselines' arithmetic).

Example
-------
>>> from guard.detectors.peer_anomaly import PeerAnomalyDetector
>>> det = PeerAnomalyDetector({"temp_c": ("diff", -15.0, 15.0, 4.0, 1)}, window_s=10.0,
...                           warmup=16, model_window=16, raise_after=2, within=3)
>>> found = []
>>> for t in range(400):
...     for g in range(8):
...         hot = 9.0 if (g == 5 and t >= 300) else 0.0
...         temp = 60.0 + (g % 3) * 0.4 + 0.3 * ((t * 7 + g) % 5) + hot
...         found += det.observe(float(t), g, "n1", {"temp_c": temp}, node="n1", gpu=g)
>>> [(f.gpu, f.severity, f.category, f.evidence["stand_out"]) for f in found if not f.clear]
[(5, 'info', 'anomaly', ['temp_c'])]

"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import numpy as np
from river import anomaly

from guard.schemas import StepTiming

from .findings import Finding
from .gpu_round import Rounds
from .hold import Hold
from .job_columns import StepColumns
from .robust import median

__all__ = [
    "GPU_FEATURES",
    "RANK_FEATURES",
    "ClosedWindow",
    "GpuJobAnomaly",
    "GpuWindows",
    "PeerAnomalyDetector",
    "RankPeerAnomaly",
]

Feature = tuple[str, float, float, float, int]  # kind, low, high, notable, direction

#: A node's GPUs: residuals against the siblings, and the node's NIC error rate (log10(1+/s)).
GPU_FEATURES: dict[str, Feature] = {
    "temp_c": ("diff", -8.0, 8.0, 4.0, 1),  # hotter than the siblings
    "power": ("ratio", -0.15, 0.15, 0.06, 0),  # either way (a brake, or a runaway draw)
    "sm_clock": ("ratio", -0.1, 0.1, 0.03, -1),  # slower clocks
    "nic_errors": ("level", 0.0, 1.5, 0.3, 1),
}
#: A job's ranks: busy time before the synchronising collective against the stage's ranks.
RANK_FEATURES: dict[str, Feature] = {"compute": ("ratio", -0.1, 0.1, 0.03, 1)}  # slower
_SPAN = 4.0  # distances beyond 4 notable units are all "far"


def _new_model(
    features: dict[str, Feature], n_trees: int, height: int, window: int
) -> anomaly.HalfSpaceTrees:
    """A group's untrained model. Its random trees are built on its first ``learn_one``, from
    the seed and the features' limits, so every group of one feed gets the same trees (about
    1 ms a group, once; a copy of a prototype's trees through river's private attributes
    saved 0.85 ms of it, which no worker's throughput showed)."""
    # the trees see each feature's distance from the peers in ``notable`` units
    limits: dict[Hashable, tuple[float, float]] = {name: (0.0, _SPAN) for name in features}
    return anomaly.HalfSpaceTrees(
        n_trees=n_trees, height=height, window_size=window, limits=limits, seed=17
    )


class _Group:
    """One peer group's shared model."""

    __slots__ = ("learned", "model")

    def __init__(
        self, features: dict[str, Feature], n_trees: int, height: int, window: int
    ) -> None:
        self.model = _new_model(features, n_trees, height, window)
        self.learned = 0


class _Baseline:
    """A component's usual score: exponentially weighted mean and variance, and a count.

    The arithmetic of river's ``stats.EWMean`` and ``stats.EWVar`` to the last bit (the first
    value sets the means; variance is the mean square less the squared mean), kept as three
    numbers instead of river's four objects (a fifth of the checkpoint bytes a GPU took).
    """

    __slots__ = ("mean", "seen", "square")

    def __init__(self) -> None:
        self.mean = 0.0
        self.square = 0.0  # the mean of squared scores
        self.seen = 0

    def learn(self, score: float, fading: float) -> None:
        if self.seen:
            self.mean = fading * score + (1.0 - fading) * self.mean
            self.square = fading * (score * score) + (1.0 - fading) * self.square
        else:
            self.mean, self.square = score, score * score
        self.seen += 1

    def var(self) -> float:
        return self.square - self.mean * self.mean


class PeerAnomalyDetector:
    """Windowed peer residuals of components, scored by their group's shared model."""

    name = "peer_anomaly"

    def __init__(
        self,
        features: dict[str, Feature],
        window_s: float = 20.0,
        n_trees: int = 8,
        height: int = 5,
        model_window: int = 128,
        warmup: int = 128,
        min_score: float = 0.6,
        k: float = 4.0,
        min_spread: float = 0.03,
        fading: float = 0.1,
        settle: int = 6,
        min_peers: int = 3,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 3,
    ) -> None:
        self.features = features
        self.window_s = window_s
        self.model_args = (n_trees, height, model_window)
        self.warmup = warmup
        self.min_score = min_score
        self.calibration = (k, min_spread, fading, settle)
        self.min_peers = min_peers
        self.hold_args = (raise_after, within, clear_after)
        self.window_start: float | None = None
        self.window_end = 0.0
        # component -> [samples, sum per feature]; component -> (group, node, gpu, rank, job)
        self.sums: dict[Any, list[float]] = {}
        self.where: dict[Any, tuple[Any, str | None, int | None, int | None, str | None]] = {}
        self.groups: dict[Any, _Group] = {}
        self.holds: dict[Any, Hold] = {}
        self.baselines: dict[Any, _Baseline] = {}

    def observe(
        self,
        ts: float,
        component: Any,
        group: Any,
        values: dict[str, float],
        node: str | None = None,
        gpu: int | None = None,
        rank: int | None = None,
        job: str | None = None,
    ) -> list[Finding]:
        """Add one reading of ``component`` (a member of ``group``); a reading past the
        current window closes it and returns that window's findings."""
        found: list[Finding] = []
        if self.window_start is None:
            self.window_start = ts
        elif ts >= self.window_start + self.window_s:
            found = self._close()
            self.window_start = ts
        self.window_end = max(self.window_end, ts)
        acc = self.sums.get(component)
        if acc is None:
            acc = self.sums[component] = [0.0] * (2 * len(self.features))
        i, finite = 0, math.isfinite
        for name in self.features:
            v = values.get(name)
            if v is not None and finite(v):
                acc[i] += 1.0
                acc[i + 1] += v
            i += 2
        self.where[component] = (group, node, gpu, rank, job)
        return found

    def tick(self, now: float) -> list[Finding]:
        return []  # windows close on later readings (event time) or at flush

    def flush(self) -> list[Finding]:
        """Close the open window (end of input)."""
        return self._close() if self.sums else []

    def _close(self) -> list[Finding]:
        members: dict[Any, list[Any]] = {}
        for component in self.sums:
            members.setdefault(self.where[component][0], []).append(component)
        found: list[Finding] = []
        for group, components in members.items():
            found += self.score(group, self._residuals(components))
        self.sums = {}
        return found

    def _residuals(self, components: list[Any]) -> dict[Any, dict[str, float]]:
        """Each component's window-mean features against its peers' (0: like its peers)."""
        out: dict[Any, dict[str, float]] = {c: {} for c in components}
        for i, (name, (kind, lo, hi, _, _)) in enumerate(self.features.items()):
            means = {
                c: acc[2 * i + 1] / acc[2 * i]
                for c in components
                if (acc := self.sums[c])[2 * i] > 0
            }
            center = median(list(means.values())) if len(means) >= self.min_peers else None
            for c in components:
                mean = means.get(c)
                if mean is None or (kind != "level" and center is None):
                    r = 0.0 if kind != "level" else lo
                elif kind == "diff":
                    r = mean - center  # type: ignore[operator]
                elif kind == "ratio":
                    r = mean / center - 1.0 if center else 0.0
                else:
                    r = mean
                out[c][name] = round(min(hi, max(lo, r)), 4)
        return out

    def score(self, group: Any, residuals: dict[Any, dict[str, float]]) -> list[Finding]:
        """Score each component's residuals (:meth:`_residuals`) with ``group``'s model, in
        the order given, learning those that are not anomalous; the findings of the window
        :attr:`window_start`..:attr:`window_end`."""
        model = self.groups.get(group)
        if model is None:
            model = self.groups[group] = _Group(self.features, *self.model_args)
        k, min_spread, fading, settle = self.calibration
        found: list[Finding] = []
        for component, x in residuals.items():
            score = threshold = base = None
            size = self._sizes(x)
            z = {n: min(_SPAN, d) for n, d in size.items()}
            if model.learned >= self.warmup:
                score = float(model.model.score_one(z))  # type: ignore[no-untyped-call]
                base = self.baselines.get(component)
                if base is None:
                    base = self.baselines[component] = _Baseline()
                if base.seen >= settle:
                    spread = max(min_spread, math.sqrt(max(0.0, base.var())))
                    threshold = max(self.min_score, base.mean + k * spread)
            anomalous = (
                threshold is not None
                and score is not None
                and score >= threshold
                and sum(size.values()) >= 1.0  # a material difference, not jitter
            )
            if not anomalous:
                model.model.learn_one(z)  # type: ignore[no-untyped-call]
                model.learned += 1
                if base is not None and score is not None:
                    base.learn(score, fading)
            finding = self._held(component, anomalous, x, score, threshold)
            if finding is not None:
                found.append(finding)
        return found

    def _sizes(self, x: dict[str, float]) -> dict[str, float]:
        """Each feature's distance from its peers in its direction of trouble (``direction``
        1: above, -1: below, 0: either), in units of its ``notable`` magnitude."""
        out = {}
        for n, (kind, lo, _, notable, direction) in self.features.items():
            d = x[n] - (lo if kind == "level" else 0.0)
            out[n] = (abs(d) if direction == 0 else max(0.0, d * direction)) / notable
        return out

    def _held(
        self,
        component: Any,
        anomalous: bool,
        x: dict[str, float],
        score: float | None,
        threshold: float | None,
    ) -> Finding | None:
        hold = self.holds.get(component)
        if hold is None:
            if not anomalous:
                return None  # the common case: nothing to remember
            hold = self.holds[component] = Hold(*self.hold_args)
        event = hold.update(anomalous, self.window_start or 0.0)
        if event is None:
            return None
        if event == "clear":
            del self.holds[component]
        _, node, gpu, rank, job = self.where[component]
        size = self._sizes(x)
        stand_out = sorted((n for n in size if size[n] >= 0.5), key=lambda n: -size[n])
        return Finding(
            detector=self.name,
            category="anomaly",
            severity="info",
            node=node,
            ts=self.window_end,
            since=hold.since,
            score=round(score or 0.0, 4),
            job=job,
            gpu=gpu,
            rank=rank,
            window_s=self.window_s,
            evidence={
                "observation": "peer_anomaly",
                "features": x,
                "stand_out": stand_out,
                "threshold": None if threshold is None else round(threshold, 4),
            },
            clear=event == "clear",
        )


#: A window a node closed: (newest sample's time, window number, job, GPUs, feature -> values)
ClosedWindow = tuple[float, int, str, list[int], dict[str, list[float]]]
#: NIC windows a node's river feed keeps behind its newest NIC sample, for GPU samples that
#: lag (2 min at 20 s windows); older ones no GPU window will read in time are dropped
NIC_KEEP_WINDOWS = 6

#: the GPU features read from the round columns, and the column each is read from
_GPU_VALUES = (("temp_c", "temp"), ("power", "power"), ("sm_clock", "clock"))


class GpuWindows:
    """A node's half of the GPU feed: its GPUs' window means against their siblings.

    Every ``sample_s`` it adds one sampling round's temperature, power and clock to the
    window's sums (arrays with a row per GPU: the error rules' row); when a round falls in a
    later window (windows are aligned: number ``floor(ts / window_s)``, the same on every
    node) it turns the open window into residuals against the node's siblings. The node's
    NIC error rate comes from its NIC samples of the same window, in event time
    (:meth:`add_nic`), so what the model sees does not depend on which topic a runner read
    first: a closed window waits until the node's NIC samples have passed its end, or, if
    they stop, until the GPU samples are ``nic_wait`` windows beyond it (a node that never
    sent NIC samples does not wait). The rate is log10(1 + the node's errors per second):
    physical errors and retransmits, each port's mean rate over the window's samples, summed
    over the ports; it reads the same however the samples were split into records or steps.
    Ready windows go to :attr:`closed` for the core to send to the job's model
    (:class:`GpuJobAnomaly`, on the findings topic as a ``window_features`` record keyed
    ``anomaly:<job>``). A window of a node with no job is dropped: an idle node's GPUs have
    no job's model (its rule detectors still watch it)."""

    name = "peer_anomaly"

    def __init__(
        self,
        sample_s: float = 5.0,
        window_s: float = 20.0,
        min_peers: int = 3,
        nic_wait: int = 2,
        **_scoring: Any,  # the job side's settings (:class:`GpuJobAnomaly`)
    ) -> None:
        self.sample_s = sample_s
        self.window_s = window_s
        self.min_peers = min_peers
        self.nic_wait = nic_wait
        self.next_round = 0.0
        self.window = -1  # the open window's number (-1: none)
        self.newest = 0.0  # the open window's newest sample time
        self.job: str | None = None
        #: per GPU row: samples and sums of temp, power, clock in the open window
        self.counts = np.zeros((0, len(_GPU_VALUES)))
        self.sums = np.zeros((0, len(_GPU_VALUES)))
        self.gpu_of_row = np.zeros(0, dtype=np.int64)
        #: window number -> [NIC samples rated, sum of their errors/s, bit mask of their ports]
        self.nic_windows: dict[int, list[Any]] = {}
        self.nic_newest = -math.inf  # the node's newest NIC sample time
        #: windows closed, waiting for the node's NIC samples to pass their end
        self.waiting: list[ClosedWindow] = []
        #: windows ready and not yet sent (the core takes them after each step)
        self.closed: list[ClosedWindow] = []

    def update(self, rounds: Rounds, r: int) -> None:
        """Add round ``r``'s GPUs (one round every ``sample_s``: a window's mean needs no
        more, and the node's other rules already see every round)."""
        ts = float(rounds.ts[r])
        if ts < self.next_round:
            return
        self.next_round = ts + self.sample_s
        window = int(ts // self.window_s)
        if window != self.window:
            if window < self.window:
                return  # a round older than the open window: its window is gone
            self._close()
            self.window = window
            self._ready()
        cols = rounds.cols
        at = rounds.at[r][rounds.valid[r]]
        rows = cols.row[at]
        if len(rows) and int(rows.max()) >= len(self.counts):
            self._grow(int(rows.max()) + 1)
        values = np.stack([getattr(cols, column)[at] for _, column in _GPU_VALUES], axis=1)
        seen = ~np.isnan(values)
        np.add.at(self.counts, rows, seen)
        np.add.at(self.sums, rows, np.where(seen, values, 0.0))
        self.gpu_of_row[rows] = cols.gpu[at]
        self.newest = max(self.newest, ts)
        # the window's job is what its last round's samples say (None: the job ended; the
        # round's own job is the node's last known one, which outlives the job)
        self.job = cols.job[int(at[-1])] if len(at) else None

    def add_nic(
        self, ports: np.ndarray, ts: np.ndarray, rates: np.ndarray, rated: np.ndarray
    ) -> None:
        """The node's NIC samples of a step: each one's port (its row in the node's NIC
        detector), time, errors per second, and whether it had an interval to rate (a
        port's first sample has none): :class:`~.nic.NicIncreases`' ``local``, ``errors``
        and ``valid``."""
        self.nic_newest = max(self.nic_newest, float(ts.max()))
        windows = (ts[rated] // self.window_s).astype(np.int64).tolist()
        for w, port, rate in zip(
            windows, ports[rated].tolist(), rates[rated].tolist(), strict=True
        ):
            acc = self.nic_windows.get(w)
            if acc is None:
                acc = self.nic_windows[w] = [0.0, 0.0, 0]
            acc[0] += 1.0
            acc[1] += rate
            acc[2] |= 1 << port
        self._ready()

    def _grow(self, rows: int) -> None:
        more = rows - len(self.counts)
        self.counts = np.concatenate([self.counts, np.zeros((more, self.counts.shape[1]))])
        self.sums = np.concatenate([self.sums, np.zeros((more, self.sums.shape[1]))])
        self.gpu_of_row = np.concatenate([self.gpu_of_row, np.full(more, -1, dtype=np.int64)])

    def _close(self) -> None:
        """The open window's residuals to :attr:`waiting`; the sums start again."""
        reported = self.counts.sum(1) > 0
        if self.window >= 0 and self.job is not None and reported.any():
            self.waiting.append(
                (self.newest, self.window, self.job, *self._residuals(np.flatnonzero(reported)))
            )
        self.counts[:] = 0.0
        self.sums[:] = 0.0
        self.newest = 0.0

    def _ready(self, every: bool = False) -> None:
        """Waiting windows whose NIC samples are in (``every``: all, at the end of input) to
        :attr:`closed`, with the NIC error rate of their window; NIC sums no window will
        read are dropped."""
        nic_wait = self.nic_wait if self.nic_newest > -math.inf else 0
        while self.waiting:
            window = self.waiting[0][1]
            passed = self.nic_newest >= (window + 1) * self.window_s
            if not (every or passed or self.window - window >= nic_wait):
                break
            ts, window, job, gpus, features = self.waiting.pop(0)
            _, lo, hi, _, _ = GPU_FEATURES["nic_errors"]
            n, total, ports = self.nic_windows.pop(window, (0.0, 0.0, 0))
            # the ports' mean rates, summed: the node's errors per second over the window
            rate = total * ports.bit_count() / n if n else 0.0
            nic = min(hi, max(lo, math.log10(1.0 + rate))) if n else lo
            features["nic_errors"] = [round(nic, 4)] * len(gpus)
            self.closed.append((ts, window, job, gpus, features))
        keep = self.waiting[0][1] if self.waiting else self.window
        if self.nic_newest > -math.inf:  # a node whose GPU samples stopped keeps a few
            keep = max(keep, int(self.nic_newest // self.window_s) - NIC_KEEP_WINDOWS)
        for old in [w for w in self.nic_windows if w < keep]:
            del self.nic_windows[old]

    def _residuals(self, rows: np.ndarray) -> tuple[list[int], dict[str, list[float]]]:
        """Each GPU's window mean of each feature against its siblings' median (0: like them,
        or no peers to say); the NIC error rate is added when the window is ready."""
        counts, sums = self.counts[rows], self.sums[rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / counts, np.nan)
        features: dict[str, list[float]] = {}
        for j, (name, _) in enumerate(_GPU_VALUES):
            kind, lo, hi, _, _ = GPU_FEATURES[name]
            column = means[:, j]
            known = ~np.isnan(column)
            r = np.zeros(len(rows))
            if known.sum() >= self.min_peers:
                center = float(np.median(column[known]))
                if kind == "diff":
                    r = np.where(known, column - center, 0.0)
                elif center:
                    r = np.where(known, column / center - 1.0, 0.0)
            features[name] = np.round(np.clip(r, lo, hi), 4).tolist()
        return self.gpu_of_row[rows].tolist(), features

    def tick(self, now: float) -> list[Finding]:
        return []

    def flush(self) -> list[Finding]:
        """End of input: the open window and every waiting one go to :attr:`closed`."""
        self._close()
        self._ready(every=True)
        return []


class GpuJobAnomaly:
    """A job's half of the GPU feed: one river model for all the job's GPUs, over the
    windows its nodes send (:class:`GpuWindows`).

    It lives in the fusion table under ``anomaly:<job>``. Nodes' windows arrive at their
    partitions' paces, so a window is scored once a window ``slack`` later has arrived (or at
    the end of input), all its nodes' GPUs in (node, GPU) order: the model learns the same
    vectors in the same order whether the records came live or from a file. A window that
    arrives after its turn is scored on its own. Findings are ``info`` (``anomaly``) on the
    GPU's node, back to fusion through the findings topic.

    State: one model (8 trees of height 5, about 23 KB) per job, and a score baseline and a
    component's place (about 0.3 KB) per GPU."""

    name = "peer_anomaly"

    def __init__(self, job: str, slack: int = 2, **args: Any) -> None:
        args.pop("sample_s", None)
        self.job = job
        self.slack = slack
        self.detector = PeerAnomalyDetector(GPU_FEATURES, **args)
        self.newest = -1  # the newest window number seen
        self.done = -1  # windows up to this one are scored
        #: window number -> its nodes' windows: (node, newest time, GPUs, feature -> values)
        self.pending: dict[int, list[tuple[str, float, list[int], dict[str, list[float]]]]] = {}

    def add(
        self, node: str, ts: float, window: int, gpus: list[int], features: dict[str, list[float]]
    ) -> list[Finding]:
        """One node's window; the findings of the windows it makes due."""
        self.pending.setdefault(window, []).append((node, ts, gpus, features))
        self.newest = max(self.newest, window)
        due = sorted(w for w in self.pending if w <= self.newest - self.slack or w <= self.done)
        found: list[Finding] = []
        for w in due:
            found += self._score(w, self.pending.pop(w))
        return found

    def _score(
        self, window: int, parts: list[tuple[str, float, list[int], dict[str, list[float]]]]
    ) -> list[Finding]:
        det = self.detector
        det.window_start = window * det.window_s
        det.window_end = max(ts for _, ts, _, _ in parts)
        residuals: dict[Any, dict[str, float]] = {}
        for node, _, gpus, features in sorted(parts, key=lambda p: p[0]):
            for i, gpu in enumerate(gpus):
                component = (node, gpu)
                residuals[component] = {
                    name: _clip(features.get(name), i, spec) for name, spec in GPU_FEATURES.items()
                }
                det.where[component] = (self.job, node, gpu, None, self.job)
        self.done = max(self.done, window)
        return det.score(self.job, residuals)

    def tick(self, now: float) -> list[Finding]:
        return []

    def flush(self) -> list[Finding]:
        """End of input: every window still waiting."""
        found: list[Finding] = []
        for w in sorted(self.pending):
            found += self._score(w, self.pending.pop(w))
        return found


def _clip(values: list[float] | None, i: int, spec: Feature) -> float:
    """A window's value of a feature within its limits (absent: like the peers)."""
    kind, lo, hi, _, _ = spec
    v = values[i] if values is not None else (lo if kind == "level" else 0.0)
    return min(hi, max(lo, v))


class RankPeerAnomaly:
    """A job's feed: each rank's compute time, against its pipeline stage; one model per stage."""

    name = "peer_anomaly"

    def __init__(self, job: str, step_every: int = 5, **args: Any) -> None:
        self.job = job
        self.step_every = step_every
        self.detector = PeerAnomalyDetector(RANK_FEATURES, **args)

    def update(self, message: StepTiming) -> list[Finding]:
        """Observe the rank's step (:meth:`add_steps` of one row)."""
        return self.add_steps(StepColumns.of_records([(message, [message])]))

    def add_steps(self, cols: StepColumns) -> list[Finding]:
        """Observe the ranks' steps (every ``step_every``-th step of the job: the same steps
        for every rank, so that peers stay comparable). One by one: the trees of river's
        HalfSpaceTrees learn one sample at a time."""
        picked = (cols.step % self.step_every == 0) & ~np.isnan(cols.compute_s)
        found: list[Finding] = []
        observe, nodes = self.detector.observe, cols.nodes
        for i in np.flatnonzero(picked).tolist():
            rank = int(cols.rank[i])
            found += observe(
                float(cols.ts[i]),
                rank,
                max(int(cols.stage[i]), 0),  # no stage: stage 0
                {"compute": float(cols.compute_s[i])},
                nodes[cols.node[i]],
                rank=rank,  # the rank is the component: its node's GPU feed keys by gpu
                job=self.job,
            )
        return found

    def tick(self, now: float) -> list[Finding]:
        return []

    def flush(self) -> list[Finding]:
        return self.detector.flush()

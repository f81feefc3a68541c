"""Persistent deviation from peers: the rule that turns per-round residuals into a claim.

Every round (a training step, a collective, ...) each member of a peer group gets a
*residual* ``r``: how much worse than the group's median it was (``0.05`` = 5 % slower).
Healthy members are not identical (GPUs differ by about a percent), so a round is *slow*
for a member when either

* ``r - baseline > max(min_residual, z * sigma_rel)`` — it is worse than **its own usual
  place in the group** (the baseline is learned over its first ``baseline_rounds`` rounds and
  then follows very slowly, never while the member is slow); or
* ``r > max(abs_residual, z * sigma_abs)`` — it is far from its peers, however long it has
  been so (a rank that was slow from the start is still a straggler).

``sigma_rel`` and ``sigma_abs`` are the group's robust spreads of those two quantities in
this round (the detector passes them in, taking the larger of this round's and a smoothed
value, so a job-wide jittery round such as a data stall raises the bar for everyone).

A member whose *median* residual over a full window is at least ``offset_residual`` and at
least ``z`` standard errors (``sigma_abs / sqrt(window)``), with ``offset_fraction`` of its
rounds above the median, is slow in that window too: a persistent offset that is small
next to a noisy group's round-to-round spread (ten workers whose times jitter by 5 %, one of
them 10 % slower all along) is still an offset.

One slow round is a hiccup; a random member that is slow now and then is moving imbalance;
neither is a fault. The *score* of a round is how far past its threshold it was
(``>= 1`` is slow, capped at ``cap``). A member is *slow in a window* when at least
``min_fraction`` of its last ``window`` rounds were slow and its mean score is at least
``min_score``; it is *flagged* when slow in ``m`` of its last ``n`` windows, and cleared
after ``clear_after`` windows in a row that were not. A rank that is slow only part of the
time (every other step) still fills half its window; a gradual slowdown is caught once it
clears the thresholds.

**Sequential test** (``PersistenceRule.sequential``, a :class:`SequentialTest`): the window
rule above needs about eight rounds, so a detector that wants a claim in three or four also
runs a one-sided CUSUM on each member. A round's *standardised excess* is ``z = excess / s``
with ``s = max(sigma_rel, min_residual / k)`` (the floor makes ``k`` standard deviations
never less than ``min_residual``: a quiet group does not turn a 1 % drift into evidence),
or, where larger (a member slow from its first round has it in its baseline), ``k +
(residual - max(abs_residual, z * sigma_abs)) / s``: its distance past the window rule's
absolute bar. ``S = max(0, S + min(z, clip) - k)``, and the member is claimed once ``S >=
threshold``. ``clip - k = threshold / (rounds - 0.5)``: one round, however slow (a hiccup, a
checkpoint, a data stall on one rank), adds less than ``1 / (rounds - 1)`` of the threshold,
so no fewer than ``rounds`` (three by default) can cross it; three rounds of a clear
straggler do. The threshold and ``rounds`` come from the wanted false-alarm rate
(:func:`cusum_limits`). The window rule still runs beside it, and a claim made by either is
cleared by the same rule (``clear_after`` rounds in a row with neither slow).

A detector keeps one :class:`DeviationTracker` per member and one :class:`GroupNoise` per
group, and hands each round to :meth:`GroupNoise.judge`, which returns the members' raises
and clears.

Parameters
----------
window
    Rounds per window.
min_fraction
    Fraction of the window's rounds that must be slow.
min_residual
    Smallest excess over the member's own baseline that counts as slow.
abs_residual
    Smallest residual against the peers' median that counts as slow regardless of baseline.
z
    Multiples of the group's spread a residual must exceed.
min_score
    Smallest mean (capped) score over the window.
m, n
    Persistence: slow in ``m`` of the last ``n`` windows.
clear_after
    Windows in a row that are not slow before a flagged member is cleared.
baseline_rounds
    Rounds over which a member's baseline is learned before the relative test starts.
baseline_alpha
    Smoothing of the baseline afterwards (rounds that are not slow only).
cap
    Largest score one round can contribute.
crowd_fraction
    When more than this fraction of a group (and more than two members) got worse than
    their own baselines together, the cause is shared (a rack, a storage or network path,
    the input data); raises in that round are withdrawn (see :func:`crowded`).
offset_residual, offset_fraction
    The persistent-offset test (see above); residuals are winsorised to ``residual_cap``.

References
----------
NVIDIA Resiliency Extension (NVRx) straggler detection: relative and individual
performance scores. https://github.com/NVIDIA/nvidia-resiliency-ext

Example
-------
>>> from guard.detectors.persistent_deviation import DeviationTracker, PersistenceRule
>>> rule = PersistenceRule(baseline_rounds=4)
>>> t = DeviationTracker()
>>> residuals = [0.01] * 6 + [0.07] * 8  # 1 % slower than the median is this GPU's normal
>>> events = [t.update(r, 0.004, 0.01, rule, float(i)) for i, r in enumerate(residuals)]
>>> events.index("raise"), round(t.baseline, 3), t.since_ts
(12, 0.01, 6.0)
>>> hiccup = DeviationTracker()
>>> [hiccup.update(r, 0.004, 0.01, rule, 0.0) for r in [0.0] * 5 + [0.9] + [0.0] * 3]
[None, None, None, None, None, None, None, None, None]

"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from functools import lru_cache

import numpy as np

from .robust import mad_sigma

__all__ = [
    "DeviationTracker",
    "GroupNoise",
    "PersistenceRule",
    "SequentialTest",
    "crowded",
    "cusum_arl",
    "cusum_limits",
]

_SMOOTHING = 0.1
_SLOW = 0.02
_NAN = math.nan  # a normal round's slow residual


@dataclass(frozen=True, slots=True)
class SequentialTest:
    """A one-sided CUSUM on members' standardised excesses, its threshold from a false-alarm rate.

    Parameters
    ----------
    k
        Reference value, in standard deviations: half the shift the test is tuned for (a
        5 % slowdown at a 1 % step-to-step spread is 5 sigma). Rounds below ``k`` drain ``S``.
    false_per_1k_node_hours
        Wanted false claims of this test per 1,000 healthy node-hours.
    ranks_per_node, step_s
        Members per node and the shortest round (a 2 s training step): together the rounds a
        node-hour holds, ``ranks_per_node * 3600 / step_s`` (14,400).
    hiccup_rate
        Probability that a healthy member's round is an outlier of any size (a GC pause, a
        page-fault storm, a data stall on one rank): three times the 1/3,000 the simulator
        draws, as real hosts are noisier. Each such round saturates ``clip``.
    min_rounds
        The fewest rounds that may cross the threshold (more where the rate needs it).
    """

    k: float = 2.5
    false_per_1k_node_hours: float = 0.05
    ranks_per_node: int = 8
    step_s: float = 2.0
    hiccup_rate: float = 1e-3
    min_rounds: int = 3
    #: :func:`cusum_limits`, solved once: the threshold, the largest standardised excess one
    #: round adds (before ``- k``) and the fewest rounds that can cross the threshold
    threshold: float = field(init=False, compare=False)
    clip: float = field(init=False, compare=False)
    rounds: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        limits = cusum_limits(self)
        for name, value in zip(("threshold", "clip", "rounds"), limits, strict=True):
            object.__setattr__(self, name, value)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    erf = np.frompyfunc(math.erf, 1, 1)
    return np.asarray(0.5 * (1.0 + erf(x / math.sqrt(2.0))), dtype=float)


def cusum_arl(
    threshold: float, k: float, clip: float, hiccup_rate: float, cells: int = 150
) -> float:
    """Rounds until a false alarm, on average, for a healthy member (the in-control ARL).

    Brook and Evans' Markov chain: ``S`` in ``[0, threshold)`` cut into ``cells`` cells; a
    round's increment is ``min(z, clip) - k`` with ``z`` standard normal, or ``clip - k`` with
    probability ``hiccup_rate``. The mean time to absorption from ``S = 0`` is the ARL.

    >>> round(cusum_arl(4.0, 0.5, 99.0, 0.0))  # Siegmund's approximation: 338
    335
    """
    width = threshold / cells
    # P(S' < upper edge of cell j | S in cell i) = P(z < x); x depends on j - i only (cell 0
    # stands for S = 0, where the chain starts and restarts: half a cell lower)
    shifts = np.arange(-cells, cells + 1)
    x = (shifts + 0.5) * width + k
    cdf = np.where(x >= clip, 1.0, (1.0 - hiccup_rate) * _normal_cdf(x))
    rows = np.arange(cells)[:, None]
    cols = np.arange(cells)[None, :]
    below = cdf[cols - rows + cells]
    x0 = (np.arange(cells) + 1.0) * width + k  # from S = 0
    below[0] = np.where(x0 >= clip, 1.0, (1.0 - hiccup_rate) * _normal_cdf(x0))
    moves = np.diff(np.concatenate([np.zeros((cells, 1)), below], axis=1), axis=1)
    arl = np.linalg.solve(np.eye(cells) - moves, np.ones(cells))
    return float(arl[0])


@lru_cache(maxsize=32)
def cusum_limits(test: SequentialTest) -> tuple[float, float, int]:
    """Threshold, clip and fewest rounds to cross that give the wanted false-alarm rate.

    A healthy member's round gives ``z`` of unit standard deviation (it is standardised by
    the group's robust spread of the same quantity, or by a floor above it), drawn from a
    normal distribution, except that with probability ``hiccup_rate`` it is an outlier that
    saturates ``clip``. The CUSUM raises falsely once every ``ARL`` rounds
    (:func:`cusum_arl`), so per 1,000 node-hours it raises
    ``1000 * ranks_per_node * (3600 / step_s) / ARL`` times, at the shortest step. For
    ``rounds`` = ``min_rounds``, ``min_rounds + 1``, ... (``clip = k + threshold / (rounds -
    0.5)``), the first threshold on a 0.25 grid up to 12 that keeps that at most
    ``false_per_1k_node_hours`` is taken: the fewest rounds first, then the lowest threshold
    (the fastest claim of a straggler too weak to saturate ``clip``). With the defaults
    (0.05 per 1,000 node-hours, 8 ranks, 2 s steps, outliers 1/1,000, ``k`` 2.5) the ARL
    must reach 2.9e8 rounds:

    >>> cusum_limits(SequentialTest())
    (3.75, 4.0, 3)

    Outliers dominate: ``rounds`` of them within a few rounds make most false alarms, so a
    stricter rate needs more rounds, not only a higher threshold:

    >>> cusum_limits(SequentialTest(false_per_1k_node_hours=0.005))
    (1.5, 2.9286, 4)
    >>> cusum_limits(SequentialTest(hiccup_rate=0.5))
    Traceback (most recent call last):
    ValueError: no CUSUM threshold up to 12 crossed in up to 8 rounds gives 0.05 false claims ...
    """
    rounds_per_1k = 1000.0 * test.ranks_per_node * 3600.0 / test.step_s
    wanted = rounds_per_1k / test.false_per_1k_node_hours
    for rounds in range(max(2, test.min_rounds), 9):
        for i in range(4, 49):  # 1.0 .. 12.0
            h = 0.25 * i
            clip = test.k + h / (rounds - 0.5)
            if cusum_arl(h, test.k, clip, test.hiccup_rate) >= wanted:
                return h, round(clip, 4), rounds
    raise ValueError(
        f"no CUSUM threshold up to 12 crossed in up to 8 rounds gives "
        f"{test.false_per_1k_node_hours} false claims per 1,000 node-hours with outliers at "
        f"{test.hiccup_rate} a round: ask for a higher rate or check the outlier rate"
    )


@dataclass(frozen=True, slots=True)
class PersistenceRule:
    """Thresholds shared by all members of all groups of one detector."""

    window: int = 12
    min_fraction: float = 0.5
    min_residual: float = 0.02
    abs_residual: float = 0.07
    z: float = 4.0
    min_score: float = 0.75
    m: int = 2
    n: int = 3
    clear_after: int = 30
    baseline_rounds: int = 16
    baseline_alpha: float = 0.002
    cap: float = 3.0
    offset_residual: float = 0.05
    offset_fraction: float = 0.75
    residual_cap: float = 0.5
    crowd_fraction: float = 0.25
    #: the CUSUM beside the window rule (None: the window rule alone)
    sequential: SequentialTest | None = None

    def __setstate__(self, state: list[object]) -> None:
        """Restore a pickled rule; fields a checkpoint of an older Guard lacks (appended
        since: ``sequential``) take their defaults (a restored detector runs without the
        sequential test until its key starts afresh)."""
        values = iter(state)
        for f in fields(self):
            object.__setattr__(self, f.name, next(values, f.default))


class DeviationTracker:
    """One member's recent scores, baseline and flagged state (a few hundred bytes pickled)."""

    __slots__ = (
        "active",
        "baseline",
        "calm",
        "cusum",
        "cusum_excess",
        "cusum_residual",
        "cusum_since",
        "cusum_steps",
        "raised_by",
        "residuals",
        "rounds",
        "scores",
        "since_ts",
        "slow",
        "slow_residuals",
        "windows",
    )

    def __init__(self) -> None:
        self.scores: deque[float] = deque()
        self.slow: deque[float] = deque()  # round timestamps of slow rounds, -1.0 for normal
        self.slow_residuals: deque[float] = deque()
        self.residuals: deque[float] = deque()
        self.windows = 0  # bit history of window verdicts, newest in bit 0
        self.active = False
        self.calm = 0
        self.since_ts = 0.0
        self.baseline = 0.0
        self.rounds = 0
        self.cusum = 0.0  # the sequential test's statistic S (0: no evidence)
        self.cusum_steps = 0  # rounds since S last left 0
        self.cusum_since = 0.0  # the first of them
        self.cusum_excess = 0.0  # sums over them: excess over baseline, residual
        self.cusum_residual = 0.0
        self.raised_by = ""  # "cusum" or "window": the test that made the current claim

    def __setstate__(self, state: tuple[None, dict[str, object]]) -> None:
        """Restore a pickled tracker; slots a checkpoint of an older Guard lacks (the
        sequential test's) start from their defaults instead of being left unset."""
        self.__init__()  # type: ignore[misc]
        for name, value in state[1].items():
            setattr(self, name, value)

    def excess(self, residual: float, rule: PersistenceRule) -> float | None:
        """Residual above the member's own baseline; ``None`` while the baseline is learned."""
        return residual - self.baseline if self.rounds >= rule.baseline_rounds else None

    def slow_mean(self) -> float:
        """Mean residual (against peers) over the window's slow rounds, else over the
        sequential test's current run of evidence, else over the window."""
        picked = [r for r in self.slow_residuals if not math.isnan(r)]
        if picked and len(picked) * 2 >= len(self.slow_residuals):
            return sum(picked) / len(picked)
        if self.cusum_steps:
            return self.cusum_residual / self.cusum_steps
        return sum(self.residuals) / len(self.residuals) if self.residuals else 0.0

    def sequential_evidence(self, test: SequentialTest) -> dict[str, float | int | str]:
        """The sequential test's figures for a finding's evidence."""
        steps = self.cusum_steps
        return {
            "raised_by": self.raised_by,
            "steps": steps,
            "cusum": round(self.cusum, 2),
            "threshold": test.threshold,
            "excess_pct": round(100.0 * self.cusum_excess / steps, 1) if steps else 0.0,
        }

    def veto(self) -> None:
        """Withdraw a raise the detector decided against (the member may raise again later)."""
        self.active = False
        self.windows = 0
        self.cusum = 0.0
        self.cusum_steps = 0

    def slow_rounds(self) -> int:
        return sum(1 for s in self.slow if s >= 0.0)

    def update(
        self,
        residual: float,
        sigma_rel: float,
        sigma_abs: float,
        rule: PersistenceRule,
        round_ts: float,
    ) -> str | None:
        """Add one round; return ``"raise"``, ``"clear"`` or ``None``."""
        self.rounds = rounds = self.rounds + 1
        ready = rounds > rule.baseline_rounds
        baseline = self.baseline
        if not ready:
            self.baseline = baseline = baseline + (residual - baseline) / rounds
        a, b = rule.abs_residual, rule.z * sigma_abs
        score = residual / max(a, b)
        if ready:
            a, b = rule.min_residual, rule.z * sigma_rel
            score = max(score, (residual - baseline) / max(a, b))
        slow_round = score >= 1.0
        if ready and not slow_round and not self.active and score < 0.5:
            self.baseline = baseline + rule.baseline_alpha * (residual - baseline)
        scores, slow, picked, kept = self.scores, self.slow, self.slow_residuals, self.residuals
        cap = rule.cap
        scores.append((cap if cap < score else score) if score > 0.0 else 0.0)
        if slow_round:
            slow.append(round_ts)
            picked.append(residual)
        else:
            slow.append(-1.0)
            picked.append(_NAN)
        cap = rule.residual_cap
        kept.append(cap if residual > cap else (-cap if residual < -cap else residual))
        if len(scores) > rule.window:
            scores.popleft()
            slow.popleft()
            picked.popleft()
            kept.popleft()
        n_slow = len(slow) - slow.count(-1.0)
        verdict = (
            len(scores) >= rule.window // 2
            and n_slow >= rule.min_fraction * rule.window
            and sum(scores) / len(scores) >= rule.min_score
        )
        if not verdict and len(kept) >= rule.window and max(kept) >= rule.offset_residual:
            ordered = sorted(kept)
            mid = len(ordered) // 2
            typical = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
            # the median's standard error is ~1.25 that of the mean; hiccups do not move it
            if (
                typical >= rule.offset_residual
                and typical >= 1.25 * rule.z * sigma_abs / math.sqrt(len(kept))
                and sum(1 for r in kept if r > 0.0) >= rule.offset_fraction * len(kept)
            ):
                verdict = True
                if not slow_round and not any(t >= 0.0 for t in slow):
                    slow[-1] = round_ts  # the offset itself is the evidence: date it here
                    picked[-1] = residual
        self.windows = ((self.windows << 1) | verdict) & ((1 << rule.n) - 1)
        crossed = False
        test = rule.sequential
        if test is not None:
            crossed = self._sequential(residual, sigma_rel, sigma_abs, rule, test, round_ts)
        if not self.active:
            if verdict and self.windows.bit_count() >= rule.m:
                self.active = True
                self.calm = 0
                self.since_ts = next(s for s in slow if s >= 0.0)
                self.raised_by = "window"
                return "raise"
            if crossed:
                self.active = True
                self.calm = 0
                self.since_ts = self.cusum_since
                self.raised_by = "cusum"
                return "raise"
            return None
        if verdict or crossed:
            self.calm = 0
            return None
        self.calm += 1
        if self.calm >= rule.clear_after:
            self.active = False
            self.windows = 0
            self.cusum = 0.0
            self.cusum_steps = 0
            return "clear"
        return None

    def _sequential(
        self,
        residual: float,
        sigma_rel: float,
        sigma_abs: float,
        rule: PersistenceRule,
        test: SequentialTest,
        round_ts: float,
    ) -> bool:
        """One round of the CUSUM (module docstring); has ``S`` reached the threshold?"""
        k = test.k
        scale = max(sigma_rel, rule.min_residual / k)
        # past the absolute bar (that of the window rule), in units of round-to-round noise
        z = k + (residual - max(rule.abs_residual, rule.z * sigma_abs)) / scale
        excess = 0.0
        if self.rounds > rule.baseline_rounds:
            excess = residual - self.baseline
            z = max(z, excess / scale)
        clip, threshold = test.clip, test.threshold
        cusum = self.cusum + (clip if z > clip else z) - k
        if cusum <= 0.0:
            self.cusum = 0.0
            self.cusum_steps = 0
            return False
        if self.cusum_steps == 0:
            self.cusum_since = round_ts
            self.cusum_excess = self.cusum_residual = 0.0
        # capped, so that a claimed member drains within a few healthy rounds once it recovers
        self.cusum = cusum if cusum < 2.0 * threshold else 2.0 * threshold
        self.cusum_steps += 1
        self.cusum_excess += excess
        self.cusum_residual += residual
        return cusum >= threshold


def crowded(trackers: list[DeviationTracker], rule: PersistenceRule, sigma_rel: float) -> bool:
    """Did too many members of one group move away from their own baselines together?

    A member counts when the mean of its last four residuals is ``max(2 * min_residual,
    sigma_rel)`` away from its baseline, in either direction (the standard error of a
    four-round mean is half a round's spread: a two-sigma bar, lower than the claim's, on
    purpose). Either direction, because when a subgroup slows down the median moves and the
    rest look faster: one straggler moves nobody else.
    """
    bar = max(2.0 * rule.min_residual, 1.5 * sigma_rel)
    n = 0
    learned = rule.baseline_rounds
    for t in trackers:
        if t.rounds > learned and len(t.residuals) >= 4:
            recent = t.residuals
            last4 = (recent[-1] + recent[-2] + recent[-3] + recent[-4]) / 4.0
            if abs(last4 - t.baseline) >= bar:
                n += 1
    return n > 2 and n > rule.crowd_fraction * len(trackers)


class GroupNoise:
    """A peer group's spread of residuals, this round's or the smoothed one, whichever is larger.

    ``sigma_abs`` is the MAD-sigma of the residuals against the median; ``sigma_rel`` that of
    the members' excesses over their own baselines (much smaller in a quiet job: it measures
    round-to-round jitter, not the fixed differences between GPUs). A round whose spread is
    more than ``disturbed_factor`` times the group's usual spread (a data stall, a checkpoint
    or congestion jitters everyone at once) is *disturbed*: it carries no evidence about any
    one member, and the detectors skip it — otherwise a member that drew high noise a few
    rounds in a row would look persistently slow.
    """

    __slots__ = ("abs", "crowd", "disturbed", "rel", "usual", "warm")

    def __init__(self) -> None:
        self.abs = -1.0
        self.rel = -1.0
        self.usual = -1.0  # slow average of calm rounds' sigma_abs
        self.warm = 0
        self.disturbed = False
        self.crowd = 0  # rounds left in which the group counts as moved together

    def shared(
        self, trackers: list[DeviationTracker], rule: PersistenceRule, sigma_rel: float
    ) -> bool:
        """:func:`crowded`, held for a window of rounds once seen (a shared cause lingers)."""
        if crowded(trackers, rule, sigma_rel):
            self.crowd = 3 * rule.window
        elif self.crowd > 0:
            self.crowd -= 1
        return self.crowd > 0

    def judge(
        self,
        trackers: list[DeviationTracker],
        residuals: list[float],
        rule: PersistenceRule,
        round_ts: float,
    ) -> list[tuple[int, str]]:
        """One round of the group: ``(member index, "raise" or "clear")`` for each event.

        Nothing when the round is disturbed; a raise in a round the group moved together
        (:meth:`shared`) is vetoed instead of returned.
        """
        learned = rule.baseline_rounds  # :meth:`DeviationTracker.excess`, inline
        excesses = [
            r - t.baseline for t, r in zip(trackers, residuals, strict=True) if t.rounds >= learned
        ]
        sigma_rel, sigma_abs = self.measure(residuals, excesses)
        if self.disturbed:
            return []  # everyone jittered at once: no evidence about anyone this round
        events = [
            tracker.update(residual, sigma_rel, sigma_abs, rule, round_ts)
            for residual, tracker in zip(residuals, trackers, strict=True)
        ]
        shared = self.shared(trackers, rule, sigma_rel)
        if not any(events):
            return []  # the common case: no member raised or cleared
        judged: list[tuple[int, str]] = []
        for i, (tracker, event) in enumerate(zip(trackers, events, strict=True)):
            if event == "raise" and shared:
                tracker.veto()  # many members slowed at once: a shared cause, not this one
            elif event is not None:
                judged.append((i, event))
        return judged

    def measure(
        self, residuals: list[float], excesses: list[float], disturbed_factor: float = 2.0
    ) -> tuple[float, float]:
        step_abs = mad_sigma(residuals, 0.0)
        step_rel = mad_sigma(excesses) if len(excesses) >= 3 else step_abs
        self.disturbed = self.warm >= 8 and step_abs > disturbed_factor * self.usual
        if not self.disturbed:
            self.warm += 1
            rate = max(_SLOW, 1.0 / self.warm)
            self.usual = step_abs if self.usual < 0 else self.usual + rate * (step_abs - self.usual)
        self.abs = step_abs if self.abs < 0 else self.abs + _SMOOTHING * (step_abs - self.abs)
        self.rel = step_rel if self.rel < 0 else self.rel + _SMOOTHING * (step_rel - self.rel)
        return max(step_rel, self.rel), max(step_abs, self.abs)

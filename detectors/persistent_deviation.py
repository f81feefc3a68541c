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

A detector keeps all its members' state in one :class:`TrackerTable` (a slot each, arrays
indexed by slot) and one :class:`GroupNoise` per group, and hands each round of a group to
:meth:`TrackerTable.judge`, which updates the members at once and returns their raises and
clears.

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
>>> import numpy as np
>>> from guard.detectors.persistent_deviation import GroupNoise, PersistenceRule, TrackerTable
>>> rule = PersistenceRule(baseline_rounds=4)
>>> table, noise = TrackerTable(rule), GroupNoise()
>>> slots = np.array([table.new_slot() for _ in range(8)])
>>> usual = np.array([0.0, 0.01, -0.01, 0.0, 0.005, 0.01, -0.005, 0.0])  # GPUs differ by ~1 %
>>> jitter = np.resize([0.002, -0.002, 0.001, -0.001, 0.0], 8)
>>> events = []
>>> for i in range(16):
...     residuals = usual + np.roll(jitter, i)
...     residuals[5] += 0.06 if i >= 6 else 0.0  # 6 % slower from round 6 on
...     residuals[2] += 0.9 if i == 9 else 0.0  # one hiccup: no claim
...     events += table.judge(noise, slots, residuals, float(i))
>>> events, round(table.baseline(5), 3), table.since_ts(5), table.slow_rounds(5)
([(5, 'raise')], 0.01, 6.0, 10)

"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache

import numpy as np

from .robust import MAD_TO_SIGMA, mad_sigma

__all__ = [
    "GroupNoise",
    "PersistenceRule",
    "SequentialTest",
    "TrackerTable",
    "cusum_arl",
    "cusum_limits",
]

_SMOOTHING = 0.1
_SLOW = 0.02
#: groups up to this size take their robust spreads over lists (sorted() beats np.sort there)
_LISTS_UP_TO = 48


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


_RAISED_BY = ("", "window", "cusum")  # TrackerTable.raised_by: the test that made the claim
#: the windows of the last rounds (TrackerTable.history[:, i]), and what an empty cell holds
#: (it counts for nothing): capped scores, residuals (a slow round's residual is read where
#: its round is dated, the winsorised one through :func:`_kept`). The third window, the
#: timestamps of slow rounds (-1: a normal round), is kept only for members that had a slow
#: round in their window (TrackerTable.slow_ts): most members have none
_SCORES, _RESIDUALS = range(2)
_EMPTY = np.array([0.0, 0.0])
#: the per-member numbers, with their dtype
#: (counters as int32: 2**31 rounds is 68 years of one a second)
_SCALARS = {
    "rounds": np.int32,
    "baselines": np.float64,
    "flagged": np.bool_,
    "calm": np.int32,
    "windows": np.int32,  # bit history of window verdicts, newest in bit 0 (n <= 31)
    "since": np.float64,  # when the current claim's evidence began
    "raised_by": np.int8,  # index into _RAISED_BY
    "timed": np.bool_,  # has a window of slow-round timestamps in slow_ts
    "cusum": np.float64,  # the sequential test's statistic S (0: no evidence)
    "cusum_steps": np.int32,  # rounds since S last left 0
    "cusum_since": np.float64,  # the first of them
    "cusum_excess": np.float64,  # sums over them: excess over baseline, residual
    "cusum_residual": np.float64,
}


class TrackerTable:
    """All members' recent scores, baselines and flagged states, as arrays indexed by a slot.

    A member is a dense *slot* (:meth:`new_slot`). Its last ``rule.window`` rounds are rows
    of ``history``, shape ``(slots, 2, window)``: two windows (capped scores, residuals),
    oldest first, shifted by one each round, empty cells first while a member holds fewer
    rounds (``min(rounds, window)``), and the window of its slow rounds' timestamps in
    ``slow_ts`` while it has one; everything else is one number per slot. :meth:`judge` runs
    one round of one group as array operations over its members, with the per-member rule's
    results to the last bit (sums in window order). About 280 bytes a member pickled.
    """

    __slots__ = (
        "baselines",
        "calm",
        "cusum",
        "cusum_excess",
        "cusum_residual",
        "cusum_since",
        "cusum_steps",
        "flagged",
        "history",
        "raised_by",
        "rounds",
        "rule",
        "since",
        "slow_ts",
        "timed",
        "used",
        "windows",
    )
    rule: PersistenceRule
    used: int
    history: np.ndarray
    rounds: np.ndarray
    baselines: np.ndarray
    flagged: np.ndarray
    calm: np.ndarray
    windows: np.ndarray
    since: np.ndarray
    slow_ts: dict[int, np.ndarray]
    timed: np.ndarray
    raised_by: np.ndarray
    cusum: np.ndarray
    cusum_steps: np.ndarray
    cusum_since: np.ndarray
    cusum_excess: np.ndarray
    cusum_residual: np.ndarray

    def __init__(self, rule: PersistenceRule, capacity: int = 8) -> None:
        if not 0 < rule.n <= 31:
            raise ValueError(f"persistence over n={rule.n} windows: 1 to 31 (one bit each)")
        self.rule = rule
        self.used = 0
        self.history = np.repeat(_EMPTY[None, :, None], capacity, axis=0).repeat(rule.window, 2)
        #: slot -> the timestamps of its window's slow rounds (-1: normal), for the members
        #: with one (``timed``)
        self.slow_ts = {}
        for name, dtype in _SCALARS.items():
            setattr(self, name, np.zeros(capacity, dtype))

    def __getstate__(self) -> dict[str, object]:
        """Only the slots in use (the arrays grow by doubling)."""
        used = self.used
        state: dict[str, object] = {"rule": self.rule, "used": used, "slow_ts": self.slow_ts}
        for name in ("history", *_SCALARS):
            state[name] = getattr(self, name)[:used].copy()
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    # --- slots -----------------------------------------------------------------------------

    def new_slot(self) -> int:
        """A slot with a fresh history."""
        slot = self.used
        capacity = len(self.rounds)
        if slot == capacity:
            for name in ("history", *_SCALARS):
                column = getattr(self, name)
                more = np.zeros((max(8, capacity), *column.shape[1:]), column.dtype)
                setattr(self, name, np.concatenate([column, more]))
        self.used = slot + 1
        self.reset(slot)
        return slot

    def reset(self, slot: int) -> None:
        """Start ``slot``'s history afresh (a member that moved)."""
        self.history[slot] = _EMPTY[:, None]
        self.slow_ts.pop(slot, None)
        for name in _SCALARS:
            getattr(self, name)[slot] = 0

    def _window(self, which: int, slot: int) -> list[float]:
        """``slot``'s window ``which`` (``_SCORES`` ...), oldest first, as many as it holds."""
        return [float(v) for v in self.history[slot, which, self.rule.window - self.filled(slot) :]]

    def _slow_window(self, slot: int) -> list[float]:
        """``slot``'s slow rounds' timestamps (-1: a normal round), like :meth:`_window`."""
        held, times = self.filled(slot), self.slow_ts.get(slot)
        return [-1.0] * held if times is None else [float(v) for v in times[len(times) - held :]]

    def _slow_windows(self, slots: np.ndarray) -> np.ndarray:
        """The members' slow-round timestamps shifted by one round, the newest cell -1."""
        slow = np.full((len(slots), self.rule.window), -1.0)
        for i in np.flatnonzero(self.timed[slots]).tolist():
            slow[i, :-1] = self.slow_ts[int(slots[i])][1:]
        return slow

    def _keep_slow(self, slots: np.ndarray, slow: np.ndarray) -> None:
        """Keep the windows of the members that have a slow round in them."""
        timed = (slow != -1.0).any(axis=1)
        for i in np.flatnonzero(timed | self.timed[slots]).tolist():
            if timed[i]:
                self.slow_ts[int(slots[i])] = slow[i].copy()
            else:
                del self.slow_ts[int(slots[i])]
        self.timed[slots] = timed

    # --- one member, for a finding's evidence ----------------------------------------------

    def active(self, slot: int) -> bool:
        """Is a claim on the member open?"""
        return bool(self.flagged[slot])

    def baseline(self, slot: int) -> float:
        """The member's own usual residual."""
        return float(self.baselines[slot])

    def since_ts(self, slot: int) -> float:
        """When the evidence of the member's claim began."""
        return float(self.since[slot])

    def filled(self, slot: int) -> int:
        """Rounds in the window (``window`` once it is full)."""
        return min(int(self.rounds[slot]), self.rule.window)

    def slow_rounds(self, slot: int) -> int:
        return sum(1 for s in self._slow_window(slot) if s >= 0.0)

    def slow_mean(self, slot: int) -> float:
        """Mean residual (against peers) over the window's slow rounds, else over the
        sequential test's current run of evidence, else over the window."""
        slow_ts = self._slow_window(slot)
        window = self._window(_RESIDUALS, slot)
        picked = [r for r, ts in zip(window, slow_ts, strict=True) if ts >= 0.0]
        if picked and len(picked) * 2 >= len(window):
            return sum(picked) / len(picked)
        steps = int(self.cusum_steps[slot])
        if steps:
            return float(self.cusum_residual[slot]) / steps
        kept = _kept(self.history[slot : slot + 1], self.rule.residual_cap)[0]
        return sum(kept[len(kept) - len(window) :].tolist()) / len(window) if window else 0.0

    def sequential_evidence(self, slot: int, test: SequentialTest) -> dict[str, float | int | str]:
        """The sequential test's figures for a finding's evidence."""
        steps = int(self.cusum_steps[slot])
        excess = float(self.cusum_excess[slot])
        return {
            "raised_by": _RAISED_BY[self.raised_by[slot]],
            "steps": steps,
            "cusum": round(float(self.cusum[slot]), 2),
            "threshold": test.threshold,
            "excess_pct": round(100.0 * excess / steps, 1) if steps else 0.0,
        }

    def veto(self, slot: int | np.ndarray) -> None:
        """Withdraw a raise the detector decided against (the member may raise again later)."""
        self.flagged[slot] = False
        self.windows[slot] = 0
        self.cusum[slot] = 0.0
        self.cusum_steps[slot] = 0

    # --- one round of one group ------------------------------------------------------------

    def judge(
        self, noise: GroupNoise, slots: np.ndarray, residuals: np.ndarray, round_ts: float
    ) -> list[tuple[int, str]]:
        """One round of a group: ``(member index, "raise" or "clear")`` for each event.

        ``slots[i]`` (distinct) is member ``i``'s slot, ``residuals[i]`` its residual. Nothing
        when the round is disturbed (:class:`GroupNoise`); a raise in a round the group moved
        together (:meth:`crowded`, held by :meth:`GroupNoise.shared`) is vetoed instead of
        returned. The branches only skip work whose result is known (nothing learning, no
        member past a bar).
        """
        rule = self.rule
        slots = np.asarray(slots, dtype=np.intp)
        r = np.asarray(residuals, dtype=np.float64)
        rounds = self.rounds[slots] + 1
        ready = rounds > rule.baseline_rounds
        learning = not ready.all()
        active = self.flagged[slots]
        scored = self._score(noise, r, rounds, self.baselines[slots], ready, learning, active)
        if scored is None:
            return []  # everyone jittered at once: no evidence about anyone this round
        score, baseline, sigma_rel, sigma_abs = scored
        verdict, kept, slow = self._verdicts(slots, r, score, rounds, learning, sigma_abs, round_ts)
        self.rounds[slots] = rounds
        self.baselines[slots] = baseline

        crossed = None
        if rule.sequential is not None:
            crossed = self._sequential(
                slots, r, ready, learning, baseline, sigma_rel, sigma_abs, round_ts
            )
        raised = cleared = None
        windows = self.windows[slots]
        count = np.count_nonzero
        if count(verdict) or count(windows) or count(active) or crossed is not None:
            raised, cleared = self._claims(slots, verdict, crossed, windows, active, slow)

        moved = self.crowded(rounds, learning, kept, baseline, sigma_rel)
        shared = noise.shared(moved, rule)
        if raised is None or cleared is None or not (raised.any() or cleared.any()):
            return []  # the common case: no member raised or cleared
        if shared and raised.any():
            self.veto(slots[raised])  # many members slowed at once: a shared cause
            raised[:] = False
        return [
            (int(i), "raise" if raised[i] else "clear") for i in np.flatnonzero(raised | cleared)
        ]

    def _score(
        self,
        noise: GroupNoise,
        r: np.ndarray,
        rounds: np.ndarray,
        baseline: np.ndarray,
        ready: np.ndarray,
        learning: bool,
        active: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """Each member's score this round (1: a slow round) and its baseline after it, and
        the group's noise (relative, absolute); None when the round is disturbed."""
        rule = self.rule
        excess = r - baseline
        sigma_rel, sigma_abs = noise.measure(r, excess[ready] if learning else excess)
        if noise.disturbed:
            return None
        score = r / max(rule.abs_residual, rule.z * sigma_abs)
        relative = np.maximum(score, excess / max(rule.min_residual, rule.z * sigma_rel))
        if learning:
            baseline = np.where(ready, baseline, baseline + (r - baseline) / rounds)
            score = np.where(ready, relative, score)
        else:
            score = relative
        follows = (score < 0.5) & ~active  # never slow
        if learning:
            follows &= ready
        baseline = np.where(follows, baseline + rule.baseline_alpha * excess, baseline)
        return score, baseline, sigma_rel, sigma_abs

    def _verdicts(
        self,
        slots: np.ndarray,
        r: np.ndarray,
        score: np.ndarray,
        rounds: np.ndarray,
        learning: bool,
        sigma_abs: float,
        round_ts: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The round into the members' windows; each member's verdict over its window (slow
        enough rounds, or a steady offset), its winsorised residuals and its slow rounds'
        times."""
        rule = self.rule
        window = rule.window
        slow_round = score >= 1.0
        history = self.history[slots]
        history[:, :, :-1] = history[:, :, 1:]
        history[:, _SCORES, -1] = np.minimum(np.maximum(score, 0.0), rule.cap)
        history[:, _RESIDUALS, -1] = r
        slow, kept = self._slow_windows(slots), _kept(history, rule.residual_cap)
        slow[:, -1] = np.where(slow_round, round_ts, -1.0)
        total = np.add.accumulate(history[:, _SCORES], axis=1)[:, -1]  # in window order
        verdict = (slow != -1.0).sum(axis=1) >= rule.min_fraction * window
        if learning or rule.baseline_rounds < window:  # some windows are not full yet
            held = np.minimum(rounds, window)
            verdict &= (held >= window // 2) & (total / held >= rule.min_score)
        else:
            verdict &= total / window >= rule.min_score
        if kept.max() >= rule.offset_residual:
            offset = ~verdict & (rounds >= window) & (kept.max(axis=1) >= rule.offset_residual)
            if offset.any():
                offset = self._offset(offset, kept, sigma_abs)
                verdict |= offset
                # the offset itself is the evidence where no round was slow: date it here
                undated = offset & ~slow_round & ~(slow >= 0.0).any(axis=1)
                slow[undated, -1] = round_ts
        self.history[slots] = history
        self._keep_slow(slots, slow)
        return verdict, kept, slow

    def _claims(
        self,
        slots: np.ndarray,
        verdict: np.ndarray,
        crossed: np.ndarray | None,
        windows: np.ndarray,
        active: np.ndarray,
        slow: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The members' window bits, raises and clears (``crossed``: the CUSUM's, if any)."""
        rule = self.rule
        windows = ((windows << 1) | verdict) & ((1 << rule.n) - 1)
        self.windows[slots] = windows
        windows_slow = ((windows[:, None] >> np.arange(rule.n)) & 1).sum(axis=1)
        by_window = ~active & verdict & (windows_slow >= rule.m)
        raised = by_window
        evidence = verdict
        if crossed is not None:
            raised = by_window | (~active & crossed)
            evidence = verdict | crossed
        idle = active & ~evidence
        calm = self.calm[slots]
        calm = np.where(active | raised, np.where(idle, calm + 1, 0), calm)
        self.calm[slots] = calm
        cleared = idle & (calm >= rule.clear_after)
        if raised.any():
            by_cusum = raised & ~by_window
            first = np.argmax(slow >= 0.0, axis=1)  # the window's first slow round
            dated = slow[np.arange(len(slots)), first]
            since = np.where(by_cusum, self.cusum_since[slots], dated)
            self.since[slots[raised]] = since[raised]
            self.raised_by[slots[raised]] = np.where(by_cusum, 2, 1)[raised]
        self.flagged[slots] = (active & ~cleared) | raised
        if cleared.any():
            self.veto(slots[cleared])
        return raised, cleared

    def _offset(self, maybe: np.ndarray, kept: np.ndarray, sigma_abs: float) -> np.ndarray:
        """The persistent-offset test of full windows ``maybe`` (module docstring)."""
        rule = self.rule
        window = rule.window
        ordered = np.sort(kept[maybe], axis=1)
        mid = window // 2
        typical = ordered[:, mid] if window % 2 else 0.5 * (ordered[:, mid - 1] + ordered[:, mid])
        positive = (ordered > 0.0).sum(axis=1)
        # the median's standard error is ~1.25 that of the mean; hiccups do not move it
        found = np.zeros(len(maybe), dtype=bool)
        found[maybe] = (
            (typical >= rule.offset_residual)
            & (typical >= 1.25 * rule.z * sigma_abs / math.sqrt(window))
            & (positive >= rule.offset_fraction * window)
        )
        return found

    def _sequential(
        self,
        slots: np.ndarray,
        r: np.ndarray,
        ready: np.ndarray,
        learning: bool,
        baseline: np.ndarray,
        sigma_rel: float,
        sigma_abs: float,
        round_ts: float,
    ) -> np.ndarray | None:
        """One round of the CUSUM (module docstring); which members' ``S`` reached the
        threshold (None: none has evidence)?"""
        rule = self.rule
        test = rule.sequential
        assert test is not None
        k = test.k
        scale = max(sigma_rel, rule.min_residual / k)
        bar = max(rule.abs_residual, rule.z * sigma_abs)
        excess = r - baseline
        if learning:
            excess = np.where(ready, excess, 0.0)
        relative = excess / scale
        before = self.cusum[slots]
        if r.max() <= bar and relative.max() <= k and not before.any():
            return None  # no evidence, and no member's z above k: nobody gathers any
        # past the absolute bar (that of the window rule), in units of round-to-round noise
        z = k + (r - bar) / scale
        z = np.where(ready, np.maximum(z, relative), z) if learning else np.maximum(z, relative)
        cusum = before + np.minimum(z, test.clip) - k
        live = cusum > 0.0
        if not live.any():
            if before.any():
                self.cusum[slots] = 0.0
                self.cusum_steps[slots] = 0
            return None
        steps = self.cusum_steps[slots]
        went_on = slots[live]
        fresh = slots[live & (steps == 0)]
        self.cusum_since[fresh] = round_ts
        self.cusum_excess[fresh] = 0.0
        self.cusum_residual[fresh] = 0.0
        # capped, so that a claimed member drains within a few healthy rounds once it recovers
        self.cusum[slots] = np.where(live, np.minimum(cusum, 2.0 * test.threshold), 0.0)
        self.cusum_steps[slots] = np.where(live, steps + 1, 0)
        self.cusum_excess[went_on] += excess[live]
        self.cusum_residual[went_on] += r[live]
        crossed: np.ndarray = live & (cusum >= test.threshold)
        return crossed

    def crowded(
        self,
        rounds: np.ndarray,
        learning: bool,
        kept: np.ndarray,
        baseline: np.ndarray,
        sigma_rel: float,
    ) -> bool:
        """Did too many members of one group move away from their own baselines together?

        ``kept``: the members' winsorised residuals, oldest first, this round's last;
        ``rounds`` and ``baseline``: their rounds and baselines after it. A member counts
        when the mean of its last four residuals is ``max(2 * min_residual, 1.5 *
        sigma_rel)`` away from its baseline, in either direction (the standard error of a
        four-round mean is half a round's spread: a bar lower than the claim's, on purpose).
        Either direction, because when a subgroup slows down the median moves and the rest
        look faster: one straggler moves nobody else.
        """
        rule = self.rule
        if rule.window < 4:
            return False  # no member holds four rounds
        bar = max(2.0 * rule.min_residual, 1.5 * sigma_rel)
        last4 = (kept[:, -1] + kept[:, -2] + kept[:, -3] + kept[:, -4]) / 4.0
        moved = np.abs(last4 - baseline) >= bar
        if learning:
            moved &= rounds > rule.baseline_rounds
        if rule.baseline_rounds < 3:  # else a member past learning holds four rounds
            moved &= rounds >= 4
        n = int(moved.sum())
        return n > 2 and n > rule.crowd_fraction * len(kept)


def _kept(history: np.ndarray, cap: float) -> np.ndarray:
    """The winsorised residuals of :attr:`TrackerTable.history` rows (residuals within
    ``±cap``)."""
    kept: np.ndarray = np.minimum(np.maximum(history[:, _RESIDUALS], -cap), cap)
    return kept


def _median(values: np.ndarray) -> float:
    """:func:`~guard.detectors.robust.median` of an array, to the last bit."""
    ordered = np.sort(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    low, high = ordered[mid - 1 : mid + 1].tolist()
    return 0.5 * float(low + high)


def _mad_sigma(values: np.ndarray, center: float | None = None) -> float:
    """:func:`~guard.detectors.robust.mad_sigma` of an array, to the last bit."""
    if center == 0.0:
        return MAD_TO_SIGMA * _median(np.abs(values))  # |v - 0.0| is |v|
    c = _median(values) if center is None else center
    return MAD_TO_SIGMA * _median(np.abs(values - c))


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

    def shared(self, crowded: bool, rule: PersistenceRule) -> bool:
        """Has the group moved together (:meth:`TrackerTable.crowded`) within the last window
        of rounds? Held once seen: a shared cause lingers."""
        if crowded:
            self.crowd = 3 * rule.window
        elif self.crowd > 0:
            self.crowd -= 1
        return self.crowd > 0

    def measure(
        self, residuals: np.ndarray, excesses: np.ndarray, disturbed_factor: float = 2.0
    ) -> tuple[float, float]:
        """This round's ``(sigma_rel, sigma_abs)``, each the larger of the round's and the
        smoothed one; sets :attr:`disturbed`."""
        if len(residuals) <= _LISTS_UP_TO:
            step_abs = mad_sigma(residuals.tolist(), 0.0)
            step_rel = mad_sigma(excesses.tolist()) if len(excesses) >= 3 else step_abs
        else:
            step_abs = _mad_sigma(residuals, 0.0)
            step_rel = _mad_sigma(excesses) if len(excesses) >= 3 else step_abs
        self.disturbed = self.warm >= 8 and step_abs > disturbed_factor * self.usual
        if not self.disturbed:
            self.warm += 1
            rate = max(_SLOW, 1.0 / self.warm)
            self.usual = step_abs if self.usual < 0 else self.usual + rate * (step_abs - self.usual)
        self.abs = step_abs if self.abs < 0 else self.abs + _SMOOTHING * (step_abs - self.abs)
        self.rel = step_rel if self.rel < 0 else self.rel + _SMOOTHING * (step_rel - self.rel)
        return max(step_rel, self.rel), max(step_abs, self.abs)

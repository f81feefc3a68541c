"""The per-member persistence rule (one :class:`DeviationTracker` per member, updated one
round at a time in Python) and the per-group judge over them that the columnar
:class:`~guard.detectors.persistent_deviation.TrackerTable` replaced (issue 25), kept as the
reference of a differential test: the same residuals must give the same events, dates,
baselines and evidence. Not used by Guard."""

from __future__ import annotations

import math
from collections import deque

from guard.detectors.persistent_deviation import PersistenceRule, SequentialTest
from guard.detectors.robust import mad_sigma

__all__ = ["DeviationTracker", "GroupNoise", "crowded"]

_SMOOTHING = 0.1
_SLOW = 0.02
_NAN = math.nan  # a normal round's slow residual


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

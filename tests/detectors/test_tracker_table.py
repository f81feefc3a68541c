"""The columnar TrackerTable against the per-member DeviationTracker it replaced (issue 25).

Random groups (3 to 130 members, members joining late and starting afresh, stragglers of 3
to 15 % from various rounds, hiccups, disturbed and crowded rounds, the sequential test on
and off) run through both; every round must give the same events, and every member the same
baseline, claim date, slowdown and evidence, to the last bit.
"""

from __future__ import annotations

import math
import pickle
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from guard.detectors.persistent_deviation import (
    GroupNoise,
    PersistenceRule,
    SequentialTest,
    TrackerTable,
)

from .reference_deviation import DeviationTracker
from .reference_deviation import GroupNoise as ReferenceNoise

RULES = {
    "window": PersistenceRule(),
    "sequential": PersistenceRule(sequential=SequentialTest()),
    # an odd window (the median of the kept residuals is one value), quicker to learn and clear
    "short": PersistenceRule(
        window=9, baseline_rounds=6, clear_after=8, m=2, n=4, sequential=SequentialTest(k=2.0)
    ),
    # a baseline learned in two rounds, before a member holds the four that crowded() needs
    "eager": PersistenceRule(
        window=5, baseline_rounds=2, clear_after=5, sequential=SequentialTest()
    ),
    # the collective detector's connection rule
    "links": PersistenceRule(min_residual=0.15, abs_residual=0.3),
}


@dataclass
class Group:
    """A random group's members and what happens to them."""

    size: int
    rounds: int
    speed: list[float]
    jitter: float
    joins: dict[int, int]  # member -> first round
    restarts: dict[int, set[int]]  # member -> rounds at which its history starts afresh
    slow: dict[int, tuple[int, int, float]]  # member -> (from, to, slowdown)
    disturbed: set[int]
    crowds: list[tuple[int, int, set[int], float]]  # from, to, members, shift
    hiccup_rate: float
    shuffle: bool
    order: list[int] = field(default_factory=list)


def draw(seed: int, rounds: int) -> Group:
    rng = random.Random(seed)
    size = rng.choice([3, 4, 5, 8, 8, 16, 24, 32, 64, 100, 130])
    joins = {m: rng.randrange(1, rounds // 2) for m in rng.sample(range(size), size // 5)}
    restarts = {
        m: {rng.randrange(20, rounds) for _ in range(rng.randint(1, 2))}
        for m in rng.sample(range(size), max(1, size // 10))
    }
    slow = {
        m: (start, rng.choice([rounds, start + rng.randrange(20, 150)]), rng.uniform(0.03, 0.15))
        for m in rng.sample(range(size), max(1, size // 12) if rng.random() < 0.8 else 0)
        for start in [rng.randrange(0, rounds - 30)]
    }
    crowds = []
    for _ in range(rng.randint(0, 3)):
        start = rng.randrange(30, rounds - 20)
        members = set(rng.sample(range(size), max(1, int(size * rng.uniform(0.25, 0.6)))))
        crowds.append((start, start + rng.randrange(5, 40), members, rng.uniform(0.04, 0.12)))
    return Group(
        size=size,
        rounds=rounds,
        speed=[rng.gauss(0.0, rng.choice([0.002, 0.01, 0.03])) for _ in range(size)],
        jitter=rng.choice([0.002, 0.005, 0.01, 0.03]),
        joins=joins,
        restarts=restarts,
        slow=slow,
        disturbed={rng.randrange(rounds) for _ in range(rng.randint(0, rounds // 20))},
        crowds=crowds,
        hiccup_rate=rng.choice([0.0, 0.002, 0.02]),
        shuffle=rng.random() < 0.3,
    )


def values(group: Group, rng: random.Random, i: int) -> dict[int, float]:
    """Each present member's busy time in round ``i``."""
    out = {}
    for m in range(group.size):
        if group.joins.get(m, 0) > i:
            continue
        v = 1.0 + group.speed[m] + rng.gauss(0.0, group.jitter)
        start, stop, slowdown = group.slow.get(m, (0, 0, 0.0))
        if start <= i < stop:
            v += slowdown * (min(1.0, (i - start + 1) / 10) if slowdown < 0.06 else 1.0)
        for begin, end, members, shift in group.crowds:
            if begin <= i < end and m in members:
                v += shift
        if i in group.disturbed:
            v += abs(rng.gauss(0.0, 0.2))
        if rng.random() < group.hiccup_rate:
            v += rng.choice([0.3, 1.0, 5.0])
        out[m] = v
    return out


def evidence(tracker: DeviationTracker, test: SequentialTest | None) -> tuple[object, ...]:
    return (
        tracker.active,
        tracker.since_ts,
        tracker.slow_mean(),
        tracker.slow_rounds(),
        len(tracker.scores),
        tracker.sequential_evidence(test) if test is not None else None,
    )


def table_evidence(
    table: TrackerTable, slot: int, test: SequentialTest | None
) -> tuple[object, ...]:
    return (
        table.active(slot),
        table.since_ts(slot),
        table.slow_mean(slot),
        table.slow_rounds(slot),
        table.filled(slot),
        table.sequential_evidence(slot, test) if test is not None else None,
    )


def noise_state(noise: GroupNoise | ReferenceNoise) -> tuple[object, ...]:
    return (noise.abs, noise.rel, noise.usual, noise.warm, noise.disturbed, noise.crowd)


def compare(group: Group, rule: PersistenceRule, seed: int, repickle_at: int = -1) -> list[str]:
    """Run ``group`` through both; the events (``round member event``) they agreed on."""
    rng = random.Random(seed)
    table = TrackerTable(rule)
    noise, reference_noise = GroupNoise(), ReferenceNoise()
    trackers: dict[int, DeviationTracker] = {}
    slot_of: dict[int, int] = {}
    agreed = []
    for i in range(group.rounds):
        row = values(group, rng, i)
        members = list(row)
        if group.shuffle:
            rng.shuffle(members)
        if len(members) < 3:
            continue
        for m in members:
            if m not in slot_of:
                slot_of[m] = table.new_slot()
                trackers[m] = DeviationTracker()
            elif i in group.restarts.get(m, ()):
                table.reset(slot_of[m])
                trackers[m] = DeviationTracker()
        x = np.array([row[m] for m in members])
        center = float(np.median(x))
        residuals = x / center - 1.0
        expected = reference_noise.judge(
            [trackers[m] for m in members], [row[m] / center - 1.0 for m in members], rule, 10.0 * i
        )
        slots = np.array([slot_of[m] for m in members])
        got = table.judge(noise, slots, residuals, 10.0 * i)
        assert got == expected, f"round {i}"
        assert noise_state(noise) == noise_state(reference_noise), f"round {i}"
        for m in members:
            tracker, slot = trackers[m], slot_of[m]
            assert table.baseline(slot) == tracker.baseline, f"round {i} member {m}"
            assert table_evidence(table, slot, rule.sequential) == evidence(
                tracker, rule.sequential
            ), f"round {i} member {m}"
        agreed += [f"{i} {members[j]} {event}" for j, event in got]
        if i == repickle_at:
            table = pickle.loads(pickle.dumps(table, pickle.HIGHEST_PROTOCOL))
    return agreed


@pytest.mark.parametrize("rule_name", list(RULES))
@pytest.mark.parametrize("seed", range(8))
def test_random_groups_give_the_reference_events_dates_and_evidence(
    rule_name: str, seed: int
) -> None:
    group = draw(seed, rounds=400 + 50 * (seed % 3))
    compare(group, RULES[rule_name], seed, repickle_at=200 if seed % 2 else -1)


def test_the_runs_hold_raises_clears_and_vetoes() -> None:
    """The random groups are no idle comparison: members are claimed and cleared."""
    events = []
    for seed in range(8):
        events += compare(draw(seed, rounds=400), RULES["sequential"], seed)
    kinds = {e.split()[-1] for e in events}
    assert kinds == {"raise", "clear"} and len(events) >= 10


def test_a_long_run_of_a_large_group() -> None:
    group = draw(5, rounds=1200)
    group.size = 130
    group.speed += [0.01 * k for k in range(130 - len(group.speed))]
    compare(group, RULES["sequential"], 5)


def test_a_pickled_table_holds_only_the_slots_in_use() -> None:
    rule = RULES["sequential"]
    table = TrackerTable(rule)
    reference = [DeviationTracker() for _ in range(100)]
    slots = np.array([table.new_slot() for _ in range(100)])
    noise, reference_noise = GroupNoise(), ReferenceNoise()
    rng = np.random.default_rng(1)
    for i in range(40):
        residuals = rng.normal(0.0, 0.01, 100)
        table.judge(noise, slots, residuals, float(i))
        reference_noise.judge(reference, residuals.tolist(), rule, float(i))
    per_member = (
        len(pickle.dumps(table, pickle.HIGHEST_PROTOCOL))
        - len(pickle.dumps(TrackerTable(rule), pickle.HIGHEST_PROTOCOL))
    ) / 100
    per_tracker = len(pickle.dumps(reference, pickle.HIGHEST_PROTOCOL)) / 100
    assert per_member < 500 and per_member < per_tracker
    restored = pickle.loads(pickle.dumps(table, pickle.HIGHEST_PROTOCOL))
    assert restored.new_slot() == 100 and not math.isnan(restored.baseline(3))

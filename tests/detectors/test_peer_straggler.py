"""Peer straggler detection on hand-built step sequences, including every confounder."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable

import numpy as np
import pytest

from guard.detectors import persistent_deviation
from guard.detectors.findings import Finding
from guard.detectors.peer_straggler import PeerStragglerDetector
from guard.detectors.persistent_deviation import PersistenceRule, SequentialTest, cusum_arl
from guard.schemas import StepTiming
from guard.streams import checkpoints
from guard.streams.checkpoints import CHECKPOINT_FORMAT

from . import reference_deviation

RANKS = 16
T0 = 1_767_225_600.0


def run(
    factor: Callable[[int, int], float | None],
    steps: int = 120,
    stages: int = 1,
    seed: int = 1,
    order: Callable[[list[StepTiming]], list[StepTiming]] | None = None,
    noise: Callable[[random.Random], float] = lambda rng: 0.004 * rng.gauss(0, 1),
) -> list[Finding]:
    """``factor(step, rank)``: the rank's compute multiplier (None: no compute_s); ``noise``
    draws a rank-step's relative jitter."""
    rng = random.Random(seed)
    speed = [1.0 + 0.01 * rng.gauss(0, 1) for _ in range(RANKS)]  # GPUs differ by ~1 %
    det = PeerStragglerDetector("job")
    found: list[Finding] = []
    for step in range(steps):
        batch = []
        for rank in range(RANKS):
            f = factor(step, rank)
            stage = rank * stages // RANKS
            compute = None
            if f is not None:
                compute = 1.4 * (1.1 if stage == stages - 1 and stages > 1 else 1.0)
                compute *= speed[rank] * f * (1 + noise(rng))
            batch.append(
                StepTiming(
                    ts=T0 + 2.0 * step + 0.001 * rank,
                    node=f"n{rank // 8}-{rank}",
                    job="job",
                    rank=rank,
                    gpu=rank % 8,
                    step=step,
                    step_s=2.0,
                    compute_s=compute,
                    pp_stage=stage if stages > 1 else None,
                )
            )
        for msg in order(batch) if order else batch:
            found += det.update(msg)
    return found + det.flush()


def claims(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.severity != "info" and not f.clear]


def test_healthy_job_with_heterogeneous_gpus_gives_no_flag() -> None:
    for seed in range(5):
        assert claims(run(lambda s, r: 1.0, seed=seed)) == []


def test_steady_5_percent_straggler_is_flagged_within_a_few_steps() -> None:
    found = claims(run(lambda s, r: 1.05 if (r == 7 and s >= 40) else 1.0))
    assert [(f.rank, f.category, f.node) for f in found] == [(7, "straggler", "n0-7")]
    detected_step = (found[0].ts - T0) / 2.0
    assert 40 <= detected_step <= 44  # the sequential test: three or four steps
    evidence = found[0].evidence
    # 5 % slower than its own usual place; against the peers' median that is less, as this
    # GPU was 1.5 % faster than the median before
    assert 3.5 <= evidence["excess_pct"] <= 7.0
    slowdown = evidence["own_baseline_pct"] + evidence["excess_pct"]
    assert abs(slowdown - evidence["slowdown_pct"]) <= 0.15  # each rounded to 0.1
    assert (evidence["raised_by"], evidence["threshold"]) == ("cusum", 3.75)
    assert 2 <= evidence["steps"] <= 4 and evidence["cusum"] >= 3.75
    assert found[0].gpu == 7


def test_a_7_to_12_percent_straggler_is_claimed_in_three_or_four_steps() -> None:
    # step-to-step jitter of 1 % (real hosts; the simulator draws 0.4 %)
    for slowdown, seed in ((1.07, 1), (1.09, 2), (1.12, 3)):
        found = claims(
            run(
                lambda s, r, x=slowdown: x if (r == 7 and s >= 40) else 1.0,  # type: ignore[misc]
                seed=seed,
                noise=lambda rng: 0.01 * rng.gauss(0, 1),
            )
        )
        assert [f.rank for f in found] == [7], slowdown
        assert 42 <= (found[0].ts - T0) / 2.0 <= 43, slowdown  # the 3rd or 4th slow step
        evidence = found[0].evidence
        assert evidence["raised_by"] == "cusum" and evidence["steps"] in (3, 4)
        assert abs(evidence["excess_pct"] - 100 * (slowdown - 1)) < 2.5


def test_two_slow_steps_in_a_row_are_not_a_claim() -> None:
    # a checkpoint written by a few ranks, a data stall on one rank: two steps 30-80 % slower
    rng = random.Random(9)
    bursts = {(rng.randrange(20, 118), rng.randrange(RANKS)) for _ in range(12)}
    slow = {(s + i, r): 1.3 + 0.5 * rng.random() for s, r in bursts for i in (0, 1)}
    assert claims(run(lambda s, r: slow.get((s, r), 1.0))) == []


def test_heavy_tailed_jitter_gives_no_claim() -> None:
    # 1 % jitter with Student-t tails (3 degrees of freedom): 16 ranks x 2,000 steps
    def student_t(rng: random.Random) -> float:
        chi2 = sum(rng.gauss(0, 1) ** 2 for _ in range(3))
        return max(-0.3, 0.01 * rng.gauss(0, 1) / (chi2 / 3) ** 0.5)  # no step is free

    for seed in range(3):
        assert claims(run(lambda s, r: 1.0, steps=2000, seed=seed, noise=student_t)) == []


def test_rank_slow_from_the_first_step_is_flagged_against_peers() -> None:
    found = claims(run(lambda s, r: 1.12 if r == 3 else 1.0))
    assert [f.rank for f in found] == [3]


def test_one_step_hiccups_are_not_flagged() -> None:
    rng = random.Random(7)
    hiccups = {(rng.randrange(120), rng.randrange(RANKS)) for _ in range(30)}
    assert claims(run(lambda s, r: 1.5 if (s, r) in hiccups else 1.0)) == []


def test_moving_random_imbalance_is_not_flagged() -> None:
    # every step a different random rank is 15 % slow
    rng = random.Random(3)
    slow = [rng.randrange(RANKS) for _ in range(120)]
    assert claims(run(lambda s, r: 1.15 if slow[s] == r else 1.0)) == []


def test_whole_job_slowdowns_cancel_out() -> None:
    # checkpoint / data stall: everyone 60 % slower for 15 steps, with per-rank jitter
    rng = random.Random(5)
    jitter = {(s, r): rng.gauss(0, 0.03) for s in range(120) for r in range(RANKS)}
    found = run(lambda s, r: 1.6 + jitter[(s, r)] if 50 <= s < 65 else 1.0)
    assert claims(found) == []


def test_gradual_slowdown_is_caught() -> None:
    found = claims(run(lambda s, r: 1.0 + max(0, s - 30) * 0.002 if r == 9 else 1.0, steps=150))
    assert {f.rank for f in found} == {9}
    assert found[0].ts - T0 < 2.0 * 80  # by the time it is ~10 % slow
    # reported again once it is materially worse (twice the slowdown first reported)
    worse = [f for f in found[1:] if not f.clear]
    assert worse and all(  # both figures are rounded to 0.1
        f.evidence["slowdown_pct"] >= 2 * f.evidence["previous_slowdown_pct"] - 0.1 for f in worse
    )


def test_rank_slow_only_part_of_the_time_is_caught() -> None:
    found = claims(run(lambda s, r: 1.25 if (r == 2 and s >= 30 and s % 2 == 0) else 1.0))
    assert [f.rank for f in found] == [2]


def test_pipeline_stages_are_not_peers_and_imbalance_is_job_info() -> None:
    found = run(lambda s, r: 1.0, stages=2)
    assert claims(found) == []
    info = [f for f in found if f.category == "imbalance"]
    assert len(info) == 1 and info[0].node is None and info[0].severity == "info"


def test_straggler_in_one_stage_is_compared_within_its_stage() -> None:
    found = claims(run(lambda s, r: 1.08 if (r == 12 and s >= 30) else 1.0, stages=2))
    assert [f.rank for f in found] == [12]
    assert found[0].evidence["pp_stage"] == 1


def test_missing_compute_s_gives_no_flag_here() -> None:
    assert run(lambda s, r: None) == []


def test_out_of_order_and_missing_ranks_are_tolerated() -> None:
    rng = random.Random(11)

    def shuffle_and_drop(batch: list[StepTiming]) -> list[StepTiming]:
        kept = [m for m in batch if rng.random() > 0.05]
        rng.shuffle(kept)
        return kept

    found = claims(run(lambda s, r: 1.08 if (r == 4 and s >= 40) else 1.0, order=shuffle_and_drop))
    assert [f.rank for f in found] == [4]


def test_recovered_straggler_is_cleared() -> None:
    found = run(lambda s, r: 1.1 if (r == 5 and 20 <= s < 60) else 1.0)
    assert [(f.rank, f.clear) for f in found] == [(5, False), (5, True)]


def test_ranks_slow_together_on_several_nodes_are_structure_when_stages_are_unknown() -> None:
    # no pp_stage in the telemetry; ranks 8-15 (eight nodes) do 10 % more work every step
    found = run(lambda s, r: 1.1 if r >= 8 else 1.0)
    assert claims(found) == []
    info = [f for f in found if f.category == "imbalance" and not f.clear]
    assert len(info) == 1 and info[0].node is None and info[0].severity == "info"


def test_straggler_inside_an_unlabelled_heavy_group_is_still_claimed() -> None:
    found = claims(
        run(lambda s, r: (1.1 if r >= 8 else 1.0) * (1.08 if (r == 11 and s >= 30) else 1.0))
    )
    assert [f.rank for f in found] == [11]


def test_the_cusum_limits_follow_the_wanted_false_alarm_rate() -> None:
    default = SequentialTest()
    stricter = SequentialTest(false_per_1k_node_hours=0.005)
    shorter = SequentialTest(step_s=1.0)  # twice the rounds per node-hour
    assert (default.threshold, default.rounds) == (3.75, 3)
    assert stricter.rounds > default.rounds  # outliers dominate: more rounds, not a higher bar
    assert (shorter.rounds, shorter.threshold) >= (default.rounds, default.threshold)
    for test in (default, stricter, shorter):
        h, n = test.threshold, test.rounds
        assert test.clip == round(test.k + h / (n - 0.5), 4)
        rounds = 1000 * test.ranks_per_node * 3600 / test.step_s  # per 1,000 node-hours
        assert rounds / cusum_arl(h, test.k, test.clip, test.hiccup_rate) <= (
            test.false_per_1k_node_hours
        )
        # the next lower threshold on the grid would not do
        lower = h - 0.25
        if lower >= 1.0:
            arl = cusum_arl(lower, test.k, test.k + lower / (n - 0.5), test.hiccup_rate)
            assert rounds / arl > test.false_per_1k_node_hours


def test_the_in_control_arl_matches_a_simulation_of_the_cusum() -> None:
    h, k, hiccups = 2.0, 1.0, 0.01
    clip = k + h / 2.5
    rng = np.random.default_rng(4)
    chains = 4000
    s, alive, length = np.zeros(chains), np.ones(chains, bool), np.zeros(chains)
    while alive.any():
        z = np.where(
            rng.random(chains) < hiccups, clip, np.minimum(rng.standard_normal(chains), clip)
        )
        s = np.where(alive, np.maximum(0.0, s + z - k), s)
        length += alive
        alive &= s < h
    simulated = float(length.mean())  # ~1,280 +- 20
    assert abs(cusum_arl(h, k, clip, hiccups) / simulated - 1.0) < 0.1


def test_a_checkpoint_of_the_per_member_trackers_starts_cold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Detectors hold their members in a TrackerTable since checkpoint format 6; one of an
    older Guard (a DeviationTracker per rank) is refused, and its key starts cold."""

    class DeviationTracker(reference_deviation.DeviationTracker):  # as it was pickled
        __slots__ = ()
        __module__ = persistent_deviation.__name__
        __qualname__ = "DeviationTracker"

    monkeypatch.setattr(persistent_deviation, "DeviationTracker", DeviationTracker, raising=False)
    rule = PersistenceRule(sequential=SequentialTest())
    tracker = DeviationTracker()
    for i in range(20):
        tracker.update(0.0, 0.004, 0.01, rule, float(i))
    old = {"peer_straggler": {"trackers": {3: tracker}}}
    secret = b"k" * 32
    sealed = checkpoints.seal(secret, "job-a", old)
    monkeypatch.undo()  # this Guard, which has no DeviationTracker
    assert CHECKPOINT_FORMAT != b"guard-state-5:"
    with pytest.raises(checkpoints.CheckpointRefused, match="checkpoint format"):
        checkpoints.unseal(secret, "job-a", b"guard-state-5:" + sealed[len(CHECKPOINT_FORMAT) :])
    with pytest.raises(checkpoints.CheckpointRefused, match="cannot be read"):
        checkpoints.unseal(secret, "job-a", sealed)  # the old shape under the new format


def test_a_checkpointed_detector_goes_on_as_if_never_stopped() -> None:
    def timings(step: int) -> list[StepTiming]:
        return [
            StepTiming(
                ts=T0 + 2.0 * step,
                node=f"n{rank}",
                job="job",
                rank=rank,
                step=step,
                step_s=2.2,
                compute_s=1.5
                * (1.1 if rank == 5 and step >= 30 else 1.0)
                * (1.0 + 0.003 * (rank % 3) + 0.002 * ((step * 7 + rank) % 5)),
            )
            for rank in range(RANKS)
        ]

    kept = PeerStragglerDetector("job")
    found = [f for step in range(25) for m in timings(step) for f in kept.update(m)]
    secret = b"k" * 32
    blob = checkpoints.seal(secret, "job", kept)
    restored = checkpoints.unseal(secret, "job", blob)
    assert isinstance(restored, PeerStragglerDetector)
    after = [
        [f for m in timings(step) for f in det.update(m)]
        for det in (kept, restored)
        for step in range(25, 60)
    ]
    assert after[:35] == after[35:] and any(after[:35]) and not found


def test_a_rule_checkpointed_before_the_sequential_test_restores_without_it() -> None:
    # what unpickling does with the field list an older Guard wrote (no ``sequential``)
    old_state = PersistenceRule().__getstate__()[:-1]  # type: ignore[attr-defined]
    restored = PersistenceRule.__new__(PersistenceRule)
    restored.__setstate__(old_state)
    assert restored == PersistenceRule() and restored.sequential is None
    now = PersistenceRule(sequential=SequentialTest())
    assert pickle.loads(pickle.dumps(now)) == now  # a current checkpoint keeps its test

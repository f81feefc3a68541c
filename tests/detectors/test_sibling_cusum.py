"""The CUSUM of a GPU's power and clock deficits against its siblings (issue 26)."""

from __future__ import annotations

import numpy as np

from guard.detectors.engine import NodeDetectors
from guard.detectors.findings import Finding
from guard.detectors.gpu_round import GpuColumns
from guard.detectors.gpu_step import update_gpus
from guard.detectors.sibling_cusum import ROUND_TEST, sibling_z, step_cusums
from guard.schemas import GpuSample

GPUS = 8


def _round(
    t: float, power: dict[int, float] | None = None, clock: dict[int, float] | None = None
) -> list[GpuSample]:
    """One sampling round of a loaded node: 650 W, 1980 MHz, unless given per GPU."""
    power, clock = power or {}, clock or {}
    return [
        GpuSample(
            ts=t + 0.01 * g,
            node="n1",
            job="job",
            gpu=g,
            util_pct=98,
            sm_clock_mhz=clock.get(g, 1980.0),
            power_w=power.get(g, 650.0 + 3.0 * (g % 3)),
            power_limit_w=700.0,
        )
        for g in range(GPUS)
    ]


def _run(rounds: list[list[GpuSample]]) -> list[Finding]:
    node = NodeDetectors("n1")
    found: list[Finding] = []
    for samples in rounds:
        for s in samples:
            found += node.update(s)
    return found + node.flush()


def test_a_steady_5_pct_power_deficit_is_claimed_within_its_rounds() -> None:
    """5 % less power, its clock 5 % down (both under the hold rules' 25 % and 10 % bars)."""
    rounds = [_round(t, {4: 0.95 * 651.0}, {4: 0.95 * 1980}) for t in range(12)]
    claims = [f for f in _run(rounds) if f.category == "power" and not f.clear]
    assert [(f.gpu, f.evidence["raised_by"]) for f in claims] == [(4, "cusum")]
    [claim] = claims
    assert claim.severity == "warning" and claim.evidence["impact"] == "sm_clock_deficit"
    # claimed within the fewest rounds the rate allows, or one more (not a hold's 2 of 3)
    assert ROUND_TEST.rounds <= claim.evidence["steps"] <= ROUND_TEST.rounds + 1
    assert claim.ts - claim.since <= ROUND_TEST.rounds + 1
    assert claim.evidence["cusum"] >= claim.evidence["threshold"] == ROUND_TEST.threshold
    assert 4.5 <= claim.evidence["excess_pct"] <= 5.5


def test_a_5_pct_clock_deficit_is_claimed_and_one_hiccup_is_not() -> None:
    steady = [_round(t, clock={2: 1880.0}) for t in range(8)]
    steady += [_round(t) for t in range(8, 30)]  # then it recovers: drained, cleared
    found = [(f.gpu, f.category, f.evidence["raised_by"], f.clear) for f in _run(steady)]
    assert found == [(2, "clock", "cusum", False), (2, "clock", "cusum", True)]
    # one round 30 % down on power and 9 % on clock (under the hold's 10 %), then healthy
    hiccup = [_round(t) for t in range(20)]
    hiccup[5] = _round(5, {6: 450.0}, {6: 1800.0})
    assert _run(hiccup) == []


def test_a_gpu_that_touches_its_power_limit_now_and_then_is_not_claimed() -> None:
    """Healthy loaded GPUs touch their limit (sw power cap 0x4) at a few per cent lower clock."""
    rng = np.random.default_rng(3)
    rounds = []
    for t in range(600):
        samples = _round(float(t))
        for g in np.flatnonzero(rng.random(GPUS) < 0.05).tolist():
            samples[g] = samples[g].model_copy(
                update={"clock_event_reasons": 0x4, "sm_clock_mhz": 1905.0, "power_w": 620.0}
            )
        rounds.append(samples)
    assert _run(rounds) == []


def test_a_healthy_gpu_drawing_less_at_full_clock_is_not_claimed() -> None:
    """Silicon differs: 8 % less power at the same clock and load costs no speed."""
    assert _run([_round(t, {1: 600.0}) for t in range(60)]) == []


def test_the_cusum_claims_alike_whatever_the_step_size() -> None:
    rounds = [_round(t, clock={5: 1880.0}) for t in range(10)]
    flat = [s for r in rounds for s in r]

    def by_steps(size: int) -> list[tuple[float, float, int]]:
        node = NodeDetectors("n1")
        node.anomaly = None
        found = []
        for i in range(0, len(flat), size):
            step = flat[i : i + size]
            cols = GpuColumns.of_samples(step)
            found += update_gpus([node], np.zeros(len(step), dtype=np.intp), cols)
        return [(f.ts, f.since, f.evidence["steps"]) for f in found + node.flush()]

    assert by_steps(1) == by_steps(7) == by_steps(len(flat))


def test_step_cusums_keeps_s_where_a_round_is_not_judged_and_drains_when_healthy() -> None:
    state = np.zeros((1, 4))
    d = np.array([0.05])
    deficits = np.array([[0.05, 0.0, 0.0, 0.01]])
    z = sibling_z(deficits, np.ones((1, 4), dtype=bool), 0.02, ROUND_TEST.k)[0]
    assert z[0] == 0.05 / (0.02 / ROUND_TEST.k)  # the spread's floor
    step_cusums(state, z[:1], d, np.array([0.0]), ROUND_TEST)
    s = state[0, 0]
    step_cusums(state, np.array([np.nan]), d, np.array([1.0]), ROUND_TEST)
    assert state[0, 0] == s and state[0, 1] == 1
    step_cusums(state, np.array([0.0]), np.array([0.0]), np.array([2.0]), ROUND_TEST)
    assert state[0].tolist() == [0.0, 0.0, 0.0, 0.0]

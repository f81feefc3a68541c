"""Real data: Alibaba PAI mini-batch times (stragglers) and NAB machine temperature."""

from __future__ import annotations

from pathlib import Path

from guard.detectors.core import MessageFeed
from guard.detectors.signal_anomaly import SignalAnomalyDetector
from guard.evaluation.public_data import (
    PAI_EPOCH,
    nab_score,
    nab_series,
    nab_windows,
    pai_step_timings,
)

DATA = Path(__file__).resolve().parent.parent / "data"


def pai_claims(job: int) -> list[tuple[str, float]]:
    engine = MessageFeed()
    flags = []
    for msg in pai_step_timings(DATA / "alibaba-pai" / f"job_{job}_norm.csv", f"pai-{job}"):
        flags += engine.update(msg)
    flags += engine.flush()
    return [(str(f.node), f.ts - PAI_EPOCH) for f in flags if f.severity != "info"]


def test_pai_job_1_worker_6_is_flagged_in_its_slow_period_and_workers_3_to_9_never_else() -> None:
    claims = pai_claims(1)
    assert "worker-6" in {n for n, _ in claims}
    for node, t in claims:
        worker = int(node.split("-")[1])
        if worker >= 3:
            assert worker == 6 and 1811 <= t <= 1941 + 60, (node, t)


def test_pai_job_3_workers_0_and_1_are_flagged_and_no_other() -> None:
    assert {n for n, _ in pai_claims(3)} == {"worker-0", "worker-1"}


def test_nab_machine_temperature_alarms_fall_in_the_labelled_windows() -> None:
    series = nab_series(DATA / "nab" / "machine_temperature_system_failure.csv")
    windows = nab_windows(
        DATA / "nab" / "combined_windows.json",
        "realKnownCause/machine_temperature_system_failure.csv",
    )
    det = SignalAnomalyDetector()
    alarms = [ts for ts, value in series if det.update(ts, value, metric="temp") is not None]
    score = nab_score(alarms, windows)
    assert score["windows_hit"] == 4
    assert score["inside"] >= 4
    assert score["nab_score"] > 50

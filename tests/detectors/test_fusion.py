"""Fusion: new independent evidence re-flags a suspect node; claims list who agrees."""

from __future__ import annotations

from guard.detectors.findings import Finding
from guard.detectors.fusion import NodeFusion


def straggler(gpu: int, ts: float, score: float, detector: str = "peer_straggler") -> Finding:
    return Finding(
        detector,
        "straggler",
        "warning",
        "n1",
        ts,
        ts - 20.0,
        score,
        gpu=gpu,
        evidence={"slowdown_pct": 100 * score},
    )


def test_second_fault_on_another_gpu_of_a_suspect_node_is_a_new_flag() -> None:
    fusion = NodeFusion("n1")
    assert fusion.update(straggler(2, 100.0, 0.06)) is not None
    assert fusion.update(straggler(2, 110.0, 0.06)) is None  # the same finding again
    second = fusion.update(straggler(5, 300.0, 0.08))
    assert second is not None and second.gpu == 5


def test_materially_worse_slowdown_on_the_same_gpu_is_a_new_flag_a_little_worse_is_not() -> None:
    fusion = NodeFusion("n1")
    assert fusion.update(straggler(2, 100.0, 0.06)) is not None
    assert fusion.update(straggler(2, 200.0, 0.07)) is None
    worse = fusion.update(straggler(2, 300.0, 0.15))
    assert worse is not None and worse.score == 0.15


def test_lower_priority_finding_on_a_flagged_gpu_is_explained_not_reflagged() -> None:
    fusion = NodeFusion("n1")
    hot = Finding("thermal", "thermal", "warning", "n1", 100.0, 90.0, 1.2, gpu=4)
    assert fusion.update(hot) is not None
    assert fusion.update(straggler(4, 105.0, 0.1)) is None
    # a node-wide finding is explained by the suspicion already flagged
    node_wide = Finding("c4d", "comm_slow", "warning", "n1", 106.0, 95.0, 0.3)
    assert fusion.update(node_wide) is None


def test_claim_lists_every_agreeing_detector_info_observations_included() -> None:
    fusion = NodeFusion("n1")
    river = Finding("peer_anomaly", "anomaly", "info", "n1", 90.0, 80.0, 0.9, gpu=3)
    warm = Finding("thermal", "thermal", "info", "n1", 91.0, 85.0, 1.1, gpu=3)
    elsewhere = Finding("thermal", "thermal", "info", "n1", 91.0, 85.0, 1.1, gpu=6)
    for f in (river, warm, elsewhere):
        assert fusion.update(f) is not None  # each info observation is shown once
    flag = fusion.update(straggler(3, 100.0, 0.07, detector="c4d"))
    assert flag is not None and flag.severity == "warning"
    assert flag.evidence["agree"] == ["c4d", "peer_anomaly", "thermal"]


def test_suspicion_ends_when_its_claims_are_withdrawn_and_info_does_not_hold_it() -> None:
    fusion = NodeFusion("n1")
    warm = Finding("thermal", "thermal", "info", "n1", 91.0, 85.0, 1.1, gpu=3)
    claim = straggler(3, 100.0, 0.07)
    fusion.update(warm)
    fusion.update(claim)
    withdrawn = straggler(3, 200.0, 0.07)
    withdrawn.clear = True
    assert fusion.update(withdrawn) is None
    again = fusion.update(straggler(3, 400.0, 0.07))
    assert again is not None  # a fresh suspicion after the first ended

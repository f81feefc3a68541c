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


def _claims_in_core(order: str, node_telemetry: bool = True) -> list[tuple[str, str]]:
    """A job partition ahead of the node's: the straggler finding on n1's GPU 4 (made at
    t=105) reaches fusion while n1's own stream is at t=100, and n1's thermal finding on the
    same GPU (t=104) comes after it (``order`` "job-first") or before it ("node-first")."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.schemas import GpuSample, encode

    def gpu_records(ts: float) -> list[tuple[int, str, bytes]]:
        if not node_telemetry:
            return []
        return [(0, "gpu", encode(GpuSample(ts=ts, node="n1", gpu=g))) for g in range(8)]

    hot = Finding("thermal", "thermal", "warning", "n1", 104.0, 90.0, 1.2, gpu=4)
    slow = straggler(4, 105.0, 0.1)
    first, second = (slow, hot) if order == "job-first" else (hot, slow)
    core = DetectionCore()
    flags = core.step(gpu_records(100.0), (), wall=100.0).flags
    flags += core.step((), encode_findings([first]), wall=100.5).flags
    flags += core.step(gpu_records(101.0), encode_findings([second]), wall=101.0).flags
    for t in range(102, 108):  # the node's stream catches up
        flags += core.step(gpu_records(float(t)), (), wall=float(t)).flags
    return [(f.node, f.category) for f in flags if f.severity != "info"]  # type: ignore[misc]


def test_which_partition_is_consumed_first_does_not_decide_a_nodes_claims() -> None:
    """A straggler the node's own thermal finding explains is folded into it whether the job
    partition or the node partition is ahead: the job finding waits for the node's stream."""
    assert _claims_in_core("node-first") == [("n1", "thermal")]
    assert _claims_in_core("job-first") == [("n1", "thermal")]


def test_a_job_finding_does_not_wait_for_a_node_without_telemetry_here() -> None:
    """No node stream for n1 on this worker (or it stopped): the finding is fused at once,
    or after WAIT_S of the runner's clock."""
    assert _claims_in_core("job-first", node_telemetry=False)[0] == ("n1", "straggler")
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.detectors.fusion import WAIT_S
    from guard.schemas import GpuSample, encode

    core = DetectionCore()
    core.step([(0, "gpu", encode(GpuSample(ts=100.0, node="n1", gpu=0)))], (), wall=0.0)
    assert core.step((), encode_findings([straggler(4, 105.0, 0.1)]), wall=1.0).flags == []
    assert core.step((), (), wall=1.0 + WAIT_S / 2).flags == []
    late = core.step((), (), wall=1.0 + WAIT_S).flags
    assert [(f.node, f.category) for f in late] == [("n1", "straggler")]


def test_a_rule_s_hold_claim_clearing_leaves_its_cusum_claim_on_the_same_gpu_standing() -> None:
    """A GPU rule's CUSUM and its hold may both claim one GPU (the CUSUM first, the hold
    later); each clears its own: the node stays under suspicion until both have."""
    fusion = NodeFusion("n1")

    def power(ts: float, by: str | None, clear: bool = False) -> Finding:
        evidence = {"raised_by": by} if by else {}
        return Finding(
            "power", "power", "warning", "n1", ts, 10.0, 0.05, gpu=3, evidence=evidence, clear=clear
        )

    assert fusion.update(power(100.0, "cusum")) is not None
    assert fusion.update(power(130.0, None)) is None  # the same cause, explained
    fusion.update(power(200.0, None, clear=True))
    assert fusion.level > 0 and len(fusion.active) == 1  # the CUSUM's claim still stands
    fusion.update(power(260.0, "cusum", clear=True))
    assert fusion.level == -1 and not fusion.active

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


def test_a_job_finding_waits_for_a_node_stream_that_lags_but_not_past_wait_max_s() -> None:
    """A node stream that still advances but lags (a worker behind a flood of dead letters)
    is waited for beyond WAIT_S: the thermal finding that explains the straggler arrives
    20 s of the runner's clock later and the node is claimed once, thermal, as a backtest
    claims it. One that never catches up lets the finding through after WAIT_MAX_S."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.detectors.fusion import WAIT_MAX_S, WAIT_S
    from guard.schemas import GpuSample, encode

    def gpu_records(ts: float) -> list[tuple[int, str, bytes]]:
        return [(0, "gpu", encode(GpuSample(ts=ts, node="n1", gpu=g))) for g in range(8)]

    def claims(flags: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
        return [(f.node, f.category) for f in flags if f.severity != "info"]

    core = DetectionCore()
    core.step(gpu_records(60.0), (), wall=0.0)
    flags = core.step((), encode_findings([straggler(4, 105.0, 0.1)]), wall=0.5).flags
    for k in range(1, 21):  # a second of the node's event time per second of the runner's
        flags += core.step(gpu_records(60.0 + k), (), wall=0.5 + k).flags
    assert WAIT_S < 20 and claims(flags) == []  # still waiting: the node's stream moves
    hot = Finding("thermal", "thermal", "warning", "n1", 82.0, 70.0, 1.2, gpu=4)
    flags += core.step(gpu_records(81.0), encode_findings([hot]), wall=21.0).flags
    for k in range(82, 106):  # the node's stream catches up, fast
        flags += core.step(gpu_records(float(k)), (), wall=21.0 + (k - 81) / 10).flags
    assert claims(flags) == [("n1", "thermal")]

    core = DetectionCore()
    core.step(gpu_records(1000.0), (), wall=0.0)
    flags = core.step((), encode_findings([straggler(4, 1105.0, 0.1)]), wall=0.0).flags
    wall = 0.0
    while wall < WAIT_MAX_S - 1:  # advancing, never reaching t=1105
        wall += 1.0
        flags += core.step(gpu_records(1000.0 + wall), (), wall=wall).flags
    assert claims(flags) == []
    flags += core.step(gpu_records(1001.0 + wall), (), wall=WAIT_MAX_S).flags
    assert claims(flags) == [("n1", "straggler")]


def test_a_nic_partition_ahead_of_the_gpu_one_does_not_let_a_straggler_through() -> None:
    """A node's GPU and NIC records are on topics of their own, consumed at their own paces:
    its NIC records at t=110 are not its GPU stream at t=110. The straggler at t=105 waits
    for the GPU records too, and the thermal finding they bring explains it (the chaos
    `hostile` scenario claimed node-002 straggler beside thermal this way)."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.schemas import GpuSample, NicSample, encode

    def gpu_records(ts: float) -> list[tuple[int, str, bytes]]:
        return [(0, "gpu", encode(GpuSample(ts=ts, node="n1", gpu=g))) for g in range(8)]

    def nic_record(ts: float) -> list[tuple[int, str, bytes]]:
        return [(1, "nic", encode(NicSample(ts=ts, node="n1", device="mlx5_0", port=1)))]

    core = DetectionCore()
    flags = core.step(gpu_records(100.0) + nic_record(100.0), (), wall=0.0).flags
    flags += core.step(nic_record(110.0), encode_findings([straggler(4, 105.0, 0.1)]), 0.5).flags
    flags += core.step(nic_record(111.0), (), wall=1.0).flags
    hot = Finding("thermal", "thermal", "warning", "n1", 104.0, 90.0, 1.2, gpu=4)
    flags += core.step(gpu_records(101.0), encode_findings([hot]), wall=1.5).flags
    for t in range(102, 107):  # the GPU stream catches up
        flags += core.step(gpu_records(float(t)), (), wall=2.0 + (t - 102) / 10).flags
    assert [(f.node, f.category) for f in flags if f.severity != "info"] == [("n1", "thermal")]


def test_a_straggler_does_not_overtake_the_node_s_findings_still_on_the_findings_topic() -> None:
    """The node's stream has passed the straggler's time, but the thermal findings its GPU
    records made are still on their way through the findings topic (a live worker's round
    trip): the straggler waits for them, and the node is claimed once, thermal."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.schemas import GpuSample, encode

    def gpu_records(ts: float) -> list[tuple[int, str, bytes]]:
        return [
            (
                0,
                "gpu",
                encode(
                    GpuSample(
                        ts=ts,
                        node="n1",
                        gpu=g,
                        temp_c=95.0 if g == 4 else 60.0,
                        temp_slowdown_c=87.0,
                        sm_clock_mhz=1500.0 if g == 4 else 1980.0,
                        sm_clock_max_mhz=1980.0,
                        util_pct=100.0,
                        clock_event_reasons=0x20 if g == 4 else 0,  # HW thermal slowdown
                    )
                ),
            )
            for g in range(8)
        ]

    core = DetectionCore()
    in_flight = []
    for t in (100.0, 101.0, 102.0):
        in_flight += core.step(gpu_records(t), (), wall=t).findings
    assert any(f.category == "thermal" and f.severity == "warning" for f in in_flight)
    slow = straggler(4, 101.5, 0.1)
    flags = core.step((), encode_findings([slow]), wall=102.5).flags
    flags += core.step((), (), wall=103.0).flags
    assert flags == []  # n1's stream is at t=102, but its findings are not fused yet
    flags += core.step((), encode_findings(in_flight), wall=103.5).flags
    assert [(f.node, f.category) for f in flags if f.severity != "info"] == [("n1", "thermal")]


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


def test_a_node_stream_behind_unread_records_is_waited_for_past_wait_max_s() -> None:
    """A live worker chewing through a flood of dead letters on a node's GPU partition reads
    no new event time for the node for longer than WAIT_S and WAIT_MAX_S (the chaos
    `hostile` scenario at 1M messages: ~50 s). Its read offsets tell that stream *behind*
    (records on the broker, unread, since the straggler came) from *quiet*: the straggler
    waits until the partition is read up to where it stood, and the thermal finding those
    records bring explains it. Once read through, a stream that stays short of the
    finding's time is quiet, and the finding goes WAIT_S later."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.detectors.fusion import WAIT_MAX_S, WAIT_S
    from guard.schemas import GpuSample, encode

    def gpu_records(ts: float) -> list[tuple[int, str, bytes]]:
        return [(0, "gpu", encode(GpuSample(ts=ts, node="n1", gpu=g))) for g in range(8)]

    def claims(flags: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
        return [(f.node, f.category) for f in flags if f.severity != "info"]

    def read(position: int) -> dict[tuple[str, int], tuple[int, int]]:
        return {("gpu", 0): (position, 100_000)}  # the partition ends at offset 100,000

    core = DetectionCore()
    core.step(gpu_records(60.0), (), wall=0.0, reads=read(10))
    flags = core.step((), encode_findings([straggler(4, 105.0, 0.1)]), wall=0.5).flags
    wall = 0.5
    while wall < 3 * WAIT_MAX_S:  # dead letters only: the node's time stands at t=60
        wall += 1.0
        flags += core.step((), (), wall=wall, reads=read(int(wall * 900))).flags
    assert claims(flags) == []
    hot = Finding("thermal", "thermal", "warning", "n1", 82.0, 70.0, 1.2, gpu=4)
    flags += core.step(
        gpu_records(81.0), encode_findings([hot]), wall=wall, reads=read(99_000)
    ).flags
    flags += core.step(gpu_records(106.0), (), wall=wall + 0.1, reads=read(100_000)).flags
    assert claims(flags) == [("n1", "thermal")]

    core = DetectionCore()
    core.step(gpu_records(60.0), (), wall=0.0, reads=read(10))
    flags = core.step((), encode_findings([straggler(4, 105.0, 0.1)]), wall=0.5).flags
    flags += core.step(gpu_records(70.0), (), wall=3 * WAIT_MAX_S, reads=read(100_000)).flags
    assert claims(flags) == []  # read through just now: not at once, though long past
    flags += core.step((), (), wall=3 * WAIT_MAX_S + WAIT_S / 2).flags
    assert claims(flags) == []
    flags += core.step((), (), wall=3 * WAIT_MAX_S + WAIT_S).flags
    assert claims(flags) == [("n1", "straggler")]


def test_a_straggler_rank_whose_gpu_is_not_known_is_explained_by_a_flagged_gpu() -> None:
    """C4D names a late rank's GPU from the job's steps. Read after the collectives (a
    steps partition behind a flood of dead letters: the chaos `hostile` scenario at 1M
    messages), the rank's GPU is not known yet, and the finding is about ``rank21``. On a
    node already flagged hot on one GPU that is no new component: it is explained, as a
    backtest (steps read first, GPU known) explains it. A rank on a GPU known to be another
    one is still news, and so is a rank of a job whose steps name no GPU (read, and still
    unplaced): a second fault there is not absorbed by the first."""
    fusion = NodeFusion("n1")
    hot = Finding("thermal", "thermal", "warning", "n1", 100.0, 90.0, 1.2, gpu=5)
    assert fusion.update(hot) is not None
    unread = {"unplaced": "no step read yet"}
    late = Finding("c4d", "straggler", "warning", "n1", 110.0, 100.0, 0.3, rank=21, evidence=unread)
    assert fusion.update(late) is None
    placed = Finding("c4d", "straggler", "warning", "n1", 120.0, 100.0, 0.3, gpu=2, rank=17)
    assert fusion.update(placed) is not None
    alone = NodeFusion("n1")
    assert alone.update(late) is not None  # nothing flagged to explain it
    no_gpus = NodeFusion("n1")
    assert no_gpus.update(hot) is not None
    gpuless = Finding("c4d", "straggler", "warning", "n1", 110.0, 100.0, 0.3, rank=21)
    assert no_gpus.update(gpuless) is not None  # its steps were read: rank21 is its own


def test_c4d_marks_a_rank_unplaced_only_while_none_of_its_steps_was_read() -> None:
    """The mark fusion reads: C4D's late rank before any of its steps (no GPU, no stage
    known) carries ``unplaced``; after steps that name no GPU, it does not."""
    from guard.detectors.collective import CollectiveHomogeneityDetector
    from guard.schemas import CollectiveTiming, StepTiming

    def late_rank(steps: bool) -> list[Finding]:
        c4d = CollectiveHomogeneityDetector("job")
        found: list[Finding] = []
        for seq in range(60):
            t = 1000.0 + seq
            for rank in range(8):
                node = f"n{rank // 4}"
                if steps:
                    c4d.observe(
                        StepTiming(ts=t, node=node, job="job", rank=rank, step=seq, step_s=1.0)
                    )
                arrive = (
                    t - 0.5 + (0.3 if rank == 5 and seq >= 20 else 0.001 * ((seq * 7 + rank) % 5))
                )
                op = CollectiveTiming(
                    ts=t, node=node, job="job", rank=rank, comm="dp", op="allreduce",
                    seq=seq, bytes=1e8, arrive_ts=arrive, end_ts=t,
                )  # fmt: skip
                found += c4d.update(op)
        return [f for f in found if f.rank == 5 and not f.clear]

    before, after = late_rank(steps=False), late_rank(steps=True)
    assert before and all(f.evidence["unplaced"] == "no step read yet" for f in before)
    assert after and all("unplaced" not in f.evidence and f.gpu is None for f in after)


def test_findings_of_a_node_are_fused_in_event_time_order_behind_a_waiting_one() -> None:
    """A straggler waits for its node's stream; the node's thermal findings of later times
    that come meanwhile queue behind it, so fusion sees them in event-time order as a
    backtest does, and not the straggler last."""
    fusion = NodeFusion("n1")
    assert fusion.wait(straggler(5, 105.0, 0.1), 100.0, wall=0.0)
    later = Finding("thermal", "thermal", "warning", "n1", 110.0, 100.0, 1.2, gpu=5)
    assert fusion.wait(later, 100.0, wall=0.1)  # queued: an earlier finding waits
    earlier = Finding("thermal", "thermal", "info", "n1", 90.0, 80.0, 0.5, gpu=5)
    assert not fusion.wait(earlier, 100.0, wall=0.2)  # before the waiting one: at once
    flags = fusion.release(120.0, 0.2, 0.3)
    assert [(f.category, f.ts) for f in flags] == [("straggler", 105.0), ("thermal", 110.0)]
    assert fusion.waiting == []


def test_a_node_with_no_telemetry_read_yet_behind_unread_records_is_waited_for() -> None:
    """A worker that starts on a backlog may read a job's records (and its straggler
    findings) before any GPU record of the node they are about. A node with no telemetry
    here is fused at once, as absent, unless its partitions hold records unread (the
    worker's read offsets, from where they start when assigned): then it is behind, and the
    straggler waits for them; the thermal finding they bring explains it."""
    from guard.detectors.core import DetectionCore, encode_findings
    from guard.schemas import GpuSample, encode

    def claims(flags: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
        return [(f.node, f.category) for f in flags if f.severity != "info"]

    core = DetectionCore()
    start = {("gpu", 0): (0, 5_000)}  # assigned: 5,000 records to read, none read yet
    out = core.step((), encode_findings([straggler(4, 105.0, 0.1)]), wall=0.0, reads=start)
    flags = out.flags
    for k in range(1, 40):  # the GPU partition read, slowly: no release on the 5 s or 30 s
        flags += core.step((), (), wall=float(k), reads={("gpu", 0): (k * 100, 5_000)}).flags
    assert claims(flags) == []
    hot = Finding("thermal", "thermal", "warning", "n1", 100.0, 90.0, 1.2, gpu=4)
    gpu = [(0, "gpu", encode(GpuSample(ts=110.0, node="n1", gpu=g))) for g in range(8)]
    flags += core.step(
        gpu, encode_findings([hot]), wall=40.0, reads={("gpu", 0): (5_000, 5_000)}
    ).flags
    assert claims(flags) == [("n1", "thermal")]

"""C4D collective homogeneity on hand-built collectives: late ranks, slow links, hangs."""

from __future__ import annotations

import random
from collections.abc import Callable

from guard.detectors.collective import CollectiveHomogeneityDetector
from guard.detectors.findings import Finding
from guard.schemas import CollectiveTiming, ConnectionStat, StepTiming

RANKS = 16
T0 = 1_767_225_600.0
BYTES = 1 << 28


def node_of(rank: int) -> str:
    return f"n{rank // 4}"  # 4 ranks per node, 4 nodes


def _op(
    rank: int,
    seq: int,
    ts: float,
    arrive_ts: float,
    end_ts: float | None,
    peers: list[ConnectionStat] | None = None,
) -> CollectiveTiming:
    """One rank's report of the job's data-parallel allreduce number ``seq``."""
    return CollectiveTiming(
        ts=ts,
        node=node_of(rank),
        job="job",
        rank=rank,
        comm="dp",
        op="allreduce",
        seq=seq,
        bytes=BYTES,
        arrive_ts=arrive_ts,
        end_ts=end_ts,
        peers=peers,
    )


def run(
    late: Callable[[int, int], float] = lambda seq, rank: 0.0,
    link: Callable[[int, int, int], float] = lambda seq, a, b: 1.0,
    seqs: int = 80,
    skew: dict[int, float] | None = None,
    seed: int = 1,
    stages: dict[int, int] | None = None,
    step_s: float = 2.0,
    compute_s: float = 1.0,
    clock: dict[str, float] | Callable[[int, str], float] | None = None,
) -> list[Finding]:
    """``seqs`` data-parallel all-reduces, one a step of ``step_s``; each rank arrives after
    ``compute_s`` (plus jitter, ``late`` and ``skew``); ``clock``: host (or ``(seq, host)``) -> its
    clock's offset, on every timestamp its ranks write."""
    rng = random.Random(seed)
    det = CollectiveHomogeneityDetector("job")
    for rank, stage in (stages or {}).items():  # what the job's step telemetry says
        det.observe(
            StepTiming(
                ts=T0, node=node_of(rank), job="job", rank=rank, step=0, step_s=2.0, pp_stage=stage
            )
        )
    found: list[Finding] = []
    for seq in range(seqs):
        t0 = T0 + step_s * seq
        end = t0 + compute_s + 0.3 * step_s
        for rank in range(RANKS):
            off = (
                clock(seq, node_of(rank))
                if callable(clock)
                else (clock or {}).get(node_of(rank), 0.0)
            )
            nxt, prv = (rank + 1) % RANKS, (rank - 1) % RANKS
            peers = [
                ConnectionStat(
                    rank=nxt,
                    bytes=BYTES,
                    duration_s=0.4 * link(seq, rank, nxt) * (1 + 0.01 * rng.gauss(0, 1)),
                ),
                ConnectionStat(
                    rank=prv,
                    bytes=BYTES,
                    duration_s=0.4 * link(seq, prv, rank) * (1 + 0.01 * rng.gauss(0, 1)),
                ),
            ]
            arrive = (
                t0
                + compute_s
                + 0.0025 * step_s * rng.gauss(0, 1)
                + late(seq, rank)
                + (skew or {}).get(rank, 0)
            )
            found += det.update(
                _op(rank, seq, end + off, arrive_ts=arrive + off, end_ts=end + off, peers=peers)
            )
    return found + det.flush()


def claims(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.severity != "info" and not f.clear]


def test_healthy_collectives_give_no_flag() -> None:
    for seed in range(4):
        assert claims(run(seed=seed)) == []


def test_rank_that_persistently_arrives_last_is_a_straggler() -> None:
    found = claims(run(late=lambda s, r: 0.08 if (r == 6 and s >= 30) else 0.0))
    assert [(f.category, f.rank, f.node) for f in found] == [("straggler", 6, "n1")]
    assert found[0].evidence["metric"] == "arrival_lateness"


def test_small_clock_skew_is_not_a_straggler() -> None:
    assert claims(run(skew={3: 0.015, 9: -0.012})) == []


# A 5 s step (3.6 s of compute): a 5 % slower GPU arrives 0.18 s late at every all-reduce,
# while a host whose clock is 0.4 s ahead writes every time 0.4 s late.
FLEET = {"step_s": 5.0, "compute_s": 3.6, "seqs": 60}


def straggler_5pct(seq: int, rank: int) -> float:
    return 0.05 * 3.6 if (rank == 6 and seq >= 20) else 0.0


def test_a_host_clock_off_by_400ms_is_not_a_straggler() -> None:
    for clock in ({"n1": 0.4}, {"n1": -0.4}, {"n0": 0.31, "n1": -0.45, "n2": 0.12, "n3": 0.49}):
        assert claims(run(clock=clock, **FLEET)) == [], clock  # type: ignore[arg-type]


def test_a_host_clock_stepped_by_ntp_is_not_a_straggler() -> None:
    # n2's clock drifts 5 ms a step, then NTP steps it back by 0.35 s, then it drifts again
    def clock(seq: int, host: str) -> float:
        return 0.005 * (seq % 35) + (0.2 if seq < 35 else -0.15) if host == "n2" else 0.0

    assert claims(run(clock=clock, **FLEET)) == []  # type: ignore[arg-type]


def test_a_5_percent_straggler_is_claimed_on_host_clocks() -> None:
    quiet = claims(run(late=straggler_5pct, **FLEET))  # type: ignore[arg-type]
    assert [(f.category, f.rank, f.node) for f in quiet] == [("straggler", 6, "n1")]
    assert quiet[0].evidence["host_offset_s"] == 0.0


def test_a_5_percent_straggler_on_a_host_whose_clock_is_off_is_still_claimed() -> None:
    for clock in ({"n1": 0.4}, {"n1": -0.4}, {"n0": 0.31, "n1": -0.45, "n2": 0.12, "n3": 0.49}):
        found = claims(run(late=straggler_5pct, clock=clock, **FLEET))  # type: ignore[arg-type]
        assert [(f.category, f.rank, f.node) for f in found] == [("straggler", 6, "n1")], clock
        # the offset against the op's median rank, which is on a host with its own offset
        ends = sorted(clock.get(f"n{n}", 0.0) for n in range(4))
        expected = clock["n1"] - 0.5 * (ends[1] + ends[2])
        assert abs(found[0].evidence["host_offset_s"] - expected) < 1e-3, clock


def test_random_last_arrivals_are_not_flagged() -> None:
    rng = random.Random(2)
    last = [rng.randrange(RANKS) for _ in range(80)]
    assert claims(run(late=lambda s, r: 0.2 if last[s] == r else 0.0)) == []


def test_node_whose_connections_are_slow_is_comm_slow() -> None:
    slow_node = "n2"

    def link(seq: int, a: int, b: int) -> float:
        return 1.6 if seq >= 20 and slow_node in (node_of(a), node_of(b)) else 1.0

    found = claims(run(link=link))
    assert [(f.category, f.node) for f in found] == [("comm_slow", "n2")]


def test_fabric_wide_slowdown_is_not_a_node_fault() -> None:
    assert claims(run(link=lambda s, a, b: 1.3 if 20 <= s < 60 else 1.0)) == []


def _hang_detector() -> CollectiveHomogeneityDetector:
    det = CollectiveHomogeneityDetector("job", hang_min_s=10.0)
    for seq in range(10):
        t0 = T0 + 2.0 * seq
        for rank in range(8):
            det.update(_op(rank, seq, t0 + 1.5, arrive_ts=t0 + 1.0, end_ts=t0 + 1.5))
    return det


def test_rank_that_never_arrives_is_a_non_communication_hang() -> None:
    det = _hang_detector()
    t0 = T0 + 20.0
    for rank in range(8):
        if rank != 5:  # rank 5 never enters the op; the others wait inside it
            det.update(_op(rank, 10, t0 + 1.0, arrive_ts=t0 + 1.0, end_ts=None))
    assert det.tick(t0 + 5.0) == []  # not yet past the hang limit
    found = det.tick(t0 + 15.0)
    assert [(f.category, f.severity, f.node) for f in found] == [("comm_hang", "critical", "n1")]
    assert found[0].evidence["hang"] == "non_communication"
    assert found[0].evidence["ranks_never_arrived"] == [5]
    assert det.tick(t0 + 30.0) == []  # reported once


def test_a_completed_op_with_missing_telemetry_is_not_a_hang() -> None:
    # An agent restart drops rank 5's reports; the others left the op, so it completed
    # (a collective cannot finish without all its members): no rank is at fault.
    det = _hang_detector()
    t0 = T0 + 20.0
    for rank in range(8):
        if rank != 5:
            det.update(_op(rank, 10, t0 + 1.2, arrive_ts=t0 + 1.0, end_ts=t0 + 1.2))
    assert det.tick(t0 + 15.0) == []
    assert det.tick(t0 + 60.0) == []


def test_all_arrived_but_stuck_inside_is_a_communication_hang_of_the_job() -> None:
    det = _hang_detector()
    t0 = T0 + 20.0
    for rank in range(8):
        det.update(
            CollectiveTiming(
                ts=t0 + 1.0,
                node=node_of(rank),
                job="job",
                rank=rank,
                comm="dp",
                op="allreduce",
                seq=10,
                bytes=BYTES,
                arrive_ts=t0 + 1.0,
                end_ts=None,
            )
        )
    found = det.tick(t0 + 15.0)
    assert [(f.category, f.node) for f in found] == [("comm_hang", None)]
    assert found[0].evidence["ranks_stuck_inside"] == list(range(8))


def heavy_stage(seq: int, rank: int) -> float:
    """A collective spanning two pipeline stages: ranks 8-15 (nodes n2, n3) arrive last."""
    return 0.1 if rank >= 8 else 0.0


def test_heaviest_stage_arriving_last_is_job_imbalance_not_a_claim() -> None:
    for stages in ({r: int(r >= 8) for r in range(RANKS)}, None):  # stage known, unknown
        found = run(late=heavy_stage, stages=stages)
        assert claims(found) == [], stages
        info = [f for f in found if f.category == "imbalance" and not f.clear]
        assert len(info) == 1 and info[0].node is None and info[0].severity == "info"


def test_rank_late_within_its_own_stage_stays_a_claim() -> None:
    def late(seq: int, rank: int) -> float:
        return heavy_stage(seq, rank) + (0.08 if (rank == 13 and seq >= 30) else 0.0)

    for stages in ({r: int(r >= 8) for r in range(RANKS)}, None):
        found = claims(run(late=late, stages=stages))
        assert [(f.category, f.rank, f.node) for f in found] == [("straggler", 13, "n3")], stages

"""The streams workers against the backtest: same detector code, same flags.

Simulator telemetry goes through a real broker into `guard streams` workers; their flags
are compared with `guard backtest`'s over the same messages. Two workers split the
partitions and together give the same flags as one; a worker that is replaced resumes
from its checkpoints instead of a cold start.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.config import Settings
from guard.detectors.core import MessageFeed
from guard.detectors.fusion import PRIORITY
from guard.kafka import create_topics, make_producer, produce
from guard.schemas import Flag, GuardMessage

from .test_faust_app import processed, read_flags, restored, streams_worker, wait_for


def scenario() -> list[GuardMessage]:
    sim = ClusterSimulator(
        SimConfig(
            nodes=8,
            duration_s=240,
            seed=4,
            start_ts=float(int(time.time()) - 600),
            faults=[
                FaultSpec("thermal_throttle", node="node-002", onset_s=40, slowdown=0.15),
                FaultSpec("xid", node="node-005", onset_s=90),
                FaultSpec("degraded_nic", node="node-006", onset_s=120, slowdown=0.3),
            ],
            random_faults=0,
        )
    )
    return list(sim.messages())


def backtest_claims(messages: list[GuardMessage]) -> set[tuple[str, str]]:
    engine = MessageFeed()
    flags = [f for m in messages for f in engine.update(m)]
    return {(f.node, f.category) for f in flags if f.severity != "info" and f.node}


def assert_same_claims(got: set[tuple[str, str]], expected: set[tuple[str, str]]) -> None:
    """The workers claim what the backtest claims. One more claim on a node is allowed only
    when it is the same suspicion flagged before its explanation arrived: the job stream
    (stragglers) and the node stream (thermal) are consumed at their own paces, so fusion
    may see the straggler finding first and flag it, then the thermal one; the backtest,
    in event-time order, saw the thermal finding first and folded the straggler into it.
    """
    assert expected <= got, f"missing claims: {sorted(expected - got)}"
    for node, category in got - expected:
        explained = [c for n, c in expected if n == node and PRIORITY[c] > PRIORITY[category]]
        assert explained, f"claim ({node}, {category}) is not in the backtest's claims"


def publish(settings: Settings, messages: list[GuardMessage]) -> None:
    producer = make_producer(settings)
    for m in messages:
        produce(producer, settings, m)
    assert producer.flush(60) == 0


def assigned(log: Path) -> set[int]:
    """The partitions the worker holds now, from its latest assignment line."""
    lines = re.findall(r"partitions assigned: ([\d,]+|none)", log.read_text(errors="replace"))
    if not lines or lines[-1] == "none":
        return set()
    return {int(p) for p in lines[-1].split(",")}


@pytest.mark.slow
def test_native_workers_match_backtest_one_or_two_and_resume(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    messages = scenario()
    expected = backtest_claims(messages)
    assert {node for node, _ in expected} == {"node-002", "node-005", "node-006"}
    publish(kafka_settings, messages)

    # one worker
    with streams_worker(kafka_settings, tmp_path / "one.log", "native", "one") as worker:
        wait_for(
            lambda: processed(tmp_path / "one.log") >= len(messages), tmp_path / "one.log", 180
        )
        time.sleep(3)  # findings → fusion → flags
        one = read_flags(kafka_settings, want=10_000, timeout_s=8, worker=worker)
    assert_same_claims(
        {(f.node, f.category) for f in one if f.severity != "info" and f.node}, expected
    )

    # two workers on a fresh topic set: the same flags between them
    two_settings = kafka_settings.model_copy(deep=True)
    two_settings.kafka.topic_prefix = f"t{uuid.uuid4().hex[:10]}."
    create_topics(two_settings)
    logs = [tmp_path / "two-a.log", tmp_path / "two-b.log"]
    with (
        streams_worker(two_settings, logs[0], "native", "two"),
        streams_worker(two_settings, logs[1], "native", "two"),
    ):
        # publish only once the group has settled with both members, or the first worker
        # to join may take every partition and finish before the second arrives
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            held = [assigned(p) for p in logs]
            if all(held) and not held[0] & held[1]:
                break
            time.sleep(0.5)
        assert all(held) and not held[0] & held[1], [p.read_text()[-1000:] for p in logs]
        publish(two_settings, messages)
        deadline = time.monotonic() + 180
        while sum(processed(p) for p in logs) < len(messages) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(processed(p) > 0 for p in logs), "both workers must have had partitions"
        time.sleep(3)
        two = read_flags(two_settings, want=10_000, timeout_s=8)
    assert_same_claims(
        {(f.node, f.category) for f in two if f.severity != "info" and f.node}, expected
    )

    # a replacement worker of the first group resumes its keys from the changelogs
    last = max(m.ts for m in messages)
    more = [m.model_copy(update={"ts": m.ts - messages[0].ts + last + 1}) for m in messages[:2000]]
    with streams_worker(kafka_settings, tmp_path / "again.log", "native", "one"):
        publish(kafka_settings, more)
        wait_for(lambda: restored(tmp_path / "again.log") > 0, tmp_path / "again.log", 60)


def hung_job(start: float, ops: int, hang_at: int) -> list[GuardMessage]:
    """A job of 8 ranks on 8 nodes, one all-reduce every 2 s; at op ``hang_at`` rank 5
    never arrives, the other ranks enter the op and stay inside it, and the job sends
    nothing more (they are stuck)."""
    from guard.schemas import CollectiveTiming

    out: list[GuardMessage] = []
    for seq in range(ops):
        t0 = start + 2.0 * seq
        for rank in range(8):
            if seq == hang_at and rank == 5:
                continue
            ended = seq < hang_at
            out.append(
                CollectiveTiming(
                    ts=t0 + (0.6 if ended else 0.01 * rank),
                    node=f"node-{rank:03d}",
                    job="job-hang",
                    rank=rank,
                    comm="dp",
                    op="allreduce",
                    seq=seq,
                    bytes=1 << 24,
                    arrive_ts=t0 + 0.001 * rank,
                    end_ts=t0 + 0.5 if ended else None,
                )
            )
        if seq == hang_at:
            break
    return out


@pytest.mark.slow
def test_a_hang_is_found_alike_by_the_backtest_and_a_live_worker(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    """Hang checks run on each key's clock: in a backtest the input's event time tells the
    silence of a hung job, in a live worker its own clock does. Both must find the same hang
    (the same flag id: the same evidence, the same event time it began)."""
    start = float(int(time.time()) - 300)
    sim = ClusterSimulator(
        SimConfig(nodes=8, duration_s=120, seed=9, start_ts=start, faults=[], random_faults=0)
    )
    messages = sorted([*sim.messages(), *hung_job(start + 10.0, 40, 20)], key=lambda m: m.ts)
    feed = MessageFeed()
    backtest = [f for m in messages for f in feed.update(m)] + feed.flush()
    hangs = {f.id: (f.node, f.evidence.get("ranks_never_arrived")) for f in backtest}
    hangs = {i: v for i, v in hangs.items() if v[1] is not None}
    assert list(hangs.values()) == [("node-005", [5])], backtest

    publish(kafka_settings, messages)
    log = tmp_path / "hang.log"
    with streams_worker(kafka_settings, log, "native", "hang") as worker:
        wait_for(lambda: processed(log) >= len(messages) // 2, log, 120)
        deadline = time.monotonic() + 90
        live: list[Flag] = []
        while time.monotonic() < deadline and not any(f.id in hangs for f in live):
            live = read_flags(kafka_settings, want=10_000, timeout_s=3, worker=worker)
    assert set(hangs) <= {f.id for f in live}, [f.id for f in live]
    assert [f.category for f in live if f.id in hangs] == ["comm_hang"]

"""`guard replay`: recorded telemetry back into the topics, keyed, paced and retimed.

The main test records a run (`guard simulate` → JSONL), takes the backtest's flags over it
(`guard backtest`), replays the JSONL with `guard replay` into a real broker and runs a
native streams worker over it: the worker claims what the backtest claims, at the same
event times once the replay's time shift is taken off.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from guard.cli import main
from guard.config import Settings
from guard.kafka import DLQ_ERROR_HEADER, make_consumer
from guard.schemas import Flag, GpuSample, StepTiming, encode, parse_message
from guard.store import insert_messages
from guard.streams.replay import ClickHouseSource, JsonlSource, Replayer, ReplayFilter

from .test_faust_app import processed, read_flags, streams_worker, wait_for
from .test_native import assert_same_claims

T0 = 1767225600.0  # 2026-01-01: older than the topics' 72 h retention


def use_settings(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """Point `guard` commands run in this process at the test's broker and topics."""
    k = settings.kafka
    monkeypatch.setenv("GUARD_KAFKA_BOOTSTRAP", k.bootstrap)
    monkeypatch.setenv("GUARD_KAFKA_TOPIC_PREFIX", k.topic_prefix)
    monkeypatch.setenv("GUARD_KAFKA_TELEMETRY_PARTITIONS", str(k.telemetry_partitions))
    monkeypatch.setenv("GUARD_KAFKA_CONTROL_PARTITIONS", str(k.control_partitions))
    monkeypatch.setenv("GUARD_HOME", str(settings.home))


def consume_all(settings: Settings, topics: list[str], want: int, timeout_s: float = 30) -> list:
    consumer = make_consumer(settings, "replay-reader")
    assignment = []
    for name in topics:
        topic = settings.topic(name)
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        assignment += [TopicPartition(topic, p, 0) for p in parts]
    consumer.assign(assignment)
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < want and time.monotonic() < deadline:
        r = consumer.poll(0.5)
        if r is not None and not r.error():
            records.append(r)
    consumer.close()
    return records


def claims(flags: list[Flag]) -> set[tuple[str, str]]:
    return {(f.node, f.category) for f in flags if f.severity != "info" and f.node}


@pytest.mark.slow
def test_replayed_recording_through_a_live_worker_gives_the_backtests_flags(
    kafka_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    recording, truth, backtest = tmp_path / "run.jsonl", tmp_path / "truth.json", tmp_path / "bt"
    simulate = ["simulate", "--nodes", "8", "--duration", "240", "--seed", "4"]
    simulate += ["--start-ts", str(T0), "--random-faults", "0", "--workers", "1"]
    simulate += ["--fault", "thermal_throttle:node=node-002:onset=40:slowdown=0.15"]
    simulate += ["--fault", "xid:node=node-005:onset=90"]
    simulate += ["--fault", "degraded_nic:node=node-006:onset=120:slowdown=0.3"]
    assert main([*simulate, "--out", str(recording), "--truth", str(truth)]) == 0
    assert main(["backtest", str(recording), "--out", str(backtest), "--quiet"]) == 0
    expected_flags = [parse_message(line) for line in backtest.read_bytes().splitlines()]
    expected = claims(expected_flags)  # type: ignore[arg-type]
    assert {node for node, _ in expected} == {"node-002", "node-005", "node-006"}
    lines = recording.read_bytes().splitlines()
    kinds = Counter(parse_message(line).kind for line in lines)
    last = max(parse_message(line).ts for line in lines)

    use_settings(monkeypatch, kafka_settings)
    capsys.readouterr()
    before = time.time()
    assert main(["replay", str(recording), "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["messages"] == len(lines) and summary["by_kind"] == dict(sorted(kinds.items()))
    assert summary["dead_letters"] == summary["failed"] == 0
    # the last event lands at the moment of the replay
    assert before - 1 <= last + summary["shift_s"] <= time.time() + 1

    log = tmp_path / "worker.log"
    with streams_worker(kafka_settings, log, "native") as worker:
        wait_for(lambda: processed(log) >= len(lines), log, 180)
        time.sleep(3)  # findings → fusion → flags
        got = read_flags(kafka_settings, want=10_000, timeout_s=8, worker=worker)
    assert_same_claims(claims(got), expected)
    # and the first of each of the backtest's warning/critical claims is among the worker's,
    # at the same event time once the shift is taken off (up to float rounding of the
    # shift): the detectors run on event time only. (A later re-flag of a claim, after its
    # suspicion ended, depends on whether the node's other findings — a straggler found by
    # the job stream, consumed at its own pace — were withdrawn before it, as
    # assert_same_claims says; flag ids differ: they hash the evidence's times.)
    shift = summary["shift_s"]
    first: dict[tuple[object, ...], Flag] = {}
    for f in expected_flags:
        first.setdefault((f.node, f.category, f.severity, f.detector), f)  # type: ignore[attr-defined, arg-type]
    for want in (f for f in first.values() if f.severity != "info"):
        assert any(
            (f.node, f.category, f.severity, f.detector)
            == (want.node, want.category, want.severity, want.detector)  # type: ignore[attr-defined]
            and abs(f.ts - shift - want.ts) < 0.01
            for f in got
        ), (want, sorted((str(f.node), f.category, f.ts - shift) for f in got))


def _small_recording(path: Path, t0: float = T0) -> list[Any]:
    messages: list[Any] = []
    for i in range(20):
        for node in ("node-a", "node-b"):
            messages.append(GpuSample(ts=t0 + i * 0.25, node=node, job="job-1", gpu=0, temp_c=60.0))
        messages.append(
            StepTiming(ts=t0 + i * 0.25, node="node-a", job="job-1", rank=0, step=i, step_s=1.0)
        )
    flag = Flag(
        ts=t0, node="node-a", id="f1", detector="x", category="thermal", severity="info", score=1.0
    )
    lines = [encode(m) for m in messages]
    lines[5:5] = [b'{"kind": "gpu", "ts": "soon"}', encode(flag)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return messages


def test_replay_keys_stamps_and_dead_letters_like_the_contract(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    messages = _small_recording(tmp_path / "small.jsonl")
    stats = Replayer(kafka_settings).run(JsonlSource([tmp_path / "small.jsonl"]), retime="keep")
    assert stats.by_kind == {"gpu": 40, "step": 20}
    assert (stats.dead_letters, stats.skipped, stats.failed, stats.shift_s) == (1, 1, 0, 0.0)
    records = consume_all(kafka_settings, ["gpu", "steps"], want=60)
    assert len(records) == 60
    for r in records:
        m = parse_message(r.value())
        assert r.key() == (m.node if m.kind == "gpu" else m.job).encode()
        assert r.timestamp()[1] == int(m.ts * 1000)
    assert sorted(parse_message(r.value()).ts for r in records) == sorted(m.ts for m in messages)
    (dead,) = consume_all(kafka_settings, ["dlq"], want=1)
    assert dead.value() == b'{"kind": "gpu", "ts": "soon"}'
    reason = dict(dead.headers())[DLQ_ERROR_HEADER].decode()
    assert "gpu message" in reason and "ts" in reason


def test_replay_paces_at_speed_and_retimes_to_now(kafka_settings: Settings, tmp_path: Path) -> None:
    _small_recording(tmp_path / "small.jsonl")  # 4.75 s of events
    only = ReplayFilter(nodes=frozenset({"node-b"}))
    before = time.time()
    stats = Replayer(kafka_settings).run(JsonlSource([tmp_path / "small.jsonl"], only), speed=4)
    assert stats.by_kind == {"gpu": 20}
    assert stats.seconds >= 4.75 / 4  # paced: the last message waits for its turn
    records = consume_all(kafka_settings, ["gpu"], want=20)
    stamps = sorted(r.timestamp()[1] / 1000 for r in records)
    assert {parse_message(r.value()).node for r in records} == {"node-b"}
    # retimed: spacing kept, the last event at the end of the replay, none in the future
    assert stamps[-1] - stamps[0] == pytest.approx(4.75, abs=0.002)
    assert before - 1 <= stamps[-1] <= time.time() + 1


def test_clickhouse_source_rebuilds_the_stored_messages_in_event_time_order(
    store: tuple[Any, Settings], tmp_path: Path
) -> None:
    client, settings = store
    t0 = float(int(time.time()) - 3600)  # within the raw tables' TTL
    messages = _small_recording(tmp_path / "small.jsonl", t0)
    insert_messages(client, settings, messages)
    insert_messages(client, settings, messages[:10])  # delivered twice: FINAL keeps one
    db = settings.clickhouse.database
    got = list(ClickHouseSource(client, db).messages())
    assert len(got) == len(messages)
    assert [m.ts for m in got] == sorted(m.ts for m in messages)
    assert {encode(m) for m in got} == {encode(m) for m in messages}
    window = ReplayFilter(start=t0 + 1, end=t0 + 2, jobs=frozenset({"job-1"}))
    source = ClickHouseSource(client, db, window)
    inside = [m for m in messages if t0 + 1 <= m.ts < t0 + 2]
    assert {encode(m) for m in source.messages()} == {encode(m) for m in inside}
    span = source.span()
    assert span is not None and span.count == len(inside)
    assert (span.first, span.last) == (t0 + 1, max(m.ts for m in inside))
    assert list(ClickHouseSource(client, db, ReplayFilter(nodes=frozenset())).messages()) == []


def test_the_examples_in_the_replay_docstrings_run() -> None:
    import doctest

    import guard.streams.replay

    result = doctest.testmod(guard.streams.replay)
    assert result.attempted >= 3 and result.failed == 0


def test_a_batched_jsonl_file_replays_as_the_samples_of_its_batches(tmp_path: Path) -> None:
    from guard.agents.simulator import ClusterSimulator, SimConfig
    from guard.schemas import batch_messages

    ticks = list(ClusterSimulator(SimConfig(nodes=3, duration_s=60, seed=8)).batches())
    singles, batched = tmp_path / "singles.jsonl", tmp_path / "batched.jsonl"
    singles.write_bytes(b"".join(encode(m) + b"\n" for tick in ticks for m in tick))
    batched.write_bytes(b"".join(encode(m) + b"\n" for t in ticks for m in batch_messages(t)))
    assert len(batched.read_bytes().splitlines()) < len(singles.read_bytes().splitlines()) / 4
    one, other = JsonlSource([singles]), JsonlSource([batched])
    span, batched_span = one.span(), other.span()
    assert span is not None and batched_span is not None
    assert batched_span.count == span.count and batched_span.last == span.last
    got = sorted(m.model_dump_json() for m in other.messages())  # type: ignore[union-attr]
    assert got == sorted(m.model_dump_json() for m in one.messages())  # type: ignore[union-attr]
    assert all(m.kind in ("gpu", "nic", "step", "collective") for m in other.messages())

"""The transport-independent core of the streams workers."""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path

import pytest

from guard.detectors.findings import Finding
from guard.streams.checkpoints import seal
from guard.streams.processing import (
    CHECKPOINT_FORMAT,
    CHUNK_BYTES,
    KeyedState,
    decode_finding,
    encode_finding,
    finding_key,
)

from .planted import RunsCommand

SECRET = b"s" * 32


def test_checkpoints_bigger_than_a_kafka_record_are_split_and_put_back_together() -> None:
    store: dict[str, bytes] = {}
    state = KeyedState(
        make=dict,
        every_s=0,
        load=store.get,
        save=lambda key, partition, blob: store.__setitem__(key, blob),
        secret=SECRET,
    )
    big = {"ranks": os.urandom(3 * CHUNK_BYTES)}  # incompressible: a job of many ranks
    state.live["job-a"] = (big, 2)
    state.live["node-1"] = ({"small": 1}, 0)
    assert state.checkpoint_due(["job-a", "node-1"], force=True) == 2
    assert all(len(blob) <= CHUNK_BYTES for blob in store.values())
    assert len([k for k in store if k.startswith("job-a")]) == 5  # manifest + 4 parts

    fresh = KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get, secret=SECRET)
    assert fresh.get("job-a", 2) == big
    assert fresh.get("node-1", 0) == {"small": 1}
    assert fresh.restored == 2

    del store["job-a\x1f1"]  # a lost part: start cold, never from a wrong state
    assert KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get, secret=SECRET).get(
        "job-a", 2
    ) == {"cold": "job-a"}


def test_a_checkpoint_of_another_format_or_unreadable_starts_cold_and_is_counted() -> None:
    store = {
        # what the code before the restructure wrote: no format tag (its classes moved since)
        "old": zlib.compress(pickle.dumps({"from": "v1"}), 1),
        "corrupt": CHECKPOINT_FORMAT + b"not zlib at all",
    }
    state = KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get)
    assert state.get("old", 0) == {"cold": "old"}
    assert state.get("corrupt", 0) == {"cold": "corrupt"}
    assert (state.restored, state.refused) == (0, 2)


def test_checkpoints_wait_for_their_period_and_forget_moves_with_partitions() -> None:
    saved: list[str] = []
    state = KeyedState(
        make=lambda key: [key], every_s=3600, save=lambda key, partition, blob: saved.append(key)
    )
    state.get("a", 0)
    state.get("b", 1)
    assert state.checkpoint_due(["a", "b"]) == 0  # just created: not due for an hour
    assert saved == []
    state.forget({1})
    assert set(state.live) == {"a"}


def test_findings_travel_as_json_and_are_keyed_by_their_node() -> None:
    f = Finding(
        "c4d",
        "comm_hang",
        "critical",
        None,
        10.0,
        5.0,
        1.0,
        job="job-a",
        evidence={"ranks": [1, 2]},
    )
    assert decode_finding(encode_finding(f)) == f
    assert finding_key(f) == "job:job-a"
    assert finding_key(Finding("thermal", "thermal", "warning", "n1", 1.0, 1.0, 1.0)) == "n1"


class _Recorder:
    """A detector partition that records the event times it is ticked at."""

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def tick(self, now: float) -> list[Finding]:
        self.ticks.append(now)
        return []


def test_each_key_is_ticked_on_its_own_event_time() -> None:
    from guard.streams.processing import EventClock

    state = KeyedState(make=lambda key: _Recorder(), every_s=3600)
    slow, fast = state.get("job-slow", 0), state.get("job-fast", 1)
    clock = EventClock(state, tick_s=5.0)
    clock.advance({"job-slow": 100.0, "job-fast": 100.0})
    # job-fast's partition runs 60 s of event time ahead: job-slow must not be judged by it
    clock.advance({"job-fast": 160.0})
    clock.advance({"job-slow": 103.0})
    assert slow.ticks == [100.0]
    assert fast.ticks == [100.0, 160.0]
    clock.advance({"job-slow": 106.0})
    assert slow.ticks == [100.0, 106.0]


def test_a_silent_key_follows_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.streams import processing
    from guard.streams.processing import EventClock

    state = KeyedState(make=lambda key: _Recorder(), every_s=3600)
    hung = state.get("job-hung", 0)
    clock = EventClock(state, tick_s=5.0)
    now = [1000.0]
    monkeypatch.setattr(processing.time, "monotonic", lambda: now[0])
    clock.advance({"job-hung": 50.0})
    assert clock.idle() == [] and hung.ticks == [50.0]  # not idle yet
    now[0] += 30.0  # 30 s of wall time without a message from this job
    clock.idle()
    assert hung.ticks == [50.0, 80.0]


class _ReachesGlobals:
    """A pickle that climbs from an allowed class to its module's globals with getattr."""

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        from guard.detectors.hold import Hold

        return getattr, (Hold.__init__, "__globals__")


def test_a_planted_checkpoint_runs_nothing_and_starts_its_key_cold(tmp_path: Path) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(RunsCommand(control)))  # what plain pickle.loads would do
    assert control.exists()
    marker = tmp_path / "pwned"
    evil = zlib.compress(pickle.dumps(RunsCommand(marker)), 1)
    store = {
        # the format before the HMAC tag: read as plain pickle by that code
        "v2": b"guard-state-2:" + evil,
        # today's format with a made-up tag
        "forged": CHECKPOINT_FORMAT + os.urandom(32) + evil,
        # signed with the right key (a leaked key): the unpickler still refuses os.system
        "leaked-key": seal(SECRET, "leaked-key", RunsCommand(marker)),
        "leaked-getattr": seal(SECRET, "leaked-getattr", _ReachesGlobals()),
        # a genuine checkpoint moved under another key
        "moved": seal(SECRET, "elsewhere", {"state": 1}),
        # a genuine checkpoint of another table's kind of object
        "other-kind": seal(SECRET, "other-kind", ["a list"]),
        "corrupt": CHECKPOINT_FORMAT + b"short",
        "manifest": b"guard-chunks:99999999999999",
        "old": zlib.compress(pickle.dumps({"from": "v1"}), 1),
        "good": seal(SECRET, "good", {"state": 2}),
    }
    state = KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get, secret=SECRET)
    for key in store:
        expected = {"state": 2} if key == "good" else {"cold": key}
        assert state.get(key, 0) == expected, key
    assert not marker.exists()
    assert (state.restored, state.refused) == (1, len(store) - 1)


def test_real_detector_state_round_trips_through_the_restricted_unpickler() -> None:
    """Every class a detector keeps is on the allow-list, and restored state goes on exactly
    like the original (a simulated cluster with faults, so the rarer detectors hold state)."""
    from guard.agents.simulator.cluster import ClusterSimulator
    from guard.agents.simulator.config import FaultSpec, SimConfig
    from guard.detectors.engine import EngineConfig
    from guard.detectors.signal_anomaly import SignalAnomalyDetector
    from guard.schemas import encode
    from guard.schemas.topics import TOPIC_BY_KIND
    from guard.streams.checkpoints import unseal
    from guard.streams.processing import FusionProcessor, StreamsCounters, TelemetryProcessor

    config = SimConfig(
        nodes=4,
        duration_s=240,
        seed=5,
        random_faults=3,
        faults=[FaultSpec(kind="slow_gpu", node="node-001", gpu=2, onset_s=60)],
    )
    kinds = {TOPIC_BY_KIND[k]: k for k in ("gpu", "nic", "step", "collective")}

    def pipeline() -> tuple[TelemetryProcessor, TelemetryProcessor, FusionProcessor]:
        counters = StreamsCounters()
        return (
            TelemetryProcessor("node", kinds, EngineConfig(), 1e9, counters),
            TelemetryProcessor("job", kinds, EngineConfig(), 1e9, counters),
            FusionProcessor(1e9, counters),
        )

    def run(procs: tuple[TelemetryProcessor, ...], messages: list[object]) -> list[object]:
        node, job, fusion = procs
        records = [(TOPIC_BY_KIND[m.kind], 0, encode(m)) for m in messages]  # type: ignore[attr-defined]
        found = node.process([r for r in records if r[0] in ("gpu", "nic")])[0]
        found += job.process([r for r in records if r[0] not in ("gpu", "nic")])[0]
        flags = fusion.process([(finding_key(f).encode(), 0, encode_finding(f)) for f in found])  # type: ignore[attr-defined]
        return [*found, *flags]

    messages = list(ClusterSimulator(config).messages())
    cut = len(messages) * 2 // 3
    original = pipeline()
    run(original, messages[:cut])
    restored = pipeline()
    tables = 0
    for was, now in zip((p.state for p in original), (p.state for p in restored), strict=True):
        for key, (obj, partition) in was.live.items():
            now.live[key] = (unseal(SECRET, key, seal(SECRET, key, obj)), partition)
            tables += 1
    assert tables >= 4 + 1 + 1  # the nodes, the job, fusion of the nodes with findings
    assert run(restored, messages[cut:]) == run(original, messages[cut:]) != []

    anomaly = SignalAnomalyDetector(window=50, grace=20, hold=2)
    for i in range(100):
        anomaly.update(float(i), 60.0 + i % 7)
    back = unseal(SECRET, "anomaly", seal(SECRET, "anomaly", anomaly))
    tail = [60.0 + i % 7 for i in range(20)] + [20.0] * 5
    alarms = [back.update(100.0 + i, v) for i, v in enumerate(tail)]
    assert alarms == [anomaly.update(100.0 + i, v) for i, v in enumerate(tail)]
    assert any(a is not None for a in alarms)


def test_records_on_the_findings_topic_that_are_not_findings_are_dead_letters() -> None:
    from guard.streams.processing import FusionProcessor, StreamsCounters

    good = Finding("xid", "gpu_error", "critical", "n1", 10.0, 10.0, 1.0, gpu=3)
    records = [
        (b"n1", 0, b"\xff not json"),
        (b"n1", 0, b'{"detector": "x"}'),  # fields missing
        (b"n1", 0, encode_finding(good).replace(b'"gpu_error"', b'"rootkit"')),
        (b"n1", 0, encode_finding(good).replace(b'"ts":10.0', b'"ts":"soon"')),
        (b"n1", 0, b"[" * 100_000),  # deep nesting
        (b"\xff\xfe", 0, encode_finding(good)),  # a key that is not UTF-8
        (b"n1", 0, encode_finding(good)),
    ]
    counters = StreamsCounters()
    flags, bad = FusionProcessor(3600, counters).process(records)
    assert [i for i, _ in bad] == [0, 1, 2, 3, 4, 5]
    assert all(str(error) for _, error in bad)
    assert "category" in str(bad[2][1]) and "ts" in str(bad[3][1])
    assert [(f.node, f.category) for f in flags] == [("n1", "gpu_error")]
    assert counters.dead_letters == 6


def test_keys_without_input_expire_with_their_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.streams import processing

    now = [1000.0]
    monkeypatch.setattr(processing.time, "monotonic", lambda: now[0])
    store: dict[str, bytes] = {}
    deleted: list[tuple[str, int]] = []
    state = KeyedState(
        make=lambda key: {"cold": key},
        every_s=10,
        load=store.get,
        save=lambda key, partition, blob: store.__setitem__(key, blob),
        delete=lambda key, partition: (deleted.append((key, partition)), store.pop(key, None)),
        secret=SECRET,
    )
    names = [f"made-up-{i}" for i in range(100_000)]  # a flood of distinct node names
    for name in names:
        state.get(name, 1)
    state.checkpoint_due(names, force=True)
    state.get("node-1", 0)["warm"] = True
    now[0] += 3000
    state.checkpoint_due(["node-1"], force=True)  # node-1 keeps sending; the others stopped
    now[0] += 3000
    assert state.expire(0) == []  # 0: keys never expire
    assert len(state.expire(3600)) == 100_000
    assert set(state.live) == {"node-1"} and set(state.seen) == {"node-1"}
    assert len(deleted) == 100_000 and deleted[0] == ("made-up-0", 1)
    assert set(store) == {"node-1"}  # their checkpoints went with them
    assert state.get("made-up-7", 1) == {"cold": "made-up-7"}  # back later: a cold start


def test_batched_records_give_the_same_findings_and_flags_as_their_singles() -> None:
    """The same faulty run, once as single samples and once as batch records (one per node
    per interval, per node per step), through the node, job and fusion processors."""
    from guard.agents.simulator.cluster import ClusterSimulator
    from guard.agents.simulator.config import FaultSpec, SimConfig
    from guard.detectors.engine import EngineConfig
    from guard.schemas import batch_messages, encode
    from guard.schemas.topics import TOPIC_BY_KIND
    from guard.streams.processing import FusionProcessor, StreamsCounters, TelemetryProcessor

    config = SimConfig(
        nodes=4,
        duration_s=300,
        seed=5,
        random_faults=3,
        faults=[FaultSpec(kind="slow_gpu", node="node-001", gpu=2, onset_s=60)],
    )
    kinds = {TOPIC_BY_KIND[k]: k for k in ("gpu", "nic", "step", "collective")}

    def run(ticks: list[list[object]]) -> tuple[list[bytes], list[bytes], StreamsCounters]:
        counters = StreamsCounters()
        node = TelemetryProcessor("node", kinds, EngineConfig(), 1e9, counters)
        job = TelemetryProcessor("job", kinds, EngineConfig(), 1e9, counters)
        fusion = FusionProcessor(1e9, counters)
        found, flags = [], []
        for tick in ticks:  # one batch of records per sampling tick, as a worker sees them
            records = [(TOPIC_BY_KIND[m.kind], 0, encode(m)) for m in tick]  # type: ignore[attr-defined]
            new = node.process([r for r in records if r[0] in ("gpu", "nic")])[0]
            new += job.process([r for r in records if r[0] not in ("gpu", "nic")])[0]
            found += new
            flags += fusion.process([(finding_key(f).encode(), 0, encode_finding(f)) for f in new])[
                0
            ]
        return sorted(map(encode_finding, found)), sorted(map(encode, flags)), counters

    ticks = list(ClusterSimulator(config).batches())
    singles = run(ticks)  # type: ignore[arg-type]
    batched = run([batch_messages(t) for t in ticks])  # type: ignore[arg-type, misc]
    assert batched[0] == singles[0] and batched[1] == singles[1]
    assert len(singles[1]) > 0 and any(b'"slow' in f or b"node-001" in f for f in singles[1])
    assert batched[2].samples == singles[2].samples == singles[2].telemetry
    assert batched[2].telemetry < singles[2].telemetry / 4  # far fewer records
    assert batched[2].kinds["gpu_batch"] > 0 and batched[2].kinds["gpu"] == 0

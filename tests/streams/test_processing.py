"""The transport-independent core of the streams workers."""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path

import pytest

from guard.detectors.core import (
    DetectionCore,
    MemoryStore,
    decode_finding,
    encode_finding,
    encode_findings,
    finding_key,
)
from guard.detectors.findings import Finding
from guard.schemas import StepTiming, encode
from guard.streams.checkpoints import seal
from guard.streams.processing import CHECKPOINT_FORMAT, CHUNK_BYTES, KeyedState

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
    assert b'"kind":"finding"' in encode_finding(f)  # the schema's kind, one encoder
    # what workers before the finding kind wrote (the dataclass's fields, no kind) still reads
    from dataclasses import asdict

    import orjson

    assert decode_finding(orjson.dumps(asdict(f))) == f
    assert finding_key(f) == "job:job-a"
    assert finding_key(Finding("thermal", "thermal", "warning", "n1", 1.0, 1.0, 1.0)) == "n1"


class _Recorder:
    """A job's detectors that record the event times they are ticked at."""

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def add_steps(self, cols: object) -> list[Finding]:
        return []

    def tick(self, now: float) -> list[Finding]:
        self.ticks.append(now)
        return []


def _recording_core() -> DetectionCore:
    def stores(table: str, make: object) -> MemoryStore:
        return MemoryStore(table, (lambda key: _Recorder()) if table == "job-detectors" else make)  # type: ignore[arg-type]

    return DetectionCore(stores=stores)


def _step(job: str, ts: float, partition: int = 0) -> tuple[int, str, bytes]:
    message = StepTiming(ts=ts, node="n1", job=job, rank=0, step=int(ts), step_s=1.0)
    return (partition, "step", encode(message))


def test_each_key_is_ticked_on_its_own_event_time() -> None:
    core = _recording_core()
    core.step([_step("job-slow", 100.0), _step("job-fast", 100.0, 1)], wall=0.0)
    # job-fast's partition runs 60 s of event time ahead: job-slow must not be judged by it
    core.step([_step("job-fast", 160.0, 1)], wall=0.1)
    core.step([_step("job-slow", 103.0)], wall=0.2)
    slow, fast = (core.parts("jobs")[k] for k in ("job-slow", "job-fast"))
    assert slow.ticks == [100.0]
    assert fast.ticks == [100.0, 160.0]
    core.step([_step("job-slow", 106.0)], wall=0.3)
    assert slow.ticks == [100.0, 106.0]


def test_a_silent_key_follows_the_runner_s_clock() -> None:
    core = _recording_core()
    core.step([_step("job-hung", 50.0)], wall=1000.0)
    hung = core.parts("jobs")["job-hung"]
    assert core.idle(1001.0) == [] and hung.ticks == [50.0]  # not idle yet
    core.idle(1030.0)  # 30 s on the runner's clock without a message from this job
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
    from guard.detectors.signal_anomaly import SignalAnomalyDetector
    from guard.streams.checkpoints import unseal

    config = SimConfig(
        nodes=4,
        duration_s=240,
        seed=5,
        random_faults=3,
        faults=[FaultSpec(kind="slow_gpu", node="node-001", gpu=2, onset_s=60)],
    )

    def run(core: DetectionCore, messages: list[object]) -> list[object]:
        records = [(0, m.kind, encode(m)) for m in messages]  # type: ignore[attr-defined]
        found = core.step(records, wall=0.0).findings
        flags = core.step((), encode_findings(found), wall=0.0).flags
        return [*found, *flags]

    messages = list(ClusterSimulator(config).messages())
    cut = len(messages) * 2 // 3
    original = DetectionCore()
    run(original, messages[:cut])
    restored = DetectionCore()
    tables = 0
    for was, now in (
        (original.nodes, restored.nodes),
        (original.jobs, restored.jobs),
        (original.fusion, restored.fusion),
    ):
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


def test_array_state_restores_and_an_array_of_objects_from_a_buffer_is_refused() -> None:
    """A node's NIC ports are numpy arrays (numpy 2 pickles them as raw buffers, which the
    unpickler admits); the same reduction naming an object dtype builds nothing."""
    import io

    import numpy as np

    from guard.detectors.nic import NicDetector
    from guard.schemas import NicSample
    from guard.streams.checkpoints import StateUnpickler, unseal

    det = NicDetector()
    for t in range(3):
        det.update(
            NicSample(ts=10.0 + t, node="n1", device="mlx5_0", port=1, counters={"symbol_error": t})
        )
    back = unseal(SECRET, "n1", seal(SECRET, "n1", det))
    assert back.counters("mlx5_0", 1) == {"symbol_error": 2}
    assert np.array_equal(back.state, det.state, equal_nan=True)

    frombuffer = pickle.loads(b"cnumpy._core.numeric\n_frombuffer\n.")  # what arrays name

    class ObjectsFromBytes:
        def __reduce__(self) -> tuple[object, ...]:
            return frombuffer, (b"\x00" * 8, np.dtype(object), (1,), "C")

    with pytest.raises(ValueError, match=r"(?i)object"):
        StateUnpickler(io.BytesIO(pickle.dumps(ObjectsFromBytes(), protocol=5))).load()


def test_records_on_the_findings_topic_that_are_not_findings_are_dead_letters() -> None:
    good = Finding("xid", "gpu_error", "critical", "n1", 10.0, 10.0, 1.0, gpu=3)
    records = [
        (0, b"n1", b"\xff not json"),
        (0, b"n1", b'{"detector": "x"}'),  # fields missing
        (0, b"n1", encode_finding(good).replace(b'"gpu_error"', b'"rootkit"')),
        (0, b"n1", encode_finding(good).replace(b'"ts":10.0', b'"ts":"soon"')),
        (0, b"n1", b"[" * 100_000),  # deep nesting
        (0, b"\xff\xfe", encode_finding(good)),  # a key that is not UTF-8
        (0, b"n1", encode_finding(good)),
    ]
    core = DetectionCore()
    out = core.step((), records, wall=0.0)
    flags, bad, counters = out.flags, out.bad_findings, core.counters
    assert [i for i, _ in bad] == [0, 1, 2, 3, 4, 5]
    assert all(str(error) for _, error in bad)
    assert "category" in str(bad[2][1]) and "ts" in str(bad[3][1])
    assert [(f.node, f.category) for f in flags] == [("n1", "gpu_error")]
    assert counters.dead_letters == 6


def test_a_batch_of_bad_records_is_freed_as_soon_as_its_output_is() -> None:
    """A bad record's error in the batch's output keeps no traceback. With one it held the
    frames that raised it, and through them the batch: a reference cycle per batch that
    only the cyclic collector frees, and the workers run it seldom (a flood of 800k bad
    records held ~1 GB: ``benchmarks/chaos.py --scenarios hostile``)."""
    import gc

    bad = [
        b'{"kind":"gpu","v":1,"ts":NaN,"node":"h","gpu":0}',
        b'{"kind": "gpu", "ts": "soon", "node": "h", "gpu": "0"}',
        b"[" * 3000,
        b"\xff\xfe not json",
    ]
    telemetry = [(0, "gpu", value) for value in bad] + [(0, "nic", bad[1]), (0, "steps", bad[0])]
    findings = [(0, b"n1", value) for value in bad]
    core = DetectionCore()
    core.step(telemetry, findings, wall=0.0)  # anything made once is made
    gc.collect()
    gc.disable()
    try:
        out = core.step(telemetry, findings, wall=1.0)
        assert len(out.bad) == len(telemetry) and len(out.bad_findings) == len(findings)
        assert all(error.__traceback__ is None for _, error in out.bad + out.bad_findings)
        del out
        assert gc.collect() == 0  # nothing was left for the cyclic collector
    finally:
        gc.enable()


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
    from guard.detectors.core import CoreCounters
    from guard.schemas import batch_messages

    config = SimConfig(
        nodes=4,
        duration_s=300,
        seed=5,
        random_faults=3,
        faults=[FaultSpec(kind="slow_gpu", node="node-001", gpu=2, onset_s=60)],
    )
    single_of = {"gpu_batch": "gpu", "nic_batch": "nic", "step_batch": "step"}
    single_of["collective_batch"] = "collective"

    def run(ticks: list[list[object]]) -> tuple[list[bytes], list[bytes], CoreCounters]:
        core = DetectionCore()
        found, flags = [], []
        for n, tick in enumerate(ticks):  # a batch of records per sampling tick, as in a worker
            records = [(0, single_of.get(m.kind, m.kind), encode(m)) for m in tick]  # type: ignore[attr-defined]
            out = core.step(records, encode_findings(found[-1] if found else []), wall=float(n))
            found.append(out.findings)
            flags += out.flags
        flags += core.step((), encode_findings(found[-1]), wall=float(len(ticks))).flags
        every = [f for batch in found for f in batch]
        return sorted(map(encode_finding, every)), sorted(map(encode, flags)), core.counters

    ticks = list(ClusterSimulator(config).batches())
    singles = run(ticks)  # type: ignore[arg-type]
    batched = run([batch_messages(t) for t in ticks])  # type: ignore[arg-type, misc]
    assert batched[0] == singles[0] and batched[1] == singles[1]
    assert len(singles[1]) > 0 and any(b'"slow' in f or b"node-001" in f for f in singles[1])
    assert batched[2].samples == singles[2].samples == singles[2].telemetry
    assert batched[2].telemetry < singles[2].telemetry / 4  # far fewer records
    assert batched[2].kinds["gpu_batch"] > 0 and batched[2].kinds["gpu"] == 0

"""The transport-independent core of the streams workers."""

from __future__ import annotations

import os
import pickle
import zlib

import pytest

from guard.detectors.findings import Finding
from guard.streams.processing import (
    CHECKPOINT_FORMAT,
    CHUNK_BYTES,
    KeyedState,
    decode_finding,
    encode_finding,
    finding_key,
)


def test_checkpoints_bigger_than_a_kafka_record_are_split_and_put_back_together() -> None:
    store: dict[str, bytes] = {}
    state = KeyedState(
        make=dict,
        every_s=0,
        load=store.get,
        save=lambda key, partition, blob: store.__setitem__(key, blob),
    )
    big = {"ranks": os.urandom(3 * CHUNK_BYTES)}  # incompressible: a job of many ranks
    state.live["job-a"] = (big, 2)
    state.live["node-1"] = ({"small": 1}, 0)
    assert state.checkpoint_due(["job-a", "node-1"], force=True) == 2
    assert all(len(blob) <= CHUNK_BYTES for blob in store.values())
    assert len([k for k in store if k.startswith("job-a")]) == 5  # manifest + 4 parts

    fresh = KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get)
    assert fresh.get("job-a", 2) == big
    assert fresh.get("node-1", 0) == {"small": 1}
    assert fresh.restored == 2

    del store["job-a\x1f1"]  # a lost part: start cold, never from a wrong state
    assert KeyedState(make=lambda key: {"cold": key}, every_s=0, load=store.get).get(
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

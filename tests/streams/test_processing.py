"""The transport-independent core of the streams workers."""

from __future__ import annotations

import os

from guard.detectors.findings import Finding
from guard.streams.processing import (
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

"""Batched telemetry records (wire contract 1.1): one record per node per interval or step."""

from __future__ import annotations

import doctest
import io
from pathlib import Path

import orjson
import pytest

import guard.schemas.batches
from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.schemas import (
    GpuBatch,
    GpuSample,
    NicSample,
    SchemaError,
    StepBatch,
    batch_messages,
    decode,
    encode,
    expand,
    json_schemas,
    parse_message,
)
from guard.schemas.batches import SINGLE_OF
from guard.schemas.topics import TOPIC_BY_KIND

T0 = 1767225600.0


def _simulated_tick_groups() -> list[list[object]]:
    sim = ClusterSimulator(SimConfig(nodes=3, duration_s=60, seed=4))
    return list(sim.batches())


def test_the_examples_in_the_module_run() -> None:
    assert doctest.testmod(guard.schemas.batches).failed == 0


def test_batches_of_a_simulated_run_decode_back_to_exactly_its_samples() -> None:
    kinds_seen: set[str] = set()
    for tick in _simulated_tick_groups():
        batched = batch_messages(tick)  # type: ignore[arg-type]
        assert len(batched) < len(tick)
        back = []
        for message in batched:
            kinds_seen.add(message.kind)
            raw = encode(message)
            parsed = parse_message(raw)
            assert type(parsed) is type(message)
            # the topic's kind decodes its batches too
            single_kind = SINGLE_OF.get(parsed.kind, parsed.kind)
            assert decode(raw, single_kind).model_dump() == parsed.model_dump()
            assert TOPIC_BY_KIND[message.kind] == TOPIC_BY_KIND[single_kind]
            assert parsed.kafka_key() == message.kafka_key()
            back += expand(parsed)
        key = lambda m: (m.kind, m.node, m.job, m.ts, orjson.dumps(m.model_dump()))  # noqa: E731
        assert sorted(m.model_dump_json() for m in back) == sorted(
            m.model_dump_json()
            for m in tick  # type: ignore[attr-defined]
        )
        assert sorted(back, key=key) == sorted(tick, key=key)  # type: ignore[arg-type]
    assert {"gpu_batch", "nic_batch", "step_batch", "collective_batch"} <= kinds_seen


def test_a_batch_is_keyed_like_its_single_kind() -> None:
    steps = [
        {"kind": "step", "ts": T0 + r / 10, "node": "n1", "job": "j", "rank": r, "step": 7,
         "step_s": 1.0}
        for r in range(4)
    ]  # fmt: skip
    [batch] = batch_messages([parse_message(orjson.dumps(s)) for s in steps])
    assert isinstance(batch, StepBatch)
    assert batch.kafka_key() == b"j" and batch.ts == T0 + 0.3
    raw = orjson.loads(encode(batch))
    assert "ts" not in raw["ranks"][-1] and raw["ranks"][0]["ts"] == T0  # own ts when it differs
    assert [m.ts for m in batch.samples()] == [s["ts"] for s in steps]


def test_single_kinds_stay_valid_on_their_topics() -> None:
    sample = GpuSample(ts=T0, node="n1", gpu=0, temp_c=50.0)
    assert decode(encode(sample), "gpu") == sample
    assert decode(encode(sample), "gpu_batch") == sample  # a topic carries both
    # an older producer that leaves out `kind` on the gpu topic is still read as gpu
    assert isinstance(decode(b'{"ts": 1767225600.0, "node": "n1", "gpu": 3}', "gpu"), GpuSample)


def test_a_bad_batch_names_the_entry_and_field() -> None:
    good = GpuBatch(ts=T0, node="n1", gpus=[{"gpu": 0}, {"gpu": 1}])  # type: ignore[list-item]
    data = orjson.loads(encode(good))
    data["gpus"][1]["temp_c"] = "hot"
    with pytest.raises(SchemaError) as err:
        decode(orjson.dumps(data), "gpu")
    assert err.value.kind == "gpu_batch" and err.value.field == "gpus.1.temp_c"
    with pytest.raises(SchemaError) as err:
        decode(orjson.dumps({**data, "gpus": []}), "gpu")
    assert err.value.field == "gpus"
    nic = NicSample(ts=T0, node="n1", device="mlx5_0", port=1)
    with pytest.raises(SchemaError) as err:
        decode(encode(nic), "gpu")
    assert err.value.field == "kind" and "'gpu' or 'gpu_batch'" in str(err.value)


def test_batch_kinds_have_json_schemas() -> None:
    schemas = json_schemas()
    for kind, entries in (("gpu_batch", "gpus"), ("nic_batch", "ports"), ("step_batch", "ranks"),
                          ("collective_batch", "ranks")):  # fmt: skip
        assert entries in schemas[kind]["required"]


def test_a_batched_jsonl_run_backtests_to_the_same_flags_as_its_singles(tmp_path: Path) -> None:
    """The simulator's writer with ``batched=True``, read back by ``guard backtest``."""
    from guard.agents.simulator import FaultSpec, write_jsonl
    from guard.evaluation.backtest import BacktestStats, make_detector, read_messages, run_backtest

    config = SimConfig(
        nodes=6,
        duration_s=240,
        seed=21,
        random_faults=0,
        faults=[
            FaultSpec("slow_gpu", node="node-003", gpu=2, onset_s=60, slowdown=0.08),
            FaultSpec("xid", node="node-001", gpu=1, onset_s=100),
        ],
    )
    results = []
    for batched in (False, True):
        path = tmp_path / f"t-{batched}.jsonl"
        _, counts = write_jsonl(config, path, workers=1, batched=batched)
        stats = BacktestStats()
        out = io.BytesIO()
        run_backtest(read_messages([path], stats), out, make_detector("guard"), stats)
        assert stats.bad_lines == 0
        results.append((out.getvalue(), stats.messages, counts, path.stat().st_size))
    singles, n_singles, counts_singles, size_singles = results[0]
    batched_flags, n_batched, counts_batched, size_batched = results[1]
    assert batched_flags == singles and b"node-003" in singles and b"node-001" in singles
    assert n_batched == n_singles == sum(counts_singles.values())  # every sample read
    assert sum(counts_batched.values()) < n_singles / 4 and counts_batched.get("gpu", 0) == 0
    assert size_batched < size_singles

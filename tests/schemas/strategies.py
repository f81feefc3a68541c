"""hypothesis strategies that build valid messages of every kind."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import strategies as st

from guard.schemas import (
    CATEGORIES,
    NODE_STATES,
    SEVERITIES,
    CollectiveTiming,
    ConnectionStat,
    Flag,
    GpuSample,
    NicSample,
    NodeState,
    StepTiming,
    SweepCheck,
    SweepResult,
    batch_messages,
    encode,
)
from guard.schemas.batches import BATCH_MODEL_OF_KIND, BATCH_OF
from guard.schemas.codec import MODELS
from guard.schemas.tables import TABLE_BY_KIND

names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
ts = st.floats(min_value=1e9, max_value=4e9, allow_nan=False, allow_infinity=False)
small = st.integers(min_value=0, max_value=4096)
counter = st.integers(min_value=0, max_value=2**64 - 1)
nonneg = st.floats(min_value=0, max_value=1e5, allow_nan=False, allow_infinity=False)


def opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


common = {"ts": ts, "node": names, "job": opt(names)}

gpu_samples = st.builds(
    GpuSample,
    **common,
    gpu=small,
    uuid=opt(names),
    temp_c=opt(st.floats(min_value=-20, max_value=150, allow_nan=False)),
    power_w=opt(nonneg),
    power_limit_w=opt(nonneg),
    sm_clock_mhz=opt(nonneg),
    sm_clock_max_mhz=opt(nonneg),
    mem_clock_mhz=opt(nonneg),
    util_pct=opt(st.floats(min_value=0, max_value=100)),
    mem_util_pct=opt(st.floats(min_value=0, max_value=100)),
    clock_event_reasons=opt(counter),
    ecc_sbe_total=opt(counter),
    ecc_dbe_total=opt(counter),
    xid=opt(st.integers(min_value=0, max_value=200)),
    pcie_replay_total=opt(counter),
)
nic_samples = st.builds(
    NicSample,
    **common,
    device=names,
    port=small,
    netdev=opt(names),
    link_up=opt(st.booleans()),
    speed_gbps=opt(nonneg),
    counters=st.dictionaries(st.text(min_size=1, max_size=30), counter, max_size=12),
)
step_timings = st.builds(
    StepTiming,
    **{**common, "job": names},
    rank=small,
    gpu=opt(st.integers(0, 7)),
    step=st.integers(min_value=0, max_value=10**9),
    step_s=nonneg,
    compute_s=opt(nonneg),
    pp_stage=opt(st.integers(0, 64)),
    dp_rank=opt(small),
    tokens=opt(counter),
)
collectives = st.builds(
    CollectiveTiming,
    **{**common, "job": names},
    rank=small,
    comm=names,
    op=st.sampled_from(["allreduce", "allgather", "reducescatter", "broadcast", "send", "recv"]),
    seq=st.integers(min_value=0, max_value=10**12),
    bytes=counter,
    arrive_ts=ts,
    end_ts=opt(ts),
    peers=opt(
        st.lists(
            st.builds(ConnectionStat, rank=small, bytes=counter, duration_s=nonneg), max_size=8
        )
    ),
)
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False)
)
evidence = st.dictionaries(
    st.text(max_size=20),
    st.recursive(
        json_leaf,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=10,
    ),
    max_size=6,
)
flags = st.builds(
    Flag,
    **{**common, "node": opt(names)},
    id=st.text(alphabet="0123456789abcdef", min_size=8, max_size=32),
    gpu=opt(st.integers(0, 7)),
    device=opt(names),
    rank=opt(small),
    detector=st.sampled_from(["peer_straggler", "c4d", "thermal", "nic"]),
    category=st.sampled_from(CATEGORIES),
    severity=st.sampled_from(SEVERITIES),
    score=st.floats(allow_nan=False, allow_infinity=False),
    evidence=evidence,
    window_s=opt(nonneg),
)
sweeps = st.builds(
    SweepResult,
    **common,
    id=st.text(alphabet="0123456789abcdef", min_size=8, max_size=32),
    sweep=st.sampled_from(["single", "multi"]),
    peers=st.lists(names, max_size=3),
    checks=st.lists(
        st.builds(
            SweepCheck,
            name=st.text(min_size=1, max_size=20),
            value=opt(st.floats(allow_nan=False, allow_infinity=False)),
            unit=st.text(max_size=8),
            baseline=opt(st.floats(allow_nan=False, allow_infinity=False)),
            passed=st.booleans(),
            detail=st.text(max_size=50),
        ),
        max_size=5,
    ),
    passed=st.booleans(),
)
node_states = st.builds(
    NodeState,
    **common,
    state=st.sampled_from(NODE_STATES),
    prev=opt(st.sampled_from(NODE_STATES)),
    reason=st.text(max_size=80),
    actor=st.text(max_size=20),
)

STRATEGIES = {
    "gpu": gpu_samples,
    "nic": nic_samples,
    "step": step_timings,
    "collective": collectives,
    "flag": flags,
    "sweep": sweeps,
    "node_state": node_states,
}
any_message = st.one_of(*STRATEGIES.values())


# -- telemetry records as a producer might send them, many broken on purpose ----------------

TELEMETRY = sorted(BATCH_OF)
#: Nested deeper than pydantic parses (orjson reads it): pydantic's rejection must stand.
_DEEP = b"[" * 300 + b"1" + b"]" * 300


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


nasty = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, -1, 1, 2**53 + 1, 2**64 - 1, 2**64, 10**30, 1001, 1_000_001])
    | st.sampled_from([-0.0, 0.5, 1e300, -1e300, 3.0, 1e-320, 2.0**53 + 2, 32503680001.0])
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "x", "12", "1.5", "true", "null", "gpu", "gpu_batch", "x" * 300])
    | st.text(max_size=8)
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=4), st.integers(0, 5), max_size=3)
    | st.just([{"rank": 1, "bytes": 2, "duration_s": "slow"}])
    | st.just([{"rank": 1, "bytes": 2, "duration_s": 1, "extra": [[[]]]}])
    | st.just(_deep(3))
)


def _field_names(kind: str) -> list[str]:
    names = set(TABLE_BY_KIND[kind].column_names) | set(MODELS[kind].model_fields)
    names |= set(BATCH_MODEL_OF_KIND[BATCH_OF[kind]].model_fields)
    return sorted(names | {"kind", "unknown_field", "ts"})


@st.composite
def mutated(draw: Any, obj: dict[str, Any], kind: str) -> bytes:
    """``obj`` as JSON bytes, maybe broken: in a field of its own, of an entry, or its bytes."""
    how = draw(st.sampled_from(["keep", "keep", "set", "drop", "entry", "bytes", "dup"]))
    target = obj
    entries = next((v for k, v in obj.items() if isinstance(v, list) and k != "peers"), None)
    if how == "entry" and entries:
        target = draw(st.sampled_from(entries))
        how = draw(st.sampled_from(["set", "drop"]))
    if how == "set":
        target[draw(st.sampled_from(_field_names(kind)))] = draw(nasty)
    elif how == "drop" and target:
        target.pop(draw(st.sampled_from(sorted(target))))
    data = json.dumps(obj, separators=(",", ":")).encode()  # orjson: ints of 64 bits only
    if how == "dup":  # a second value for a field, after the first: the last one wins
        field = draw(st.sampled_from(_field_names(kind)))
        data = data[:-1] + b',"' + field.encode() + b'":' + json.dumps(draw(nasty)).encode() + b"}"
    elif how == "bytes":
        data = draw(
            st.sampled_from(
                [
                    data[: len(data) // 2],
                    data + b"x",
                    b" " + data + b"\n",
                    b"[1]",
                    b'"x"',
                    b"3",
                    b"",
                    data[:-1] + b',"unknown_field":' + _DEEP + b"}",
                ]
            )
        )
    return data


@st.composite
def records(draw: Any, kind: str) -> list[bytes]:
    out = []
    for _ in range(draw(st.integers(1, 8))):
        samples = draw(st.lists(STRATEGIES[kind], min_size=1, max_size=4))
        if draw(st.booleans()):
            for m in samples:
                m.node, m.ts = samples[0].node, samples[0].ts  # one node, one instant
                if kind in ("step", "collective"):
                    m.job = samples[0].job
                if kind == "step":
                    m.step = samples[0].step  # type: ignore[attr-defined]
                if kind == "collective":
                    m.comm, m.seq = samples[0].comm, samples[0].seq  # type: ignore[attr-defined]
            messages = batch_messages(samples)
        else:
            messages = samples
        for m in messages:
            out.append(draw(mutated(orjson.loads(encode(m)), kind)))
    return out

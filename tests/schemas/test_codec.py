"""Round trips of every kind and the one error type for every bad input."""

from __future__ import annotations

import json
import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.schemas import (
    MAX_MESSAGE_BYTES,
    MODELS,
    GpuSample,
    SchemaError,
    decode,
    encode,
    from_dict,
    json_schemas,
    parse_message,
)

from .strategies import STRATEGIES, any_message


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_every_kind(kind: str, data: st.DataObject) -> None:
    message = data.draw(STRATEGIES[kind])
    raw = encode(message)
    assert parse_message(raw) == message
    assert decode(raw, kind) == message
    assert parse_message(raw.decode()) == message  # str input too


@settings(max_examples=100, deadline=None)
@given(any_message)
def test_encoding_omits_nulls_and_is_one_json_object(message: object) -> None:
    obj = json.loads(encode(message))  # type: ignore[arg-type]
    assert isinstance(obj, dict)
    assert None not in obj.values()
    assert obj["kind"] in MODELS and obj["v"] == 1


def test_unknown_fields_are_ignored() -> None:
    raw = b'{"kind":"gpu","v":1,"ts":1.5,"node":"n1","gpu":0,"future_field":{"x":[1,2]}}'
    message = parse_message(raw)
    assert isinstance(message, GpuSample)
    assert message.node == "n1" and not hasattr(message, "future_field")


def test_kafka_key_follows_the_contract() -> None:
    gpu = parse_message(b'{"kind":"gpu","ts":1,"node":"n1","job":"j","gpu":0}')
    step = parse_message(
        b'{"kind":"step","ts":1,"node":"n1","job":"j","rank":0,"step":1,"step_s":1.0}'
    )
    job_flag = parse_message(
        b'{"kind":"flag","ts":1,"node":null,"job":"j","id":"x","detector":"d",'
        b'"category":"imbalance","severity":"info","score":1}'
    )
    assert gpu.kafka_key() == b"n1"
    assert step.kafka_key() == b"j"
    assert job_flag.kafka_key() == b"j"


VALID_GPU = {"kind": "gpu", "v": 1, "ts": 1.0, "node": "n1", "gpu": 0}


@pytest.mark.parametrize(
    ("raw", "kind", "field"),
    [
        ({**VALID_GPU, "temp_c": "hot"}, "gpu", "temp_c"),
        ({**VALID_GPU, "gpu": -1}, "gpu", "gpu"),
        ({k: v for k, v in VALID_GPU.items() if k != "node"}, "gpu", "node"),
        ({**VALID_GPU, "ts": "yesterday"}, "gpu", "ts"),
        ({**VALID_GPU, "node": ""}, "gpu", "node"),
        ({**VALID_GPU, "kind": "teapot"}, None, "kind"),
        ({k: v for k, v in VALID_GPU.items() if k != "kind"}, None, "kind"),
        ({"kind": "step", "ts": 1, "node": "n", "rank": 0, "step": 1, "step_s": 1}, "step", "job"),
        (
            {
                "kind": "nic",
                "ts": 1,
                "node": "n",
                "device": "mlx5_0",
                "port": 1,
                "counters": {"a": -1},
            },
            "nic",
            "counters.a",
        ),
        (
            {
                "kind": "flag",
                "ts": 1,
                "id": "x",
                "detector": "d",
                "category": "vibes",
                "severity": "info",
                "score": 1,
            },
            "flag",
            "category",
        ),
        ({"kind": "node_state", "ts": 1, "node": "n", "state": "asleep"}, "node_state", "state"),
        (
            {
                "kind": "collective",
                "ts": 1,
                "node": "n",
                "job": "j",
                "rank": 0,
                "comm": "c",
                "op": "allreduce",
                "seq": 1,
                "bytes": 1,
                "arrive_ts": 1,
                "peers": [{"rank": 1}],
            },
            "collective",
            "peers.0.bytes",
        ),
    ],
)
def test_invalid_fields_are_named(raw: dict[str, object], kind: str | None, field: str) -> None:
    with pytest.raises(SchemaError) as info:
        parse_message(json.dumps(raw))
    assert info.value.kind == kind
    assert info.value.field == field
    assert field.split(".", maxsplit=1)[0] in str(info.value)


def test_nan_and_infinity_are_rejected() -> None:
    with pytest.raises(SchemaError) as info:
        parse_message(b'{"kind":"gpu","ts":1,"node":"n","gpu":0,"temp_c":NaN}')
    assert info.value.kind in (None, "gpu")
    with pytest.raises(SchemaError):
        from_dict({**VALID_GPU, "power_w": float("inf")})


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00garbage",
        '{"kind":"gpu","node":"caf\udce9"}'.encode("utf-8", "surrogateescape"),
        b'{"kind":"gpu","ts":1,"node":"n\xe9","gpu":0}',  # latin-1, not UTF-8
        b"[1,2,3]",
        b"42",
        b"null",
        b'{"kind":"gpu"',
        b'{"kind":7}',
        b'{"kind":"flag","ts":1,"id":"x","detector":"d","category":"anomaly","severity":"info","score":1,"evidence":'
        + b'{"a":' * 300
        + b"1"
        + b"}" * 300
        + b"}",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_garbage_gives_schema_error_and_nothing_else(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        parse_message(raw)
    with pytest.raises(SchemaError):
        decode(raw, "gpu")


def test_ten_megabyte_values_are_refused_before_parsing() -> None:
    huge = orjson.dumps({**VALID_GPU, "node": "x" * (10 << 20)})
    with pytest.raises(SchemaError) as info:
        parse_message(huge)
    assert "limit" in info.value.reason
    big_but_allowed = orjson.dumps({**VALID_GPU, "uuid": "x" * (MAX_MESSAGE_BYTES // 2)})
    with pytest.raises(SchemaError) as info:
        parse_message(big_but_allowed)  # under the byte limit, over the field's length limit
    assert info.value.field == "uuid"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_never_raise_anything_but_schema_error(raw: bytes) -> None:
    _assert_message_or_schema_error(raw)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["kind", "v", "ts", "node", "job", "gpu", "temp_c", "counters", "rank", "step"]
        ),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=5)
        | st.just("gpu"),
    )
)
def test_mutated_objects_never_raise_anything_but_schema_error(obj: dict[str, object]) -> None:
    _assert_message_or_schema_error(json.dumps(obj).encode())


def _assert_message_or_schema_error(raw: bytes) -> None:
    try:
        message = parse_message(raw)
    except SchemaError as exc:  # anything else propagates and fails the test
        assert exc.reason and str(exc).startswith(f"{exc.kind or 'unknown'} message")
    else:
        assert message.kind in MODELS


def test_decode_with_the_wrong_kind_names_the_kind() -> None:
    with pytest.raises(SchemaError) as info:
        decode(b'{"kind":"nic","ts":1,"node":"n","device":"d","port":1}', "gpu")
    assert info.value.kind == "gpu"
    with pytest.raises(SchemaError):
        decode(b"{}", "no-such-kind")


def test_json_schema_of_every_kind() -> None:
    schemas = json_schemas()
    assert set(schemas) == set(MODELS)
    assert "temp_c" in schemas["gpu"]["properties"]
    assert "deg C" in schemas["gpu"]["properties"]["temp_c"]["description"]
    assert set(schemas["step"]["required"]) >= {"ts", "node", "job", "rank", "step", "step_s"}


def _outcome(raw: bytes) -> object:
    try:
        return parse_message(raw)
    except SchemaError as exc:
        # the leading space of the comparison shifts a JSON error's column by one
        return ("error", exc.kind, exc.field, re.sub(r"column \d+", "column _", exc.reason))


@settings(max_examples=150, deadline=None)
@given(
    message=any_message,
    cut=st.integers(0, 400),
    insert=st.sampled_from([b"", b"x", b'"', b"}", b",", b"-1", b'"kind":"flag",', b"\xff"]),
)
def test_kind_first_fast_path_parses_and_refuses_as_the_dispatching_validator(
    message: object, cut: int, insert: bytes
) -> None:
    """A record that starts with its kind goes straight to that kind's model; the same bytes
    behind a leading space take the dispatching validator. Valid or not (a byte inserted
    anywhere, a second ``kind`` key), both must give the same message or the same error."""
    raw = encode(message)  # type: ignore[arg-type]
    at = min(cut, len(raw))
    for data in (raw, raw[:at] + insert + raw[at:]):
        assert data.startswith(b'{"kind":"') or at < 9
        assert _outcome(data) == _outcome(b" " + data)

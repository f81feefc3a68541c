"""The workers' and backtests' decode (guard.schemas.sample_decoder) against pydantic's.

Differential: random valid records of each telemetry kind, single and batched, many of them
broken on purpose (a field set to a value of another type or out of bounds, a field missing,
an unknown or duplicated key, bytes cut or appended, not an object), decoded by both paths:
the same rejections with the same reasons, and the same samples — every field's value and
type (``repr``) and the fields' order.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.schemas import (
    Flag,
    GuardMessage,
    SchemaError,
    batch_messages,
    decode,
    encode,
    parse_message,
    sample_decoder,
)
from guard.schemas.batches import expand
from guard.schemas.codec import MODELS
from guard.schemas.messages import ConnectionStat
from guard.schemas.sample_decoder import FAST_SAMPLE_KINDS, decode_samples, parse_samples

from .strategies import TELEMETRY, records


def _shown(samples: list[GuardMessage]) -> str:
    # every field with its type, in field order, and the nested models' too
    return repr([(type(s).__name__, list(s.__dict__.items())) for s in samples])


def _reference(value: bytes, kind: str) -> tuple[str, str] | str:
    try:
        message = decode(value, kind)
    except SchemaError as exc:
        return str(exc)
    return message.kind, _shown(expand(message))


def _got(value: bytes, kind: str) -> tuple[str, str] | str:
    try:
        record_kind, samples = decode_samples(value, kind)
    except SchemaError as exc:
        return str(exc)
    return record_kind, _shown(samples)


def _parsed(value: bytes, parse: Any) -> str:
    try:
        return _shown(parse(value))
    except SchemaError as exc:
        return str(exc)


@hsettings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(TELEMETRY).flatmap(lambda k: st.tuples(st.just(k), records(k))))
def test_same_samples_and_rejections_as_pydantic(case: tuple[str, list[bytes]]) -> None:
    kind, values = case
    for value in values:
        assert _got(value, kind) == _reference(value, kind)
        assert _parsed(value, parse_samples) == _parsed(value, lambda v: expand(parse_message(v)))


def _struct_samples(value: bytes, kind: str) -> tuple[str, str] | str:
    """:func:`decode_structs`'s record as the samples it stands for (the record's ``ts``,
    ``node`` and ``job`` on each entry, an entry's own ``ts`` where it has one)."""
    from guard.schemas.sample_decoder import decode_structs

    try:
        record_kind, head, entries = decode_structs(value, kind)
    except SchemaError as exc:
        return str(exc)
    shown = []
    for e in entries:
        fields = {f: getattr(e, f) for f in e.__struct_fields__}
        if record_kind == f"{kind}_batch":  # a batch's samples are v 1 (TelemetryBatch.samples)
            fields.update(kind=kind, v=1, node=head.node, job=head.job)
        fields["ts"] = head.ts if fields.get("ts") is None else fields["ts"]
        if fields.get("peers") is not None:  # a collective's connections: models there
            fields["peers"] = [
                p if isinstance(p, ConnectionStat) else ConnectionStat(**msgspec.structs.asdict(p))
                for p in fields["peers"]
            ]
        shown.append((MODELS[kind].__name__, sorted((k, repr(v)) for k, v in fields.items())))
    return record_kind, repr(shown)


def _reference_fields(value: bytes, kind: str) -> tuple[str, str] | str:
    try:
        message = decode(value, kind)
    except SchemaError as exc:
        return str(exc)
    shown = [
        (type(s).__name__, sorted((k, repr(v)) for k, v in s.__dict__.items()))
        for s in expand(message)
    ]
    return message.kind, repr(shown)


@hsettings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(["gpu", "step", "collective"]).flatmap(
        lambda k: st.tuples(st.just(k), records(k))
    )
)
def test_records_as_structs_hold_what_pydantic_accepts(case: tuple[str, list[bytes]]) -> None:
    """The core's GPU, step and collective columns read Structs (no dict per entry): the
    same acceptance, reasons and values as pydantic's samples, valid and broken records
    alike."""
    kind, values = case
    for value in values:
        assert _struct_samples(value, kind) == _reference_fields(value, kind)


def test_every_telemetry_kind_and_its_batch_have_the_fast_path() -> None:
    assert {k for kind in TELEMETRY for k in (kind, f"{kind}_batch")} == FAST_SAMPLE_KINDS


def _pydantic_never_called(monkeypatch: Any) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("a clean record took pydantic")

    monkeypatch.setattr(sample_decoder, "decode", refuse)
    monkeypatch.setattr(sample_decoder, "parse_message", refuse)


def test_clean_records_never_take_pydantic_and_give_the_same_samples(monkeypatch: Any) -> None:
    sim = ClusterSimulator(
        SimConfig(nodes=3, duration_s=40, start_ts=float(int(time.time())), seed=2)
    )
    ticks = list(sim.batches())
    values = [
        (m.kind.removesuffix("_batch"), encode(m))
        for batched in (False, True)
        for tick in ticks
        for m in (batch_messages(tick) if batched else tick)
    ]
    assert {kind for kind, _ in values} == set(TELEMETRY)
    want = [_reference(value, kind) for kind, value in values]
    want_parsed = [_parsed(value, lambda v: expand(parse_message(v))) for _, value in values]
    _pydantic_never_called(monkeypatch)
    assert [_got(value, kind) for kind, value in values] == want
    assert [_parsed(value, parse_samples) for _, value in values] == want_parsed


def test_a_default_factory_gives_each_sample_its_own_value() -> None:
    record = (
        b'{"kind":"nic_batch","ts":5.0,"node":"n1",'
        b'"ports":[{"device":"a","port":1},{"device":"b","port":1}]}'
    )
    _, (first, second) = decode_samples(record, "nic")
    assert first.counters == second.counters == {}  # type: ignore[attr-defined]
    assert first.counters is not second.counters  # type: ignore[attr-defined]


def test_a_record_the_fast_path_refuses_gets_pydantics_reason() -> None:
    cases = {
        # a batch without its kind is a single record, which lacks the single's fields
        b'{"ts":5.0,"node":"n1","gpus":[{"gpu":0}],"x":"y_batch\\""}': "gpu",
        # a counter above msgspec's largest bound but within the contract's: accepted
        b'{"kind":"nic","ts":5.0,"node":"n1","device":"d","port":1,'
        b'"counters":{"c":18446744073709551615}}': "nic",
        # lax pydantic takes a float that is an integer, msgspec does not: accepted
        b'{"kind":"gpu","ts":5.0,"node":"n1","gpu":3.0}': "gpu",
        b'{"kind":"gpu","ts":5.0,"node":"n1","gpu":0,"temp_c":1e400}': "gpu",
        b'{"kind":"step","ts":5.0,"node":"n1","job":"j","rank":0,"step":1,"step_s":"slow"}': "step",
        b'{"kind":"gpu_batch","ts":5.0,"node":"n1","gpus":[]}': "gpu",
    }
    for value, kind in cases.items():
        assert _got(value, kind) == _reference(value, kind), value
    _, [sample] = decode_samples(next(iter(v for v in cases if b"1844" in v)), "nic")
    assert sample.counters == {"c": 2**64 - 1}  # type: ignore[attr-defined]


def test_other_kinds_parse_as_before() -> None:
    flag = Flag(ts=1e9, node="n1", id="f1", detector="thermal", category="thermal",
                severity="warning", score=2.5, evidence={"temp_c": 93})  # fmt: skip
    assert _parsed(encode(flag), parse_samples) == _shown([flag])
    assert _parsed(b"\n", parse_samples) == _parsed(b"\n", parse_message)


def test_pydantic_parses_as_deep_as_the_fast_path_admits() -> None:
    # the fast path skips an unknown field however deep; pydantic refuses beyond its limit,
    # so records with more than MAX_BRACKETS brackets take pydantic: the limit must hold
    depth = sample_decoder.MAX_BRACKETS
    deep = b"[" * (depth - 3) + b"1" + b"]" * (depth - 3)
    value = b'{"kind":"gpu_batch","ts":5.0,"node":"n1","gpus":[{"gpu":0,"u":' + deep + b"}]}"
    assert value.count(b"[") + value.count(b"{") == depth
    assert _got(value, "gpu") == _reference(value, "gpu")
    assert isinstance(_reference(value, "gpu"), tuple)  # pydantic parses it


_JSON_NUMBER = r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,30})?([eE][-+]?[0-9]{1,3})?"


@hsettings(max_examples=500, deadline=None)
@given(st.from_regex(_JSON_NUMBER, fullmatch=True))
def test_numbers_become_the_same_values(number: str) -> None:
    # two JSON parsers: the same float (or int) for every literal, or both refuse it
    raw = number.encode()
    for value, kind in (
        (b'{"kind":"gpu","ts":5.0,"node":"n","gpu":0,"temp_c":' + raw + b"}", "gpu"),
        (
            b'{"kind":"step","ts":5.0,"node":"n","job":"j","rank":0,"step":1,"step_s":'
            + raw
            + b"}",
            "step",
        ),
        (b'{"kind":"gpu","ts":5.0,"node":"n","gpu":' + raw + b"}", "gpu"),
    ):
        assert _got(value, kind) == _reference(value, kind), value


def test_name_lengths_count_characters_as_pydantic_does() -> None:
    for char in ("é", "😀", "\u0301", "\\u00e9", "\\ud83d\\ude00"):
        for n in (252, 253, 254):
            value = ('{"kind":"gpu","ts":5.0,"node":"' + char * n + '","gpu":0}').encode()
            assert _got(value, "gpu") == _reference(value, "gpu"), (char, n)


def test_a_counter_name_longer_than_the_contract_allows_is_refused_as_pydantic_does() -> None:
    """The fast path decodes counter names as plain strings (a constrained key costs msgspec
    ~4x) and checks their length after: 128 characters pass, 129 are pydantic's refusal."""
    from guard.schemas.sample_decoder import decode_rows

    for length, ok in ((128, True), (129, False)):
        name = ("c" * length).encode()
        single = b'{"kind":"nic","ts":5.0,"node":"n1","device":"d","port":1,"counters":{"' + name
        single += b'":1,"symbol_error":0}}'
        batch = b'{"kind":"nic_batch","ts":5.0,"node":"n1","ports":[{"device":"d","port":1},'
        batch += b'{"device":"d","port":2,"counters":{"symbol_error":0,"' + name + b'":1}}]}'
        for value in (single, batch):
            assert _got(value, "nic") == _reference(value, "nic"), value
            got = _got(value, "nic")
            assert (not isinstance(got, str)) == ok, got
            if ok:
                assert decode_rows(value, "nic")[2][-1]["counters"][name.decode()] == 1
            else:
                with pytest.raises(SchemaError, match="counters"):
                    decode_rows(value, "nic")


def test_known_counter_names_do_not_let_a_long_one_through_and_new_names_are_bounded() -> None:
    """Counter names found short are remembered (a port's names repeat in every sample, so
    most records are checked with one set operation): a record of known names beside a
    long one is still refused, and a stream of new names does not grow the memory past its
    bound."""
    from guard.schemas import sample_decoder
    from guard.schemas.sample_decoder import decode_rows

    def record(names: list[str]) -> bytes:
        counters = ",".join(f'"{n}":1' for n in names)
        return (
            b'{"kind":"nic_batch","ts":5.0,"node":"n1","ports":[{"device":"d","port":1,'
            b'"counters":{' + counters.encode() + b"}}]}"
        )

    known = ["symbol_error", "port_xmit_wait"]
    assert decode_rows(record(known), "nic")[2][0]["counters"] == dict.fromkeys(known, 1)
    with pytest.raises(SchemaError, match="counters"):
        decode_rows(record([*known, "x" * 129]), "nic")
    for k in range(sample_decoder._SHORT_KEYS_MAX // 50 + 2):
        decode_rows(record([f"vendor_counter_{k}_{j}" for j in range(50)]), "nic")
    assert all(
        len(v) <= sample_decoder._SHORT_KEYS_MAX for v in sample_decoder._SHORT_KEYS.values()
    )
    with pytest.raises(SchemaError, match="counters"):  # still checked once the memory is full
        decode_rows(record(["y" * 129, "vendor_counter_0_0"]), "nic")

"""The sink's decode (guard.schemas.rows) against guard.schemas.decode and the tables' rows.

Differential: random valid records of each telemetry kind, single and batched, many of them
broken on purpose (a field set to a value of another type or out of bounds, a field missing,
an unknown or duplicated key, bytes cut or appended, not an object), decoded by both paths:
the same rejections with the same reasons, and the same rows, value for value and type for
type (``repr``), in the same order.
"""

from __future__ import annotations

import time
from typing import Any

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.schemas import Flag, SchemaError, batch_messages, decode, encode
from guard.schemas.batches import expand
from guard.schemas.rows import FAST_KINDS, decode_columns
from guard.schemas.tables import TABLE_BY_KIND

from .strategies import TELEMETRY, records


def reference(values: list[bytes], kind: str) -> tuple[list[list[Any]], list[tuple[int, str]]]:
    """What the sink stored before: decode each record, expand batches, the table's columns."""
    messages, rejected = [], []
    for i, value in enumerate(values):
        try:
            messages += expand(decode(value, kind))
        except SchemaError as exc:
            rejected.append((i, str(exc)))
    return TABLE_BY_KIND[kind].column_data(messages), rejected


def _same(values: list[bytes], kind: str) -> None:
    want_columns, want_rejected = reference(values, kind)
    got = decode_columns(values, kind)
    assert [(i, str(exc)) for i, exc in got.rejected] == want_rejected
    assert got.rows == (len(want_columns[0]) if want_columns else 0)
    assert repr(got.columns) == repr(want_columns)


@hsettings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(TELEMETRY).flatmap(lambda k: st.tuples(st.just(k), records(k))))
def test_same_rows_and_rejections_as_the_pydantic_path(case: tuple[str, list[bytes]]) -> None:
    kind, values = case
    _same(values, kind)  # a run of records, clean and broken mixed
    for value in values:  # and each alone: a run of one
        _same([value], kind)


def test_every_telemetry_kind_has_the_fast_path() -> None:
    assert set(TELEMETRY) == FAST_KINDS


def test_clean_records_never_take_pydantic_and_give_the_same_rows() -> None:
    sim = ClusterSimulator(
        SimConfig(nodes=3, duration_s=40, start_ts=float(int(time.time())), seed=2)
    )
    ticks = list(sim.batches())
    for batched in (False, True):
        by_kind: dict[str, list[bytes]] = {}
        for tick in ticks:
            for m in batch_messages(tick) if batched else tick:
                kind = m.kind.removesuffix("_batch")
                by_kind.setdefault(kind, []).append(encode(m))
        assert set(by_kind) == set(TELEMETRY)
        for kind, values in by_kind.items():
            got = decode_columns(values, kind)
            assert got.slow == 0 and not got.rejected, kind
            want, _ = reference(values, kind)
            assert repr(got.columns) == repr(want)


def test_one_bad_record_is_rejected_with_its_reason_and_the_rest_kept() -> None:
    sim = ClusterSimulator(SimConfig(nodes=1, duration_s=20, start_ts=float(int(time.time()))))
    good = [encode(m) for tick in sim.batches() for m in tick if m.kind == "gpu"]
    bad = b'{"kind":"gpu","ts":1e9,"node":"n1","gpu":"zero"}'
    assert len(good) > 3
    values = [*good[:3], bad, *good[3:]]
    got = decode_columns(values, "gpu")
    assert got.rows == len(good) and got.slow == 1
    [(index, exc)] = got.rejected
    assert index == 3
    assert exc.field == "gpu" and "valid integer" in exc.reason


def test_kinds_without_a_fast_path_take_pydantic() -> None:
    flag = Flag(ts=1e9, node="n1", id="f1", detector="thermal", category="thermal",
                severity="warning", score=2.5, evidence={"temp_c": 93})  # fmt: skip
    got = decode_columns([encode(flag), b"{}"], "flag")
    assert got.rows == 1 and got.slow == 2 and [i for i, _ in got.rejected] == [1]
    assert repr(got.columns) == repr(TABLE_BY_KIND["flag"].column_data([flag]))

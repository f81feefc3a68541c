"""Telemetry records straight to table columns: the sink's decode, without a model per row.

:func:`guard.schemas.decode` builds a pydantic model of every record (and the sink then one
model per sample of a batch, :meth:`TelemetryBatch.samples`) only to read its fields into
columns. :func:`decode_columns` goes from the records' bytes to the columns of their table:
orjson parses a run of records, and each field is checked for a whole run at once, a column
at a time, against the constraints of the same pydantic models (read from them, not
restated). A batch's entries become rows directly.

Acceptance is pydantic's: the fast path vouches only for values whose validation is the
identity (an exact ``int``, ``str``, ``bool`` or ``float`` inside the field's bounds, a JSON
integer in a float field, which pydantic makes ``float``; no unknown field anywhere). A run
with anything else — a string where a number goes, a missing field, an unknown key, a
number orjson cannot read — is decoded record by record, and a record the fast path still
cannot vouch for goes through :func:`guard.schemas.decode`: its rows, or its
:class:`SchemaError` (field and reason) to dead-letter. The stored rows are the same either
way (tests/schemas/test_rows.py checks both paths on random valid and invalid records).

Kinds without a fast path here (flags, sweeps, node states, advice: few records, nested
free-form fields) take :func:`guard.schemas.decode` for every record.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby, islice, repeat
from typing import Any, get_args, get_origin

import orjson
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .batches import BATCH_MODEL_OF_KIND, BATCH_OF, TelemetryBatch
from .codec import MAX_MESSAGE_BYTES, MODELS, SchemaError, decode
from .constraints import bounds, check_plain_model, unwrap
from .messages import GuardMessage
from .tables import TABLE_BY_KIND, Table, micros

__all__ = ["FAST_KINDS", "Decoded", "decode_columns"]

_NONE = type(None)
_loads = orjson.loads
_get = dict.get
#: Largest float the fast path takes as is: beyond 2**53 a JSON integer orjson reads as a
#: float could round otherwise than pydantic's int-then-float (such a record takes pydantic).
_FLOAT_CAP = float(2**53)


class _Missing:
    """A required field that a record lacks (no check allows its type)."""


_MISSING = _Missing()


class _Slow(Exception):
    """The fast path cannot vouch for these values: pydantic decides."""


@dataclass
class Decoded:
    """Rows of one run of records: ``columns`` in the table's column order, ``rows`` long;
    ``rejected``: (index of the record, why) for each record that is not a valid message;
    ``slow``: how many records pydantic decided (clean telemetry: none)."""

    table: Table
    rows: int
    columns: list[list[Any]]
    rejected: list[tuple[int, SchemaError]]
    slow: int = 0


# -- field checks read from the models ------------------------------------------------------


Check = Callable[[list[Any]], list[Any]]


def _typed(col: list[Any], allowed: set[type]) -> tuple[set[type], list[Any]]:
    """The types in ``col`` (all of them ``allowed``, else _Slow) and its values but None."""
    kinds = set(map(type, col))
    if not kinds <= allowed:
        raise _Slow
    return kinds, [x for x in col if x is not None] if _NONE in kinds else col


def _number_check(base: type, optional: bool, b: dict[str, Any]) -> Check:
    allowed: set[type] = {int, float} if base is float else {int}
    if optional:
        allowed.add(_NONE)
    lo, hi = b.get("ge"), b.get("le")
    gt, lt = b.get("gt"), b.get("lt")
    if base is float:
        hi = _FLOAT_CAP if hi is None else min(hi, _FLOAT_CAP)
        lo = -_FLOAT_CAP if lo is None and gt is None else lo

    def check(col: list[Any]) -> list[Any]:
        kinds, values = _typed(col, allowed)
        if values:
            low, high = min(values), max(values)
            if (lo is not None and low < lo) or (hi is not None and high > hi):
                raise _Slow
            if (gt is not None and low <= gt) or (lt is not None and high >= lt):
                raise _Slow
        if base is float and int in kinds:  # pydantic makes a JSON integer a float
            return [float(x) if type(x) is int else x for x in col]
        return col

    return check


def _str_check(optional: bool, b: dict[str, Any], str_max: int | None) -> Check:
    allowed: set[type] = {str, _NONE} if optional else {str}
    # the stricter of the field's and the model's limits: stricter than pydantic is safe
    longest = min(x for x in (b.get("max_length"), str_max, 1 << 62) if x is not None)
    shortest = b.get("min_length", 0)

    def check(col: list[Any]) -> list[Any]:
        _, values = _typed(col, allowed)
        if values:
            lengths = list(map(len, values))
            if min(lengths) < shortest or max(lengths) > longest:
                raise _Slow
        return col

    return check


def _bool_check(optional: bool) -> Check:
    allowed = {bool, _NONE} if optional else {bool}

    def check(col: list[Any]) -> list[Any]:
        if not set(map(type, col)) <= allowed:
            raise _Slow
        return col

    return check


def _dict_check(annotation: Any, b: dict[str, Any]) -> Check:
    key, value = get_args(annotation)
    key_base, _, key_meta = unwrap(key)
    value_base, _, value_meta = unwrap(value)
    if key_base is not str or value_base is not int:
        raise TypeError(f"unsupported mapping {annotation!r}")
    key_longest = bounds(key_meta).get("max_length")
    values_check = _number_check(int, False, bounds(value_meta))
    longest = b.get("max_length")

    def check(col: list[Any]) -> list[Any]:
        if set(map(type, col)) != {dict} or (longest is not None and max(map(len, col)) > longest):
            raise _Slow
        keys = list(chain.from_iterable(col))
        if keys and key_longest is not None and max(map(len, keys)) > key_longest:
            raise _Slow
        values_check(list(chain.from_iterable(map(dict.values, col))))
        return col

    return check


def _list_check(annotation: Any, optional: bool, b: dict[str, Any]) -> Check:
    """A list of nested models; the column becomes lists of the models' field tuples."""
    (model,) = get_args(annotation)
    spec = _Spec.of(model)
    shortest, longest = b.get("min_length", 0), b.get("max_length")
    allowed = {list, _NONE} if optional else {list}

    def check(col: list[Any]) -> list[Any]:
        if not set(map(type, col)) <= allowed:
            raise _Slow
        lists = [x or () for x in col]
        lengths = list(map(len, lists))
        if min(lengths) < shortest or (longest is not None and max(lengths) > longest):
            raise _Slow
        items = list(chain.from_iterable(lists))
        if not items:
            return [[] for _ in col]
        columns = spec.columns(items, spec.names)
        rows = iter(zip(*columns, strict=True))
        return [list(islice(rows, n)) for n in lengths]

    return check


def _field_check(info: FieldInfo, str_max: int | None) -> Check:
    base, optional, inner = unwrap(info.annotation)
    b = bounds([*info.metadata, *inner])
    if base in (int, float):
        return _number_check(base, optional, b)
    if base is str:
        return _str_check(optional, b, str_max)
    if base is bool:
        return _bool_check(optional)
    if get_origin(base) is dict:
        return _dict_check(base, b)
    if get_origin(base) is list and issubclass(get_args(base)[0], BaseModel):
        return _list_check(base, optional, b)
    raise TypeError(f"unsupported field type {info.annotation!r}")


@dataclass(frozen=True)
class _Spec:
    """How to check every field of one model: its names, defaults and column checks."""

    names: tuple[str, ...]
    keys: frozenset[str]  # the fields a record may carry (an unknown one: pydantic decides)
    defaults: dict[str, Any]
    checks: dict[str, Check]
    #: every field: its default, or _MISSING (of a type no check allows) for a required one
    template: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.template.update({n: self.defaults.get(n, _MISSING) for n in self.names})

    @classmethod
    def of(cls, model: type[BaseModel], skip: tuple[str, ...] = ()) -> _Spec:
        check_plain_model(model)
        str_max = model.model_config.get("str_max_length")
        names, defaults, checks = [], {}, {}
        for name, info in model.model_fields.items():
            if name in skip:
                continue
            names.append(name)
            if not info.is_required():
                factory = info.default_factory
                defaults[name] = factory() if factory is not None else info.default  # type: ignore[call-arg]
            checks[name] = _field_check(info, str_max)
        return cls(tuple(names), frozenset(model.model_fields), defaults, checks)

    def columns(self, records: list[Any], names: Sequence[str]) -> list[list[Any]]:
        """The columns ``names`` of ``records`` (dicts from orjson), every field of the
        model checked (stored or not), or _Slow."""
        if not records or set(map(type, records)) != {dict}:
            raise _Slow
        if not set().union(*records) <= self.keys:
            raise _Slow
        template = self.template  # a required field's default: _MISSING
        checked = {
            name: self.checks[name](list(map(_get, records, repeat(name), repeat(template[name]))))
            for name in self.names
        }
        return [checked[name] for name in names]


# -- per kind: records to the columns of its table ------------------------------------------


_HEAD = ("v", "ts", "node", "job")


class _Kind:
    """The fast path of one telemetry kind and its batch kind."""

    def __init__(self, kind: str) -> None:
        self.kind, self.batch_kind = kind, BATCH_OF[kind]
        self.table = TABLE_BY_KIND[kind]
        single = MODELS[kind]
        batch = BATCH_MODEL_OF_KIND[self.batch_kind]
        entries = batch.model_fields[batch.entries_field].annotation
        entry: type[BaseModel] = get_args(entries)[0]
        self.entries_field = batch.entries_field
        self.single = _Spec.of(single, skip=("kind",))
        self.batch = _Spec.of(batch, skip=("kind", batch.entries_field))
        if set(self.batch.names) != set(_HEAD):
            raise TypeError(f"{batch.__name__}: fields beyond the common ones")
        self.entries_check = _list_len_check(batch.model_fields[batch.entries_field])
        self.entry = _Spec.of(entry)
        own = [c.name for c in self.table.columns if c.name not in ("ts", "node", "job", "v")]
        if set(own) - set(self.entry.names) or not {"ts", "node", "job", "v"} <= set(
            self.single.names
        ):
            raise TypeError(f"{kind}: table columns that are not fields")
        self.names = [c.name for c in self.table.columns]
        self.own = own
        self.converts = [_raw_convert(self.table, c.name) for c in self.table.columns]

    def singles(self, records: list[Any]) -> list[list[Any]]:
        kinds = list(map(_get, records, repeat("kind"), repeat(self.kind)))
        if kinds.count(self.kind) != len(kinds):
            raise _Slow
        return self._converted(self.single.columns(records, self.names))

    def batches(self, records: list[Any]) -> list[list[Any]]:
        if list(map(_get, records, repeat("kind"))).count(self.batch_kind) != len(records):
            raise _Slow
        _v, ts, node, job = self.batch.columns(records, _HEAD)  # v checked, not stored
        lists = self.entries_check(list(map(_get, records, repeat(self.entries_field))))
        lengths = list(map(len, lists))
        items = list(chain.from_iterable(lists))
        own = self.entry.columns(items, ["ts", *self.own])
        entry_ts, values = own[0], dict(zip(self.own, own[1:], strict=True))
        batch_ts = list(chain.from_iterable(map(repeat, ts, lengths)))
        values["ts"] = [b if e is None else e for e, b in zip(entry_ts, batch_ts, strict=True)]
        values["node"] = list(chain.from_iterable(map(repeat, node, lengths)))
        values["job"] = list(chain.from_iterable(map(repeat, job, lengths)))
        values["v"] = [1] * len(items)  # a batch's samples are v1 (TelemetryBatch.samples)
        return self._converted([values[name] for name in self.names])

    def _converted(self, columns: list[list[Any]]) -> list[list[Any]]:
        out = []
        for col, conv in zip(columns, self.converts, strict=True):
            if conv is micros:  # micros() inline: round(ts * 1_000_000), None stays None
                col = [None if t is None else round(t * 1_000_000) for t in col]  # noqa: PLW2901
            elif conv is not None:
                col = list(map(conv, col))  # noqa: PLW2901
            out.append(col)
        return out


def _list_len_check(info: FieldInfo) -> Check:
    b = bounds(info.metadata)
    shortest, longest = b.get("min_length", 0), b.get("max_length")

    def check(col: list[Any]) -> list[Any]:
        if set(map(type, col)) != {list}:
            raise _Slow
        lengths = list(map(len, col))
        if min(lengths) < shortest or (longest is not None and max(lengths) > longest):
            raise _Slow
        return col

    return check


def _raw_convert(table: Table, name: str) -> Callable[[Any], Any] | None:
    """The conversion of column ``name`` from checked values: the table's own where it reads
    plain values (timestamps); nested models are already their field tuples here."""
    column = next(c for c in table.columns if c.name == name)
    if column.convert is None or column.convert is micros:
        return column.convert
    if table.kind == "collective" and name == "peers":
        return None  # _list_check made each peer (rank, bytes, duration_s), the table's tuple
    raise TypeError(f"{table.name}.{name}: a conversion the fast path does not know")


def _kinds() -> dict[str, _Kind]:
    out = {}
    for kind in BATCH_OF:
        try:
            out[kind] = _Kind(kind)
        except TypeError:  # a schema this module cannot check: that kind takes pydantic
            continue
    return out


_KINDS = _kinds()
#: The kinds (and their batches) decoded without pydantic models when their records are clean.
FAST_KINDS: frozenset[str] = frozenset(_KINDS)


# -- the entry point ------------------------------------------------------------------------


def decode_columns(values: Sequence[bytes], kind: str) -> Decoded:
    """The rows of ``values`` (records of one topic, whose messages are ``kind`` or its
    batch kind) as columns of ``kind``'s table, in record order, with the rejected records.
    The same rows and the same rejections as :func:`guard.schemas.decode` of each record
    (a batch: its samples) and :meth:`Table.column_data`."""
    fast = _KINDS.get(kind)
    if fast is None:
        return _by_pydantic(values, range(len(values)), kind, TABLE_BY_KIND[kind])
    out = Decoded(fast.table, 0, [[] for _ in fast.table.columns], [])
    try:
        if max(map(len, values), default=0) > MAX_MESSAGE_BYTES:
            raise _Slow
        records = list(map(_loads, values))
        batch = list(map(_get, records, repeat("kind")))
    except (_Slow, orjson.JSONDecodeError, TypeError):  # TypeError: a record is no object
        for i, value in enumerate(values):
            _append(out, _one(fast, value, i, kind))
        return out
    start = 0
    for is_batch, run in groupby(
        map(operator.eq, batch, repeat(fast.batch_kind))
    ):  # runs: record order
        end = start + len(list(run))
        try:
            part = fast.batches if is_batch else fast.singles
            columns = part(records[start:end])
            _append(out, Decoded(fast.table, len(columns[0]), columns, []))
        except _Slow:  # record by record: the clean ones still fast, the rest by pydantic
            for i in range(start, end):
                _append(out, _one(fast, values[i], i, kind))
        start = end
    return out


def _append(out: Decoded, more: Decoded) -> None:
    out.rejected += more.rejected
    out.slow += more.slow
    if more.rows:
        for col, values in zip(out.columns, more.columns, strict=True):
            col.extend(values)
        out.rows += more.rows


def _one(fast: _Kind, value: bytes, index: int, kind: str) -> Decoded:
    try:
        if len(value) > MAX_MESSAGE_BYTES:
            raise _Slow
        record = _loads(value)
        if type(record) is not dict:
            raise _Slow
        columns = (
            fast.batches([record])
            if _get(record, "kind") == fast.batch_kind
            else fast.singles([record])
        )
        return Decoded(fast.table, len(columns[0]), columns, [])
    except (_Slow, orjson.JSONDecodeError):
        return _by_pydantic([value], [index], kind, fast.table)


def _by_pydantic(
    values: Sequence[bytes], indexes: Sequence[int], kind: str, table: Table
) -> Decoded:
    messages: list[GuardMessage] = []
    rejected: list[tuple[int, SchemaError]] = []
    for value, index in zip(values, indexes, strict=True):
        try:
            message = decode(value, kind)
        except SchemaError as exc:
            rejected.append((index, exc))
            continue
        if isinstance(message, TelemetryBatch):
            messages += message.samples()
        else:
            messages.append(message)
    return Decoded(table, len(messages), table.column_data(messages), rejected, len(values))

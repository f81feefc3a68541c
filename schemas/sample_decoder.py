"""Telemetry records straight to sample models, through msgspec's validating JSON decoder.

:func:`guard.schemas.decode` validates a record with pydantic-core into its model: for a
batch, a model of the batch and one of each entry, after which
:meth:`~guard.schemas.batches.TelemetryBatch.samples` builds one sample model per entry —
≈4–6 µs a sample, three to four times what orjson alone takes to parse it. The detectors
need the samples, not the batch. :func:`decode_samples` decodes the record with msgspec
against typed dicts generated from the same pydantic models (types and constraints read from
them, not restated) and builds each sample model once from the result (≈1.5–3 µs a sample;
`benchmarks/processing_core.py` prints both).

Acceptance is pydantic's. The generated types accept a subset of what the models accept,
with the same values: JSON integers in float fields become floats, unknown fields are
dropped, a duplicated key's last value wins, nothing that is not finite gets through. Where
msgspec cannot say what pydantic says, the generated type is stricter (integers above
2**63 - 1, msgspec's largest bound, are refused; a string, a bool or a float where pydantic's
lax mode takes an integer is refused), and a record the fast path refuses goes through
:func:`guard.schemas.decode`: its samples, or its :class:`SchemaError` with pydantic's
reason. tests/schemas/test_sample_decoder.py compares both on random valid and broken
records. A model this module cannot express (a validator, an alias, a constraint it does
not know) has no fast path: its records take pydantic only.

Example
-------
>>> from guard.schemas import GpuSample, batch_messages, encode
>>> singles = [GpuSample(ts=10.0, node="n1", gpu=i, temp_c=60.0 + i) for i in range(2)]
>>> [record] = [encode(m) for m in batch_messages(singles)]
>>> kind, samples = decode_samples(record, "gpu")
>>> kind, [s.model_dump() == m.model_dump() for s, m in zip(samples, singles)]
('gpu_batch', [True, True])
>>> decode_samples(b'{"kind":"gpu","ts":1.0,"node":"n1","gpu":"zero"}', "gpu")
Traceback (most recent call last):
guard.schemas.codec.SchemaError: gpu message, field 'gpu': Input should be a valid integer, ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Optional,
    Required,
    TypedDict,
    get_args,
    get_origin,
)

import msgspec
from pydantic import BaseModel

from .batches import BATCH_MODEL_OF_KIND, BATCH_OF, expand
from .codec import (
    _BATCH_MARK,
    MAX_MESSAGE_BYTES,
    MODELS,
    SchemaError,
    decode,
    leading_kind,
    parse_message,
)
from .constraints import bounds, check_plain_model, unwrap
from .fast import fast_builder
from .messages import GuardMessage

__all__ = [
    "FAST_SAMPLE_KINDS",
    "STRUCT_KINDS",
    "Rows",
    "decode_rows",
    "decode_samples",
    "decode_structs",
    "parse_samples",
    "record_ts",
    "structs_of",
]

#: msgspec's integer bounds must fit an int64: a larger bound becomes this (stricter: safe)
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
#: what msgspec raises for bad input; ValueError and RecursionError: its parser's limits
_REFUSED = (msgspec.DecodeError, ValueError, RecursionError)
#: pydantic refuses JSON nested deeper than 200 (jiter's limit), msgspec skips an unknown
#: field however deep: a record with more brackets than this (so maybe deeper) takes pydantic
MAX_BRACKETS = 190

Samples = list[GuardMessage]
#: (record kind, common fields, entries) of a record: see :func:`decode_rows` (dicts) and
#: :func:`decode_structs` (Structs, read by attribute)
Rows = tuple[str, Any, list[Any]]


def _int_type(b: dict[str, Any]) -> Any:
    meta = {}
    for name, value in b.items():
        if name in ("ge", "gt"):
            if value < _INT64_MIN:
                raise TypeError(f"integer bound {value} below msgspec's")
            meta[name] = value
        elif name in ("le", "lt"):
            meta[name] = min(value, _INT64_MAX)
        else:
            raise TypeError(f"integer constraint {name!r}")
    return Annotated[int, msgspec.Meta(**meta)] if meta else int


def _wire_type(base: Any, b: dict[str, Any], str_max: int | None) -> Any:
    """The msgspec type of a field's base type with bounds ``b``; TypeError if none fits."""
    if base is bool:
        if b:
            raise TypeError("a constrained bool")
        return bool
    if base is int:
        return _int_type(b)
    if base is float:
        return Annotated[float, msgspec.Meta(**b)] if b else float
    if base is str:
        meta = {"min_length": b.get("min_length", 0)}
        longest = [x for x in (b.get("max_length"), str_max) if x is not None]
        if longest:  # the stricter of the field's and the model's limits
            meta["max_length"] = min(longest)
        return Annotated[str, msgspec.Meta(**meta)]
    if get_origin(base) is Literal:
        if b or not all(isinstance(x, str) for x in get_args(base)):
            raise TypeError(f"unsupported literal {base!r}")
        return base
    if get_origin(base) is dict:
        key, value = get_args(base)
        key_base, key_optional, key_meta = unwrap(key)
        value_base, value_optional, value_meta = unwrap(value)
        if key_base is not str or key_optional or value_optional:
            raise TypeError(f"unsupported mapping {base!r}")
        key_bounds = bounds(key_meta)
        if set(key_bounds) - {"min_length", "max_length"} or key_bounds.get("min_length", 0):
            raise TypeError(f"unsupported key constraints {key_bounds!r}")
        # msgspec checks a constrained key ~4x slower than a plain one (a NIC sample's
        # counters cost 12 us instead of 2): keys are plain here, their length is checked
        # after the decode (:func:`_long_keys`), with the model's limit
        value_type = _wire_type(value_base, bounds(value_meta), str_max)
        return _sized(dict[str, value_type], b)  # type: ignore[valid-type]
    if get_origin(base) is list:
        (item,) = get_args(base)
        if not (isinstance(item, type) and issubclass(item, BaseModel)):
            raise TypeError(f"unsupported list {base!r}")
        return _sized(list[_typed_dict(item)], b)  # type: ignore[misc]
    raise TypeError(f"unsupported field type {base!r}")


def _sized(container: Any, b: dict[str, Any]) -> Any:
    meta = {k: v for k, v in b.items() if k in ("min_length", "max_length")}
    if set(b) - set(meta):
        raise TypeError(f"unsupported constraints {b!r} on {container!r}")
    return Annotated[container, msgspec.Meta(**meta)] if meta else container


_TYPED_DICTS: dict[type[BaseModel], Any] = {}


def _typed_dict(model: type[BaseModel]) -> Any:
    """A TypedDict that msgspec decodes as ``model`` validates (required fields Required)."""
    if model in _TYPED_DICTS:
        return _TYPED_DICTS[model]
    check_plain_model(model)
    if model.model_config.get("allow_inf_nan", True) is not False:
        raise TypeError(f"{model.__name__}: allows inf and nan (msgspec never gives them)")
    str_max = model.model_config.get("str_max_length")
    fields: dict[str, Any] = {}
    limits: list[tuple[str, int]] = []
    for name, info in model.model_fields.items():
        base, optional, inner = unwrap(info.annotation)
        if get_origin(base) is dict:
            longest = [
                x
                for x in (bounds(unwrap(get_args(base)[0])[2]).get("max_length"), str_max)
                if x is not None
            ]
            if longest:
                limits.append((name, min(longest)))
        wire = _wire_type(base, bounds([*info.metadata, *inner]), str_max)
        if optional:
            wire = Optional[wire]  # noqa: UP045 (a runtime type for msgspec, not an annotation)
        fields[name] = Required[wire] if info.is_required() else NotRequired[wire]
    out = TypedDict(f"{model.__name__}Wire", fields, total=False)  # type: ignore[misc]
    _TYPED_DICTS[model] = out
    KEY_LIMITS[model] = limits
    return out


#: each model's mapping fields whose keys have a longest length: (field, limit)
KEY_LIMITS: dict[type[BaseModel], list[tuple[str, int]]] = {}


#: keys already found no longer than a limit, per limit: a mapping whose keys are all known
#: is checked with one set operation (a NIC port's counters are the same few names in every
#: sample); bounded, so a stream of new names costs the length check, not memory
_SHORT_KEYS: dict[int, set[str]] = {}
_SHORT_KEYS_MAX = 4096


def _long_keys(entries: list[dict[str, Any]], limits: list[tuple[str, int]]) -> None:
    """ValueError if a mapping field of an entry has a key longer than its limit (the key
    check msgspec's decode left out; see :func:`_wire_type`)."""
    for name, limit in limits:
        known = _SHORT_KEYS.setdefault(limit, set())
        for entry in entries:
            mapping = entry.get(name)
            if not mapping or known.issuperset(mapping):
                continue
            if max(map(len, mapping)) > limit:
                raise ValueError(f"a key of {name} longer than {limit}")
            if len(known) + len(mapping) <= _SHORT_KEYS_MAX:
                known.update(mapping)


class _ModelBuilder:
    """Builds a model from a dict msgspec decoded against its TypedDict: the missing fields
    get their defaults (a fresh one from a default factory), nested models are built too."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.build: Callable[[dict[str, Any]], Any] = fast_builder(model)
        self.template: dict[str, Any] = {}
        self.factories: list[tuple[str, Callable[[], Any]]] = []
        self.nested: list[tuple[str, _ModelBuilder]] = []
        for name, info in model.model_fields.items():
            factory = info.default_factory
            if factory is not None:
                self.factories.append((name, factory))  # type: ignore[arg-type]
                self.template[name] = _FROM_FACTORY
            else:
                self.template[name] = info.default  # a required one: always in the record
            base, _, _ = unwrap(info.annotation)
            if get_origin(base) is list:
                (item,) = get_args(base)
                self.nested.append((name, _ModelBuilder(item)))

    def complete(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` (every field present, in field order) made ready for ``build``."""
        for name, factory in self.factories:
            if data[name] is _FROM_FACTORY:
                data[name] = factory()
        for name, builder in self.nested:
            items = data[name]
            if items:
                template, build = builder.template, builder.build
                if builder.factories or builder.nested:
                    complete = builder.complete
                    data[name] = [build(complete({**template, **item})) for item in items]
                else:  # e.g. a collective's peers: nothing to complete
                    data[name] = [build({**template, **item}) for item in items]
        return data


#: stands for a default made by a factory, until :meth:`_ModelBuilder.complete` makes it
_FROM_FACTORY: Any = object()


_STRUCTS: dict[type[BaseModel], Any] = {}


def _struct(model: type[BaseModel]) -> Any:
    """A msgspec Struct that decodes as ``model`` validates, for kinds whose detectors read
    fields by attribute into columns (no dict per entry): the same wire types and bounds as
    :func:`_typed_dict`; an absent optional field is its default. A model with a default
    factory, or a mapping whose keys have a longest length, has none (TypeError)."""
    if model in _STRUCTS:
        return _STRUCTS[model]
    _typed_dict(model)  # the same checks, and the key limits
    if KEY_LIMITS[model]:
        raise TypeError(f"{model.__name__}: mapping keys with a longest length")
    str_max = model.model_config.get("str_max_length")
    fields: list[tuple[str, Any, Any] | tuple[str, Any]] = []
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            raise TypeError(f"{model.__name__}.{name}: a default factory")
        base, optional, inner = unwrap(info.annotation)
        if get_origin(base) is list:
            (item,) = get_args(base)
            wire = _sized(list[_struct(item)], bounds([*info.metadata, *inner]))  # type: ignore[misc]
        else:
            wire = _wire_type(base, bounds([*info.metadata, *inner]), str_max)
        if optional:
            wire = Optional[wire]  # noqa: UP045 (a runtime type for msgspec)
        fields.append((name, wire) if info.is_required() else (name, wire, info.default))
    out = msgspec.defstruct(f"{model.__name__}Struct", fields, kw_only=True)
    _STRUCTS[model] = out
    return out


class _SampleKind:
    """The fast path of one telemetry kind: its single records and its batch records."""

    def __init__(self, kind: str) -> None:
        single = MODELS[kind]
        batch = BATCH_MODEL_OF_KIND[BATCH_OF[kind]]
        entries = batch.model_fields[batch.entries_field].annotation
        entry: type[BaseModel] = get_args(unwrap(entries)[0])[0]
        if set(entry.model_fields) - set(single.model_fields):
            raise TypeError(f"{entry.__name__}: fields that are not {single.__name__}'s")
        self.kind, self.batch_kind = kind, BATCH_OF[kind]
        self.entries_field = batch.entries_field
        self.single_decode = msgspec.json.Decoder(_typed_dict(single)).decode
        self.batch_decode = msgspec.json.Decoder(_typed_dict(batch)).decode
        self.single_limits = KEY_LIMITS[single]
        self.entry_limits = KEY_LIMITS[entry]
        self.sample = _ModelBuilder(single)
        self.finish = self.sample.complete if self.sample.factories or self.sample.nested else None
        try:  # records as Structs (:meth:`structs`), where the kind's models allow it
            self.single_struct = _struct(single)
            self.struct_decode: tuple[Callable[[bytes], Any], Callable[[bytes], Any]] | None = (
                msgspec.json.Decoder(self.single_struct).decode,
                msgspec.json.Decoder(_struct(batch)).decode,
            )
            self.struct_fields = tuple(self.single_struct.__struct_fields__)
        except TypeError:
            self.struct_decode = None

    def single(self, data: bytes) -> dict[str, Any]:
        record = self.single_decode(data)
        if self.single_limits:
            _long_keys([record], self.single_limits)
        return record  # type: ignore[no-any-return]

    def batch(self, data: bytes) -> dict[str, Any]:
        record = self.batch_decode(data)
        if "kind" not in record:  # without its kind a record is a single one (pydantic's)
            raise ValueError("a batch without its kind")
        if self.entry_limits:
            _long_keys(record[self.entries_field], self.entry_limits)
        return record  # type: ignore[no-any-return]

    def singles(self, data: bytes) -> Samples:
        sample = self.sample
        fields = {**sample.template, **self.single(data)}
        if self.finish is not None:
            self.finish(fields)
        return [sample.build(fields)]

    def batches(self, data: bytes) -> Samples:
        """The samples of a batch record, as :meth:`TelemetryBatch.samples` makes them: the
        batch's ``node`` and ``job``, an entry's own ``ts`` or else the batch's, ``v`` 1."""
        record = self.batch(data)
        ts = record["ts"]
        head = {**self.sample.template, "kind": self.kind, "v": 1, "ts": ts}
        head["node"], head["job"] = record["node"], record.get("job")
        build, finish = self.sample.build, self.finish
        out: Samples = []
        append = out.append
        for entry in record[self.entries_field]:
            fields = {**head, **entry}
            if fields["ts"] is None:
                fields["ts"] = ts
            if finish is not None:
                finish(fields)
            append(build(fields))
        return out

    def rows(self, data: bytes) -> Rows:
        """A record's validated fields without building a model: its common fields (``ts``,
        ``node``, ``job``) and its entries (a single record: one, the record itself). An
        entry's absent optional fields are absent, its ``ts`` absent or None: the head's."""
        if _BATCH_MARK in data:
            record = self.batch(data)
            return self.batch_kind, record, record[self.entries_field]
        record = self.single(data)
        return self.kind, record, [record]

    def structs(self, data: bytes) -> Rows:
        """A record as Structs: the batch (or the single record) and its entries (a single
        record: itself); an entry's ``ts`` None: the batch's. ValueError (and msgspec's
        errors) where pydantic must decide."""
        assert self.struct_decode is not None
        if _BATCH_MARK in data:
            record = self.struct_decode[1](data)
            if record.kind != self.batch_kind:  # a kind-less record is a single (pydantic's)
                raise ValueError("a batch without its kind")
            return self.batch_kind, record, getattr(record, self.entries_field)
        record = self.struct_decode[0](data)
        return self.kind, record, [record]

    def struct_of(self, sample: GuardMessage) -> Any:
        """The single record's Struct of a validated sample (what pydantic's path gives)."""
        return self.single_struct(**{name: getattr(sample, name) for name in self.struct_fields})


def _sample_kinds() -> dict[str, _SampleKind]:
    out = {}
    for kind in BATCH_OF:
        try:
            fast = _SampleKind(kind)
        except TypeError:  # a schema this module cannot express: that kind takes pydantic
            continue
        out[kind] = out[fast.batch_kind] = fast
    return out


_KINDS = _sample_kinds()
#: The telemetry kinds (and their batch kinds) decoded without pydantic when clean.
FAST_SAMPLE_KINDS: frozenset[str] = frozenset(_KINDS)
#: the decoder of each record kind, as the record's bytes spell it
_BY_RECORD_KIND: dict[bytes, Callable[[bytes], Samples]] = {}
_BY_RECORD_KIND_ROWS: dict[bytes, _SampleKind] = {}
for _fast in _KINDS.values():
    _BY_RECORD_KIND[_fast.kind.encode()] = _fast.singles
    _BY_RECORD_KIND[_fast.batch_kind.encode()] = _fast.batches
    _BY_RECORD_KIND_ROWS[_fast.kind.encode()] = _BY_RECORD_KIND_ROWS[_fast.batch_kind.encode()] = (
        _fast
    )


def _plain(data: bytes) -> bool:
    """Not too long, not too deep for pydantic: the fast path may decide."""
    return len(data) <= MAX_MESSAGE_BYTES and data.count(b"[") + data.count(b"{") <= MAX_BRACKETS


def decode_samples(data: bytes, kind: str) -> tuple[str, Samples]:
    """The kind of a telemetry record on ``kind``'s topic (``kind`` or its batch kind) and
    the samples it stands for (one for a single record), as :func:`guard.schemas.decode`
    and :func:`~guard.schemas.batches.expand` give them; its :class:`SchemaError` if the
    record is not valid."""
    fast = _KINDS.get(kind)
    if fast is not None and type(data) is bytes and _plain(data):
        try:
            if _BATCH_MARK in data:
                return fast.batch_kind, fast.batches(data)
            return fast.kind, fast.singles(data)
        except _REFUSED:
            pass  # pydantic decides, and says why
    message = decode(data, kind)
    return message.kind, expand(message)


def decode_rows(data: bytes, kind: str | None) -> Rows:
    """A telemetry record as validated fields, for the detectors' columns: its kind, its
    common fields and its entries (see :meth:`_SampleKind.rows`); ``kind`` None: whatever
    telemetry kind the record names (a line of a file). Acceptance is
    :func:`decode_samples`'s: a record the fast path refuses is decided by pydantic, whose
    samples give the fields, or whose :class:`SchemaError` is raised."""
    if kind is None:
        named = leading_kind(data) if type(data) is bytes else None
        fast = _BY_RECORD_KIND_ROWS.get(named) if named is not None else None
    else:
        fast = _KINDS.get(kind)
    if fast is not None and type(data) is bytes and _plain(data):
        try:
            return fast.rows(data)
        except _REFUSED:
            pass  # pydantic decides, and says why
    record_kind, samples = _decided(data, kind)
    if not samples or samples[0].kind not in _KINDS:
        raise SchemaError("not a telemetry record", kind=kind)
    return record_kind, samples[0].__dict__, [m.__dict__ for m in samples]


def _decided(data: bytes, kind: str | None) -> tuple[str, Samples]:
    """The kind and samples of a record the fast path refused, as pydantic decides them
    (its :class:`SchemaError` if not valid); ``kind`` None: any kind (a line of a file)."""
    if kind is not None:
        return decode_samples(data, kind)
    samples = parse_samples(data)
    if not samples:
        return "", samples
    return (samples[0].kind if len(samples) == 1 else f"{samples[0].kind}_batch"), samples


#: the kinds whose records :func:`decode_structs` gives as Structs
STRUCT_KINDS = frozenset(k for k, fast in _KINDS.items() if fast.struct_decode is not None)


def decode_structs(data: bytes, kind: str | None) -> Rows:
    """A record of a Struct kind (``gpu``, ``step``, ``collective`` and their batches) as
    msgspec Structs, for the detectors' columns: its kind, the record (a batch, or the
    single record) and its entries, each read by attribute (an entry's ``ts`` None: the
    record's). ``kind``: the topic's kind, or None for a line of a file, which must name
    such a kind. Acceptance is :func:`decode_samples`'s: a record the fast path refuses is
    decided by pydantic, whose samples become the same Structs, or whose
    :class:`SchemaError` is raised."""
    if kind is None:
        named = leading_kind(data) if type(data) is bytes else None
        fast = _BY_RECORD_KIND_ROWS.get(named) if named is not None else None
    else:
        fast = _KINDS.get(kind)
    if fast is None or fast.struct_decode is None:
        raise SchemaError(f"not a record of {sorted(STRUCT_KINDS)}", kind=kind)
    if type(data) is bytes and _plain(data):
        try:
            return fast.structs(data)
        except _REFUSED:
            pass  # pydantic decides, and says why
    record_kind, samples = _decided(data, kind)
    if not samples or samples[0].kind != fast.kind:
        raise SchemaError(f"not a {fast.kind} record", kind=kind)
    entries = [fast.struct_of(m) for m in samples]
    return record_kind, entries[0], entries


def structs_of(samples: Samples) -> list[Any]:
    """Validated samples of one Struct kind as the Structs :func:`decode_structs` gives."""
    struct_of = _KINDS[samples[0].kind].struct_of
    return [struct_of(m) for m in samples]


def record_ts(record: Any) -> float | None:
    """The event time of a record or an entry :func:`decode_rows` (a dict) or
    :func:`decode_structs` gave (None: an entry without its own, which has the record's)."""
    ts: float | None = record.get("ts") if type(record) is dict else record.ts
    return ts


def parse_samples(data: bytes) -> Samples:
    """A record of any kind as the samples it stands for (:func:`parse_message`, then
    :func:`expand`); a telemetry record that starts with its ``kind`` (as
    :func:`~guard.schemas.encode` writes every message) takes the fast path."""
    if type(data) is bytes and _plain(data):
        kind = leading_kind(data)
        fast = _BY_RECORD_KIND.get(kind) if kind is not None else None
        if fast is not None:
            try:
                return fast(data)
            except _REFUSED:
                pass
    return expand(parse_message(data))

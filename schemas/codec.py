"""JSON encoding and decoding of wire messages, with one error type for every bad input.

Decoding goes straight from bytes to models in pydantic-core (Rust), without an
intermediate dict; encoding drops null optional fields. Any invalid input — garbage
bytes, non-UTF-8, wrong types, missing fields, oversized or deeply nested values —
raises :class:`SchemaError`, which names the kind and the field when they are known.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError

from .batches import BATCH_OF, CollectiveBatch, GpuBatch, NicBatch, StepBatch
from .messages import (
    Advice,
    CollectiveTiming,
    Finding,
    Flag,
    GpuSample,
    GuardMessage,
    NicSample,
    NodeState,
    StepTiming,
    SweepResult,
    WindowFeatures,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MODELS",
    "Message",
    "SchemaError",
    "decode",
    "encode",
    "from_dict",
    "json_schemas",
    "parse_message",
]

#: Largest message accepted, bytes. A real sample is a few hundred bytes; a flag's evidence
#: or a sweep's checks a few kilobytes.
MAX_MESSAGE_BYTES = 1 << 20

MODELS: dict[str, type[GuardMessage]] = {
    "gpu": GpuSample,
    "nic": NicSample,
    "step": StepTiming,
    "collective": CollectiveTiming,
    "flag": Flag,
    "finding": Finding,
    "window_features": WindowFeatures,
    "sweep": SweepResult,
    "node_state": NodeState,
    "advice": Advice,
    "gpu_batch": GpuBatch,
    "nic_batch": NicBatch,
    "step_batch": StepBatch,
    "collective_batch": CollectiveBatch,
}

Message = Annotated[
    Union[
        GpuSample,
        NicSample,
        StepTiming,
        CollectiveTiming,
        Flag,
        Finding,
        WindowFeatures,
        SweepResult,
        NodeState,
        Advice,
        GpuBatch,
        NicBatch,
        StepBatch,
        CollectiveBatch,
    ],
    Field(discriminator="kind"),
]

_MESSAGE_ADAPTER: TypeAdapter[Any] = TypeAdapter(Message)
#: kind (single or batch) -> validators of the single kind, the batch kind, and either
_TOPIC_VALIDATORS: dict[str, tuple[Any, Any, Any]] = {}
#: How :func:`encode`'s output starts: the kind's name follows, up to the next quote.
_KIND_FIRST = b'{"kind":"'
_KIND_AT = len(_KIND_FIRST)
#: pydantic-core's own validators: ``model_validate_json`` is a Python wrapper around them
#: that costs ~1 us a call for nothing these calls use (no strict, context or alias options)
_MODEL_OF_KIND = {
    kind.encode(): model.__pydantic_validator__.validate_json for kind, model in MODELS.items()
}
#: Every batch's `kind` ends so; a record without it is a single sample (or invalid).
_BATCH_MARK = b'_batch"'


def _topic_validator(kind: str, batch: str) -> Any:
    # A record without ``kind`` on a single kind's topic is of that kind, as it always was.
    def tag(value: Any) -> Any:
        found = value.get("kind", kind) if isinstance(value, dict) else getattr(value, "kind", kind)
        return found if found in (kind, batch) else None

    union = Annotated[
        Union[
            Annotated[MODELS[kind], Tag(kind)],  # type: ignore[valid-type]
            Annotated[MODELS[batch], Tag(batch)],  # type: ignore[valid-type]
        ],
        Discriminator(tag, custom_error_type="wrong_kind", custom_error_message="wrong kind"),
    ]
    return TypeAdapter(union).validate_json


for _kind, _batch in BATCH_OF.items():
    _TOPIC_VALIDATORS[_kind] = _TOPIC_VALIDATORS[_batch] = (
        MODELS[_kind].__pydantic_validator__.validate_json,
        MODELS[_batch].__pydantic_validator__.validate_json,
        _topic_validator(_kind, _batch),
    )


class SchemaError(ValueError):
    """An input that is not a valid wire message.

    ``kind`` and ``field`` name what was wrong when they could be told (``None`` when the
    input was not even a JSON object); ``reason`` says why in words.
    """

    def __init__(self, reason: str, kind: str | None = None, field: str | None = None):
        self.reason = reason
        self.kind = kind
        self.field = field
        where = f"{kind or 'unknown'} message"
        if field:
            where += f", field '{field}'"
        super().__init__(f"{where}: {reason}")


def parse_message(data: bytes | bytearray | memoryview | str) -> GuardMessage:
    """Parse one message of any kind, dispatching on its ``kind`` field.

    A record that starts with its ``kind`` (as :func:`encode` writes every message) goes
    straight to that kind's model, ~2x faster than the dispatching validator, which first
    builds Python objects of the whole input; anything else, or a record that this path
    refuses, takes the dispatching validator, whose error says what was wrong.
    """
    if isinstance(data, (bytes, bytearray)):
        kind = leading_kind(data)
        model = _MODEL_OF_KIND.get(kind) if kind is not None else None
        if model is not None and len(data) <= MAX_MESSAGE_BYTES:
            try:
                return model(data)  # type: ignore[no-any-return]
            except (ValidationError, ValueError):
                pass
    return _validate(_MESSAGE_ADAPTER.validate_json, data, None)


def leading_kind(data: bytes | bytearray) -> bytes | None:
    """The kind a record starts with, as :func:`encode` writes every message
    (``{"kind":"gpu",...`` gives ``b"gpu"``); None if it does not start so."""
    if not data.startswith(_KIND_FIRST):
        return None
    end = data.find(b'"', _KIND_AT, _KIND_AT + 32)
    return bytes(data[_KIND_AT:end]) if end > 0 else None


def from_dict(data: dict[str, Any]) -> GuardMessage:
    """Validate an already-parsed JSON object (e.g. a line read by another JSON library)."""
    if not isinstance(data, dict):
        raise SchemaError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return _MESSAGE_ADAPTER.validate_python(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _schema_error(exc, None) from None


def decode(data: bytes | bytearray | memoryview | str, kind: str) -> GuardMessage:
    """Parse one message that must be of ``kind`` (faster when the topic tells the kind).

    For a telemetry kind the message may also be that kind's batch, and the other way round
    (``gpu`` accepts ``gpu_batch``, see :mod:`guard.schemas.batches`): a topic carries both.
    """
    pair = _TOPIC_VALIDATORS.get(kind)
    if pair is not None:
        return _decode_telemetry(data, kind, *pair)
    model = MODELS.get(kind)
    if model is None:
        raise SchemaError(f"unknown kind {kind!r}; known kinds: {', '.join(MODELS)}")
    return _validate(model.model_validate_json, data, kind)


def _decode_telemetry(data: Any, kind: str, single: Any, batch: Any, both: Any) -> GuardMessage:
    # Straight to the one model a record's bytes point at (the dispatching validator first
    # builds Python objects of the whole input, ~2x slower); bad input, or an oddly spelt
    # batch, takes the full path, whose error says what was wrong.
    if isinstance(data, (bytes, bytearray)) and len(data) <= MAX_MESSAGE_BYTES:
        try:
            if _BATCH_MARK in data:
                return batch(data)  # type: ignore[no-any-return]
            return single(data)  # type: ignore[no-any-return]
        except (ValidationError, ValueError):
            pass
    return _validate(both, data, kind)


def encode(message: GuardMessage) -> bytes:
    """The compact JSON of a message, without null optional fields."""
    return message.__pydantic_serializer__.to_json(message, exclude_none=True)


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every message kind, keyed by kind."""
    return {kind: model.model_json_schema(mode="validation") for kind, model in MODELS.items()}


def _validate(validator: Any, data: Any, kind: str | None) -> GuardMessage:
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray, str)):
        raise SchemaError(f"expected bytes or str, got {type(data).__name__}", kind)
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}", kind)
    try:
        return validator(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _schema_error(exc, kind) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # defensive: parser limits
        raise SchemaError(f"unreadable input ({type(exc).__name__}: {exc})", kind) from None


def _schema_error(exc: ValidationError, kind: str | None) -> SchemaError:
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    kind_found = kind
    error_type = first.get("type", "")
    if error_type == "json_invalid":
        return SchemaError(f"not valid JSON: {first.get('msg', '')}", kind)
    if error_type == "wrong_kind":
        single = next((k for k, b in BATCH_OF.items() if kind in (k, b)), kind)
        expected = f"'{single}' or '{BATCH_OF.get(single or '')}'"
        return SchemaError(f"this topic carries only {expected} messages", kind, "kind")
    if error_type in ("union_tag_invalid", "union_tag_not_found"):
        ctx = first.get("ctx") or {}
        tag = ctx.get("tag")
        if tag is not None and error_type == "union_tag_invalid":
            return SchemaError(
                f"unknown kind {tag!r}; known kinds: {', '.join(MODELS)}", None, "kind"
            )
        return SchemaError("missing 'kind'", None, "kind")
    if loc and loc[0] in MODELS and (kind is None or loc[0] in (kind, BATCH_OF.get(kind))):
        kind_found, loc = loc[0], loc[1:]
    field = ".".join(loc) or None
    reason = first.get("msg", "invalid")
    more = exc.error_count() - 1
    if more:
        reason += f" (and {more} more error{'s' if more > 1 else ''})"
    return SchemaError(reason, kind_found, field)

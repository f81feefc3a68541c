"""What a pydantic field's annotation says: its base type, whether it may be null, its bounds.

The fast decoders (:mod:`guard.schemas.rows`, :mod:`guard.schemas.sample_decoder`) read the models'
constraints through these two functions instead of restating them; a constraint they do not
know raises ``TypeError``, and that model then takes pydantic only.

Example
-------
>>> from guard.schemas import GpuSample
>>> info = GpuSample.model_fields["temp_c"]
>>> base, optional, inner = unwrap(info.annotation)
>>> base, optional, bounds([*info.metadata, *inner])
(<class 'float'>, True, {'ge': -273.15, 'le': 1000})
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import fields
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["bounds", "check_plain_model", "unwrap"]

_NONE = type(None)


def bounds(metadata: Sequence[Any]) -> dict[str, Any]:
    """The bounds in a field's metadata (``ge``, ``le``, ``gt``, ``lt``, ``min_length``,
    ``max_length``); TypeError for any other constraint."""
    out: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(bounds(m.metadata))
        elif isinstance(m, (at.Ge, at.Le, at.Gt, at.Lt, at.MinLen, at.MaxLen)):
            out.update((f.name, getattr(m, f.name)) for f in fields(m))
        else:  # a constraint the fast decoders do not know: no fast path for the model
            raise TypeError(f"unsupported constraint {m!r}")
    return out


def unwrap(annotation: Any) -> tuple[Any, bool, list[Any]]:
    """(base type, optional, constraints) of a field's annotation."""
    optional = False
    metadata: list[Any] = []
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not _NONE]
        if len(args) != 1:
            raise TypeError(f"unsupported union {annotation!r}")
        optional, annotation = True, args[0]
    if get_origin(annotation) is Annotated:
        annotation, *metadata = get_args(annotation)
    return annotation, optional, metadata


def check_plain_model(model: type[BaseModel]) -> None:
    """TypeError unless ``model`` validates by its fields' types and bounds alone — lax, unknown
    fields ignored, no validators, no aliases — which is all a fast decoder can stand in for."""
    config = model.model_config
    if config.get("extra", "ignore") != "ignore" or config.get("strict"):
        raise TypeError(f"{model.__name__}: only lax models with extra='ignore'")
    decorators = model.__pydantic_decorators__
    if decorators.field_validators or decorators.model_validators or decorators.validators:
        raise TypeError(f"{model.__name__} has validators")
    for name, info in model.model_fields.items():
        if info.alias not in (None, name) or info.validation_alias not in (None, name):
            raise TypeError(f"{model.__name__}.{name} has an alias")

"""The wire contract as a document, rendered from the models themselves.

``docs/wire-contract.md`` is this module's output (``guard schema doc``); a test fails when
the committed file and the models drift apart, so the document cannot go stale.

>>> text = render_markdown()
>>> text.startswith("# Wire contract v1")
True
>>> "| `compute_s` | number or null | optional |" in text
True
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .batches import BATCH_MODELS
from .codec import MODELS
from .messages import (
    CATEGORIES,
    NODE_STATES,
    SEVERITIES,
    AdviceAction,
    ConnectionStat,
    PathAssignment,
    SweepCheck,
)
from .nvml_codes import HW_POWER_BRAKE, HW_SLOWDOWN, HW_THERMAL, IDLE, SW_POWER_CAP, SW_THERMAL
from .topics import TOPIC_BY_KIND

__all__ = ["render_markdown"]

_INTRO = """\
# Wire contract v1 (revision 1.1)

<!-- Generated from schemas/: `guard schema doc --out docs/wire-contract.md`. Do not edit. -->

Every message is one JSON object (UTF-8, at most 1 MiB). Times are UNIX epoch seconds
(float, UTC). The Kafka record's timestamp is the message's event time (`ts`). Unknown fields
are ignored, so newer producers can add fields without breaking older consumers; a message
that breaks a rule below is refused with an error naming the field and goes to the
dead-letter topic (`guard.dlq`) with the reason in its `guard-error` header.

Producers written with confluent-kafka use `partitioner=murmur2_random`, so that a key lands
on the partition faust (aiokafka, murmur2) expects. Topic names below are suffixes after the
configured prefix (default `guard.`). Internal topics: `guard.findings` (key = node, or
`job:<id>` for job-level findings) carries detector findings to fusion, and nodes' GPU
window features to their job's river model (`window_features`, key = `anomaly:<job>`, since
revision 1.2); operator requests
travel on `guard.node-state` as `node_state` messages with `actor = operator:<name>`.

A `flag` with `node` null is about the job as a whole (e.g. `imbalance`); it never triggers
a sweep. `info` flags are observations; `warning` and `critical` flags are claims that a node
(or link) is at fault.

**Revision 1.1** adds batched telemetry: `gpu_batch` and `nic_batch` (one record per node per
sampling interval: all its GPUs, all its NIC ports) and `step_batch` and `collective_batch`
(one record per node per step, or per collective: that node's ranks). A batch travels on its
single kind's topic with its single kind's key; its common fields are every entry's, and an
entry may carry its own `ts` (absent: the batch's). Consumers read a batch as the
single-sample messages it stands for, so tables, detectors and flags are the same either
way. The single-sample kinds stay valid, and `v` stays `1` in every kind. A consumer older
than revision 1.1 dead-letters batches as an unknown kind: upgrade `guard streams` and
`guard sink` before the agents send batches. Revision 1.1 also adds `advice` (path plans
on `guard.advice`, key = job); consumers of the telemetry topics never see it.
"""

_REASON_BITS = (
    (IDLE, "idle"),
    (SW_POWER_CAP, "software power cap"),
    (HW_SLOWDOWN, "hardware slowdown"),
    (SW_THERMAL, "software thermal slowdown"),
    (HW_THERMAL, "hardware thermal slowdown"),
    (HW_POWER_BRAKE, "hardware power brake"),
)


def render_markdown() -> str:
    """The whole contract: common rules, one section per kind, the vocabularies."""
    parts = [_INTRO]
    for kind, model in MODELS.items():
        parts.append(_kind_section(kind, model))
    for batch in BATCH_MODELS:
        entry = batch.model_fields[batch.entries_field].annotation.__args__[0]  # type: ignore[union-attr]
        single = batch.single.model_fields["kind"].default
        parts.append(
            f"### `{entry.__name__}`\n\nOne entry of a `{batch.model_fields['kind'].default}`: "
            f"the fields of `{single}` except the common ones (`kind`, `v`, `ts`, `node`, "
            "`job`), with their rules, and an optional `ts` (the entry's own event time; "
            "absent: the batch's)."
        )
    for nested in (ConnectionStat, SweepCheck, PathAssignment, AdviceAction):
        parts.append(f"### `{nested.__name__}`\n\n{_doc(nested)}\n\n{_field_table(nested)}")
    parts.append(_vocabularies())
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def _kind_section(kind: str, model: type[BaseModel]) -> str:
    key = getattr(model, "key_field", "node")
    key_text = f"`{key}`" + {
        "flag": " (a job-level flag: its `job`)",
        "finding": " (a job-level finding: `job:<job>`)",
        "window_features": " as `anomaly:<job>`",
    }.get(kind, "")
    return (
        f"## `{kind}` — {model.__name__}\n\n{_doc(model)}\n\n"
        f"Topic `{TOPIC_BY_KIND[kind]}`; Kafka key {key_text}.\n\n{_field_table(model)}"
    )


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split()).replace("``", "`")


def _field_table(model: type[BaseModel]) -> str:
    schema = model.model_json_schema(mode="validation")
    required = set(schema.get("required", ()))
    rows = ["| field | type | presence | meaning and limits |", "|---|---|---|---|"]
    for name, prop in schema["properties"].items():
        if name == "kind":
            presence = f'always `"{prop["const"]}"`'
        elif name in required:
            presence = "required"
        else:
            default = prop.get("default")
            presence = "optional" if default is None else f"default `{json.dumps(default)}`"
        meaning = "; ".join(p for p in (prop.get("description", ""), _limits(prop)) if p)
        rows.append(f"| `{name}` | {_type(prop)} | {presence} | {meaning} |")
    return "\n".join(rows)


def _variants(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in prop.get("anyOf", [prop]) if v.get("type") != "null"]


def _type(prop: dict[str, Any]) -> str:
    names = []
    for v in _variants(prop):
        if "$ref" in v:
            names.append(v["$ref"].rsplit("/", 1)[-1])
        elif "enum" in v:
            names.append(" \\| ".join(f"`{e}`" for e in v["enum"]))
        elif v.get("type") == "array":
            names.append(f"list of {_type(v['items'])}")
        elif v.get("type") == "object" and "additionalProperties" in v:
            names.append(f"object of {_type(v['additionalProperties'])}")
        else:
            names.append(str(v.get("type", "any")))
    nullable = any(v.get("type") == "null" for v in prop.get("anyOf", ()))
    return " or ".join(names) + (" or null" if nullable else "")


_LIMIT_WORDS = (
    ("minimum", ">= {}"),
    ("maximum", "<= {}"),
    ("maxItems", "at most {} items"),
    ("maxProperties", "at most {} entries"),
)


def _limits(prop: dict[str, Any]) -> str:
    found = []
    for v in _variants(prop):
        found += [text.format(_number(v[key])) for key, text in _LIMIT_WORDS if key in v]
        if "maxLength" in v:
            found.append(f"{v.get('minLength', 0)}-{v['maxLength']} characters")
    return ", ".join(found)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == 2**64 - 1:
        return "2^64 - 1"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _vocabularies() -> str:
    bits = "\n".join(f"| `{bit:#x}` | {meaning} |" for bit, meaning in _REASON_BITS)
    return (
        "## Vocabularies\n\n"
        f"- `category`: {', '.join(f'`{c}`' for c in CATEGORIES)}\n"
        f"- `severity` (weakest first): {', '.join(f'`{s}`' for s in SEVERITIES)}\n"
        f"- node `state`: {', '.join(f'`{s}`' for s in NODE_STATES)}\n\n"
        "`clock_event_reasons` bits (NVML `nvmlClocksEventReasons`); idle and the software "
        "power cap are normal, the others mean trouble:\n\n"
        f"| bit | reason |\n|---|---|\n{bits}\n"
    )

"""Guard's single vocabulary: wire messages (contract v1), their codec, and table rows."""

from .codec import MAX_MESSAGE_BYTES, MODELS, Message, SchemaError, decode, encode, json_schemas, parse_message
from .messages import (
    CATEGORIES,
    NODE_STATES,
    SEVERITIES,
    CollectiveTiming,
    ConnectionStat,
    Flag,
    GpuSample,
    GuardMessage,
    NicSample,
    NodeState,
    StepTiming,
    SweepCheck,
    SweepResult,
    stable_id,
)

__all__ = [
    "CATEGORIES",
    "MAX_MESSAGE_BYTES",
    "MODELS",
    "NODE_STATES",
    "SEVERITIES",
    "CollectiveTiming",
    "ConnectionStat",
    "Flag",
    "GpuSample",
    "GuardMessage",
    "Message",
    "NicSample",
    "NodeState",
    "SchemaError",
    "StepTiming",
    "SweepCheck",
    "SweepResult",
    "decode",
    "encode",
    "json_schemas",
    "parse_message",
    "stable_id",
]

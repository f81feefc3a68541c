"""Sealed detector checkpoints: authenticated first, then read without running foreign code.

A checkpoint is ``CHECKPOINT_FORMAT`` + an HMAC-SHA256 tag + the zlib-compressed pickle of
one key's detector objects. Anyone who can produce to Kafka can write a changelog topic, so
a checkpoint read back from one is untrusted until its tag checks out:

1. the tag is computed with the streams state key (``streams.state_key``, shared by every
   worker of an app) over the format, the record key and the payload, and compared with
   :func:`hmac.compare_digest` **before** anything is decompressed or unpickled; a
   checkpoint moved to another key fails this check too;
2. even a checkpoint with a good tag (a leaked key) is unpickled by
   :class:`StateUnpickler`, which resolves only classes of Guard's detectors and schemas, the
   river statistics they hold and a few plain containers: no function, no module, no
   ``os.system``. Bound methods (river keeps some, e.g. ``PageHinkley._test_increase``) are
   rebuilt only as methods of such objects.

Anything else is :class:`CheckpointRefused` with the reason, and the caller starts that key
cold.

>>> secret = b"k" * 32
>>> blob = seal(secret, "node-1", {"count": 3})
>>> unseal(secret, "node-1", blob)
{'count': 3}
>>> try:
...     unseal(secret, "node-2", blob)
... except CheckpointRefused as refused:
...     print(str(refused)[:36])
its signature does not match: forged
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import io
import pickle
import zlib
from typing import Any

__all__ = ["CHECKPOINT_FORMAT", "CheckpointRefused", "StateUnpickler", "seal", "unseal"]

#: Leads every checkpoint. Bumped when detector classes move or change shape, or the
#: envelope changes (2: the restructure renamed modules; 3: the HMAC tag; 4: node and job
#: detectors carry the river peer-anomaly models; 5: a node's NIC ports are arrays; 6: the
#: job's detectors take a poll's steps and collectives as columns, their ranks by dense id,
#: and keep their persistence trackers as arrays, a TrackerTable; 7: a TrackerTable keeps
#: three windows, the peer-anomaly score baselines three numbers; 8: a node's river feed
#: keeps its NIC error rates per window, in event time): a checkpoint of another
#: format starts cold instead of being read into objects the code no longer fits.
CHECKPOINT_FORMAT = b"guard-state-8:"
TAG_BYTES = hashlib.sha256().digest_size

#: Modules whose classes a checkpoint may name: Guard's own pure code and the river
#: statistics the detectors keep. Classes only: a function of these modules is refused.
STATE_MODULES = (
    "guard.detectors.",
    "guard.schemas.",
    "river.anomaly.",
    "river.drift.",
    "river.proba.",
    "river.stats.",
    "river.tree.",  # HalfSpaceTrees' nodes
    "river.utils.",
)
#: Globals outside those modules that detector state is made of.
STATE_GLOBALS = frozenset(
    {
        ("builtins", "bytearray"),
        ("builtins", "complex"),
        ("builtins", "frozenset"),
        ("builtins", "set"),
        ("builtins", "slice"),
        ("builtins", "tuple"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        # river's HalfSpaceTrees keeps defaultdict(partial(tuple, (0.0, 1.0))): a partial can
        # only wrap what this unpickler lets through.
        ("functools", "partial"),
        ("random", "Random"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        # numpy 2 pickles an array (protocol 5) as its raw buffer, dtype and shape; it
        # refuses an object dtype from a buffer, so no object is built from the record
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }
)


class CheckpointRefused(Exception):
    """A checkpoint that is not used; the message says why."""


def _tag(secret: bytes, key: str, payload: bytes) -> bytes:
    raw_key = key.encode("utf-8", "surrogateescape")
    header = CHECKPOINT_FORMAT + len(raw_key).to_bytes(4, "big") + raw_key
    return hmac.new(secret, header + payload, hashlib.sha256).digest()


def seal(secret: bytes, key: str, obj: Any) -> bytes:
    """The checkpoint of ``obj`` under record key ``key``."""
    payload = zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 1)
    return CHECKPOINT_FORMAT + _tag(secret, key, payload) + payload


def unseal(secret: bytes, key: str, blob: bytes) -> Any:
    """The object in checkpoint ``blob`` of ``key``, or :class:`CheckpointRefused`."""
    if not blob.startswith(CHECKPOINT_FORMAT):
        raise CheckpointRefused("it is not in this version's checkpoint format")
    tag = blob[len(CHECKPOINT_FORMAT) : len(CHECKPOINT_FORMAT) + TAG_BYTES]
    payload = blob[len(CHECKPOINT_FORMAT) + TAG_BYTES :]
    if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, key, payload)):
        raise CheckpointRefused(
            "its signature does not match: forged, moved from another key, "
            "or written with another streams.state_key"
        )
    try:
        return StateUnpickler(io.BytesIO(zlib.decompress(payload))).load()
    except Exception as exc:  # signed but unreadable: classes this code no longer has
        raise CheckpointRefused(f"it cannot be read ({type(exc).__name__}: {exc})") from None


def _allowed_type(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return isinstance(obj, type) and (
        module.startswith(STATE_MODULES) or (module, obj.__qualname__) in STATE_GLOBALS
    )


def _method_of(obj: Any, name: str) -> Any:
    """``getattr`` as pickle uses it for bound methods, for methods of state objects only."""
    if name.startswith("__") or not _allowed_type(type(obj)):
        raise pickle.UnpicklingError(f"getattr({type(obj).__name__}, {name!r}) is not allowed")
    method = getattr(obj, name)
    if not (inspect.ismethod(method) and method.__self__ is obj):
        raise pickle.UnpicklingError(f"{type(obj).__name__}.{name} is not a method")
    return method


class StateUnpickler(pickle.Unpickler):
    """An unpickler that builds detector state and nothing else (see the module doc)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _method_of
        if "__" not in name and (module, name) in STATE_GLOBALS:
            return super().find_class(module, name)
        if "__" not in name and module.startswith(STATE_MODULES):
            obj = super().find_class(module, name)
            if _allowed_type(obj):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")

"""``guard backtest``: recorded telemetry (JSONL) through the detectors, flags out (JSONL).

The same :class:`~guard.detectors.core.DetectionCore` the streams workers run (through
:class:`~guard.detectors.core.MessageFeed`), without Kafka:
each input line is parsed through :mod:`guard.schemas` (a bad line is counted, reported once
per kind of error, and skipped; a batch record is read as its samples), several inputs are
merged in event-time order, and every flag is written as one JSON line. The baselines of
the quality benchmark run on the same path (``--detector static`` / ``nvrx``).
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from guard.detectors.baselines import NvrxBaseline, StaticRulesBaseline
from guard.detectors.core import MessageFeed
from guard.detectors.engine import EngineConfig
from guard.schemas import Flag, GuardMessage, SchemaError, encode
from guard.schemas.codec import leading_kind
from guard.schemas.sample_decoder import (
    Rows,
    decode_rows,
    decode_structs,
    parse_samples,
    record_ts,
)

__all__ = ["BacktestStats", "FlagSource", "make_detector", "read_messages", "run_backtest"]

DETECTORS = ("guard", "static", "nvrx")


class FlagSource(Protocol):
    def update(self, msg: Any) -> list[Flag]: ...

    def flush(self) -> list[Flag]: ...


def make_detector(name: str, config: EngineConfig | None = None) -> FlagSource:
    """``guard`` (the engine, with ``config``: the ``[detectors]`` settings), ``static``
    (dcgm-style alert rules) or ``nvrx`` (relative score)."""
    if name == "guard":
        return MessageFeed(config)
    if name == "static":
        return StaticRulesBaseline()
    if name == "nvrx":
        return NvrxBaseline()
    raise ValueError(f"unknown detector {name!r}; choose one of {', '.join(DETECTORS)}")


@dataclass
class BacktestStats:
    messages: int = 0
    bad_lines: int = 0
    flags: int = 0
    claims: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0  # of the input files, for progress against their size

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "bad_lines": self.bad_lines,
            "flags": self.flags,
            "claims": self.claims,
            "seconds": round(self.seconds, 3),
            "rate": round(self.rate, 1),
            "errors": dict(self.errors),
        }


#: what the readers give: a message, or (``rows``) a telemetry record decoded to its fields
Item = GuardMessage | Rows
#: the record kinds the detection core takes as fields (its columns): every telemetry kind
_ROW_KINDS = frozenset(
    f"{k}{b}".encode() for k in ("gpu", "nic", "step", "collective") for b in ("", "_batch")
)
#: those of them decoded as dicts (the NIC columns); the others as Structs, read by attribute
_DICT_KINDS = frozenset({b"nic", b"nic_batch"})


def _read_file(
    path: Path, stats: BacktestStats, line: list[int] | None = None, rows: bool = False
) -> Iterator[Item]:
    """Each message of the file (a batch record: its samples, in entry order), or with
    ``rows`` each telemetry record as its fields (what the core's columns take: no model
    per sample); ``line[0]`` is kept at the line number of the item last yielded. The common
    line costs one parse: a blank or bad one is told apart only when the parse refuses it."""
    parse = parse_samples
    with path.open("rb") as fh:
        for number, text in enumerate(fh, 1):
            stats.bytes_read += len(text)
            try:
                lead = leading_kind(text) if rows else None
                if lead in _ROW_KINDS:
                    found: Item = (decode_rows if lead in _DICT_KINDS else decode_structs)(
                        text, None
                    )
                    if line is not None:
                        line[0] = number
                    yield found
                    continue
                samples = parse(text)
            except SchemaError as exc:
                if not text.isspace():
                    _skipped(stats, path, number, exc)
                continue
            if line is not None:
                line[0] = number
            yield from samples


def _skipped(stats: BacktestStats, path: Path, number: int, exc: SchemaError) -> None:
    stats.bad_lines += 1
    key = str(exc)
    if key not in stats.errors:
        print(f"guard backtest: {path}:{number}: skipped: {exc}", file=sys.stderr)
    stats.errors[key] = stats.errors.get(key, 0) + 1


def read_messages(
    paths: Iterable[Path], stats: BacktestStats | None = None, rows: bool = False
) -> Iterator[Item]:
    """Messages of all files, merged by event time (each file is read as it comes; ties in
    event time go by line number, then by the files' order); ``rows``: GPU and NIC records
    as their fields (for ``guard``'s core, :func:`_read_file`)."""
    stats = stats or BacktestStats()
    files = [Path(p) for p in paths]
    if len(files) == 1:  # nothing to merge: the file's own reader, no key or tuple per message
        return _read_file(files[0], stats, rows=rows)
    merged = heapq.merge(*(_numbered(p, stats, rows) for p in files), key=lambda item: item[:2])
    return (msg for _, _, msg in merged)


def _numbered(path: Path, stats: BacktestStats, rows: bool) -> Iterator[tuple[float, int, Item]]:
    line = [0]
    for item in _read_file(path, stats, line, rows):
        yield (record_ts(item[1]) or 0.0 if type(item) is tuple else item.ts), line[0], item


def run_backtest(
    messages: Iterable[Item],
    out: IO[bytes],
    detector: FlagSource,
    stats: BacktestStats | None = None,
    progress: Callable[[BacktestStats], None] | None = None,
    progress_every_s: float = 0.5,
) -> BacktestStats:
    """Feed ``messages`` to ``detector``; write each flag as a JSON line to ``out``;
    ``progress(stats)`` every ``progress_every_s`` (``stats.messages`` counts so far)."""
    stats = stats or BacktestStats()
    started = time.perf_counter()
    next_report = started + progress_every_s
    process = detector.update
    count = 0

    def write(flags: list[Flag]) -> None:
        for flag in flags:
            out.write(encode(flag) + b"\n")
            stats.flags += 1
            stats.claims += flag.severity != "info"

    for items, msg in enumerate(messages, 1):
        count += len(msg[2]) if type(msg) is tuple else 1  # samples, a record's by its entries
        flags = process(msg)
        if flags:
            write(flags)
        if progress is not None and not items & 0xFFF:
            now = time.perf_counter()
            if now >= next_report:
                next_report = now + progress_every_s
                stats.messages, stats.seconds = count, now - started
                progress(stats)
    write(detector.flush())
    stats.messages = count
    stats.seconds = time.perf_counter() - started
    if progress is not None:
        progress(stats)
    return stats

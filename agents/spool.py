"""A bounded on-disk spool of Kafka records, replayed in order when the broker is back.

Records are appended to segment files (``<id>.seg``) in a directory; a small ``cursor``
file remembers how far replay has got, so a spool survives an agent restart. Each record is
length-prefixed and CRC-checked: a torn write at the end of a segment (a crash mid-append)
is detected and ignored, never replayed as garbage.

The bound (``max_bytes``) is on the total size of the segment files. When appending would
exceed it, the *oldest* segment is deleted and its unreplayed records are counted in
``dropped`` (recent telemetry is worth more than old telemetry) and logged; nothing is lost
below the bound. Writes are flushed to the OS at once (an agent crash loses nothing) but
not fsync'ed (a power loss may lose the last moments).

>>> import tempfile
>>> spool = Spool(tempfile.mkdtemp(), max_bytes=1 << 20)
>>> spool.append(SpoolRecord("guard.gpu", b"node-1", b"{}", 1700000000000))
>>> [(r.topic, r.key) for _, r in spool.peek(10)]
[('guard.gpu', b'node-1')]
>>> spool.commit(spool.peek(10)[-1][0], 1); len(spool)
0
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["Spool", "SpoolRecord"]

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")  # body length, crc32 of the body
_BODY = struct.Struct("<Hiq")  # topic length, key length (-1: none), timestamp ms


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    topic: str
    key: bytes | None
    value: bytes
    timestamp_ms: int

    def encode(self) -> bytes:
        topic = self.topic.encode()
        key = self.key if self.key is not None else b""
        body = (
            _BODY.pack(len(topic), -1 if self.key is None else len(key), self.timestamp_ms)
            + topic
            + key
            + self.value
        )
        return _HEAD.pack(len(body), zlib.crc32(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> SpoolRecord:
        topic_len, key_len, ts = _BODY.unpack_from(body)
        pos = _BODY.size
        topic = body[pos : pos + topic_len].decode()
        pos += topic_len
        key = None if key_len < 0 else body[pos : pos + key_len]
        pos += max(0, key_len)
        return cls(topic, key, body[pos:], ts)


#: A position in the spool: (segment id, byte offset just after a record).
Position = tuple[int, int]


class Spool:
    """Append-only, segmented, bounded record store with a persistent replay cursor."""

    def __init__(self, directory: str | Path, max_bytes: int, segment_bytes: int | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(64 << 10, min(max_bytes // 8, 16 << 20))
        self.dropped = 0
        self._segments: dict[int, int] = {}  # id -> size
        self._counts: dict[int, int] = {}  # id -> records in it
        for path in sorted(self.dir.glob("*.seg")):
            try:
                seg = int(path.stem)
            except ValueError:
                continue
            self._segments[seg] = path.stat().st_size
            self._counts[seg] = sum(1 for _ in self._scan(seg, 0))
        self._cursor: Position = self._load_cursor()
        self._pending = sum(c for seg, c in self._counts.items() if seg >= self._cursor[0])
        self._pending -= self._consumed_in_cursor_segment()
        self._writer: BinaryIO | None = None
        self._active = max(self._segments) if self._segments else self._cursor[0]

    # --- sizes -----------------------------------------------------------------------------

    @property
    def size_bytes(self) -> int:
        return sum(self._segments.values())

    def __len__(self) -> int:
        """Records not yet replayed."""
        return self._pending

    def _consumed_in_cursor_segment(self) -> int:
        seg, offset = self._cursor
        return sum(1 for _ in self._scan(seg, 0, offset)) if offset else 0

    # --- writing ---------------------------------------------------------------------------

    def append(self, record: SpoolRecord) -> None:
        data = record.encode()
        if len(data) > self.max_bytes:
            self._drop_counted(1, f"a {len(data)}-byte record is larger than the spool bound")
            return
        while self._segments and self.size_bytes + len(data) > self.max_bytes:
            self._drop_oldest_segment()
        if self._active not in self._segments or self._segments[self._active] >= self.segment_bytes:
            self._roll()
        writer = self._open_writer()
        writer.write(data)
        writer.flush()
        self._segments[self._active] += len(data)
        self._counts[self._active] = self._counts.get(self._active, 0) + 1
        self._pending += 1

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._active = (
            (max(self._segments) + 1) if self._segments else max(self._active, self._cursor[0])
        )
        self._segments[self._active] = 0
        self._counts[self._active] = 0
        self._path(self._active).touch()

    def _open_writer(self) -> BinaryIO:
        if self._writer is None:
            self._writer = open(self._path(self._active), "ab")  # noqa: SIM115 - kept open
        return self._writer

    def _drop_oldest_segment(self) -> None:
        oldest = min(self._segments)
        if oldest == self._active:
            self._roll()
        unreplayed = self._counts.get(oldest, 0)
        if oldest == self._cursor[0]:
            unreplayed -= self._consumed_in_cursor_segment()
        if oldest < self._cursor[0]:
            unreplayed = 0
        self._remove(oldest)
        if self._cursor[0] <= oldest:
            self._cursor = (min(self._segments), 0) if self._segments else (oldest + 1, 0)
            self._save_cursor()
        self._pending -= unreplayed
        self._drop_counted(unreplayed, "the spool is full; dropped its oldest segment")

    def _drop_counted(self, count: int, why: str) -> None:
        if count <= 0:
            return
        self.dropped += count
        log.warning(
            "%s: %d records lost (%d in total); bound %d bytes",
            why,
            count,
            self.dropped,
            self.max_bytes,
        )

    # --- reading ---------------------------------------------------------------------------

    def peek(self, limit: int, max_bytes: int = 8 << 20) -> list[tuple[Position, SpoolRecord]]:
        """Up to ``limit`` records from the cursor on, with the position after each."""
        out: list[tuple[Position, SpoolRecord]] = []
        size = 0
        for seg in sorted(s for s in self._segments if s >= self._cursor[0]):
            start = self._cursor[1] if seg == self._cursor[0] else 0
            for end, record in self._scan(seg, start):
                out.append(((seg, end), record))
                size += len(record.value)
                if len(out) >= limit or size >= max_bytes:
                    return out
        return out

    def commit(self, position: Position, count: int) -> None:
        """The ``count`` records up to ``position`` were delivered: move the cursor on and
        delete what is fully replayed."""
        seg, offset = position
        for old in [s for s in self._segments if s < seg]:
            self._remove(old)
        self._pending = max(0, self._pending - count)
        self._cursor = (seg, offset)
        if offset >= self._segments.get(seg, 0):
            # Fully replayed: drop the segment; the next record starts a fresh one.
            self._remove(seg)
            later = [s for s in self._segments if s > seg]
            self._cursor = (min(later), 0) if later else (seg + 1, 0)
            if seg == self._active:
                self._active = seg + 1
        self._save_cursor()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # --- files -----------------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:016d}.seg"

    def _remove(self, seg: int) -> None:
        if seg == self._active and self._writer is not None:
            self._writer.close()
            self._writer = None
        self._segments.pop(seg, None)
        self._counts.pop(seg, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(seg))

    def _scan(
        self, seg: int, start: int, stop: int | None = None
    ) -> Iterator[tuple[int, SpoolRecord]]:
        """(offset after, record) of the valid records of a segment from ``start``."""
        try:
            with open(self._path(seg), "rb") as f:
                f.seek(start)
                pos = start
                while stop is None or pos < stop:
                    head = f.read(_HEAD.size)
                    if len(head) < _HEAD.size:
                        return
                    length, crc = _HEAD.unpack(head)
                    body = f.read(length)
                    if len(body) < length or zlib.crc32(body) != crc:
                        log.warning(
                            "spool segment %s: torn or corrupt record at %d; ignoring the rest",
                            seg,
                            pos,
                        )
                        return
                    pos += _HEAD.size + length
                    yield pos, SpoolRecord.decode(body)
        except FileNotFoundError:
            return

    def _load_cursor(self) -> Position:
        try:
            seg, offset = (int(x) for x in (self.dir / "cursor").read_text().split())
        except (OSError, ValueError):
            seg, offset = (min(self._segments) if self._segments else 0), 0
        if self._segments and seg < min(self._segments):
            seg, offset = min(self._segments), 0
        return seg, offset

    def _save_cursor(self) -> None:
        tmp = self.dir / "cursor.tmp"
        tmp.write_text(f"{self._cursor[0]} {self._cursor[1]}\n")
        os.replace(tmp, self.dir / "cursor")

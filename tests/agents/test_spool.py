"""The on-disk spool: order, persistence, the bound (oldest dropped and counted), torn writes."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from guard.agents.spool import Spool, SpoolRecord


def _record(i: int, size: int = 100) -> SpoolRecord:
    key = None if i % 5 == 0 else f"node-{i % 7}".encode()
    return SpoolRecord(
        f"guard.topic{i % 3}", key, str(i).encode().ljust(size, b"."), 1_700_000_000_000 + i
    )


def _replay_all(spool: Spool, batch: int = 7) -> list[SpoolRecord]:
    out = []
    while True:
        got = spool.peek(batch)
        if not got:
            return out
        out.extend(r for _, r in got)
        spool.commit(got[-1][0], len(got))


def test_records_come_back_in_order_across_segments_and_a_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000)
    records = [_record(i) for i in range(100)]
    for r in records[:60]:
        spool.append(r)
    first = spool.peek(25)
    spool.commit(first[-1][0], 25)
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1000)
    assert len(again) == 35
    for r in records[60:]:
        again.append(r)
    assert [r for _, r in first] + _replay_all(again) == records
    assert len(again) == 0 and again.dropped == 0 and not list(tmp_path.glob("*.seg"))


def test_beyond_the_bound_the_oldest_are_dropped_and_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=20_000, segment_bytes=2_000)
    records = [_record(i) for i in range(1000)]
    for r in records:
        spool.append(r)
    assert spool.size_bytes <= 20_000
    kept = _replay_all(spool)
    assert spool.dropped + len(kept) == 1000 and spool.dropped > 0
    assert kept == records[-len(kept) :]  # the newest survive, in order


def test_a_torn_write_at_the_end_is_ignored(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(5):
        spool.append(_record(i))
    spool.close()
    segment = sorted(tmp_path.glob("*.seg"))[-1]
    with open(segment, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")  # a crash mid-append
    assert _replay_all(Spool(tmp_path, max_bytes=1 << 20)) == [_record(i) for i in range(5)]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 30)),
            st.tuples(st.just("replay"), st.integers(1, 40)),
            st.tuples(st.just("reopen"), st.just(0)),
        ),
        max_size=30,
    ),
    bound=st.sampled_from([3_000, 50_000, 1 << 20]),
)
def test_nothing_is_lost_or_reordered_below_the_bound(
    ops: list[tuple[str, int]], bound: int
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        spool = Spool(directory, max_bytes=bound, segment_bytes=1_000)
        appended: list[SpoolRecord] = []
        replayed: list[SpoolRecord] = []
        n = 0
        for op, arg in ops:
            if op == "append":
                for _ in range(arg):
                    appended.append(_record(n, size=50))
                    spool.append(appended[-1])
                    n += 1
            elif op == "replay":
                got = spool.peek(arg)
                if got:
                    spool.commit(got[-1][0], len(got))
                    replayed.extend(r for _, r in got)
            else:
                dropped = spool.dropped
                spool.close()
                spool = Spool(directory, max_bytes=bound, segment_bytes=1_000)
                spool.dropped = dropped
        replayed.extend(_replay_all(spool))
        # Order is kept; what is missing is exactly what the spool says it dropped.
        positions = [appended.index(r) for r in replayed]
        assert positions == sorted(positions)
        assert len(appended) - len(replayed) == spool.dropped
        if bound == 1 << 20:
            assert replayed == appended

"""faust's Kafka consumer with a leaner hand-off of each fetched record.

faust's consumer hands every fetched record to the app with ``await
wait_first(callback(message), suspend_flow.wait())``: four tasks and an ``asyncio.wait``
per record, so that a rebalance (``suspend_flow``) can abandon a hand-off that blocks on
flow control, a full stream buffer or a full producer buffer. In a worker that is a
tenth of its time (py-spy, batched records, see ``benchmarks/streams_throughput.py
--py-spy``). Almost every hand-off completes without blocking, so here it starts eagerly:
the callback runs in the drain loop until it either finishes (no task at all) or first
waits; only then is the rest of it run as a task under the same ``wait_first`` guard as
faust's. What happens to a record (its offset bookkeeping, gaps, commits, the guard) is
faust's, unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from faust.sensors import Monitor
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["LeanConsumer", "LeanTransport", "QuietMonitor", "start_eagerly"]


class QuietMonitor(Monitor):
    """faust's Monitor without its bookkeeping per record and per event (counters by topic
    and stream, timings of each event): the web views that show them are off in Guard's
    workers, whose own counters and ``/metrics`` report what they do. Commits, offsets,
    rebalances and producer errors are still recorded."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        pass

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_send_initiated(
        self, producer: Any, topic: str, message: Any, keysize: int, valsize: int
    ) -> None:
        return None

    def on_send_completed(self, producer: Any, state: Any, metadata: Any) -> None:
        pass

    def on_table_get(self, table: Any, key: Any) -> None:
        pass

    def on_table_set(self, table: Any, key: Any, value: Any) -> None:
        pass


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Run ``coro`` on from its first wait (``waiting``: the future it yielded, or None
    for a bare yield) as its task would, cancellation included."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False
                await asyncio.wait([waiting])
        except asyncio.CancelledError as exc:
            if waiting is not None:
                waiting.cancel()
            try:  # let it unwind (locks, finally blocks) as a cancelled task does
                coro.throw(exc)
            except BaseException:  # its own CancelledError, or what it raised on the way
                pass
            else:
                coro.close()
            raise
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any] | None:
    """Run ``coro`` here up to its first wait: None if it finished without one (its result
    is dropped), else a coroutine that runs the rest of it. Exceptions it raises before
    its first wait propagate."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return _resume(coro, waiting)


class LeanConsumer(faust_aiokafka.Consumer):
    """aiokafka consumer whose drain loop hands records over eagerly (module docstring)."""

    async def _hand_over(self, message: Any) -> None:
        handed = self.callback(message)
        rest = start_eagerly(handed) if isinstance(handed, Coroutine) else handed
        if rest is not None:  # it waits: finish it under faust's guard
            await self.wait_first(rest, self.suspend_flow.wait())

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - faust's loop
        consumer_stopped = self._stopped.is_set
        fetcher_stopped = fetcher._stopped.is_set
        read_offset = self._read_offset
        acks_enabled_for = self.app.topics.acks_enabled_for
        commit_every = self._commit_every
        hand_over = self._hand_over
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                self.diag.set_flag(CONSUMER_FETCHING)
                records = self.getmany(timeout=1.0)
                await self.sleep(0)
                if not self.should_stop:
                    since_yield = 0
                    async for tp, message in records:
                        since_yield += 1
                        if since_yield > 100:
                            await asyncio.sleep(0)
                            since_yield = 0
                        offset = message.offset
                        r_offset = read_offset[tp]
                        if r_offset is not None and offset < r_offset:
                            continue  # faust drops what it has read already
                        if r_offset and offset - r_offset > 1 and acks_enabled_for(message.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        await hand_over(message)
                        read_offset[tp] = offset
                self.diag.unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)


class LeanTransport(faust_aiokafka.Transport):
    Consumer = LeanConsumer

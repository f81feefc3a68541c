"""The faust worker's eager record hand-off: a callback that must wait still completes,
is cancelled as a task would be, and raises what it raises (real asyncio, no broker)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from guard.streams.faust_transport import start_eagerly

T = TypeVar("T")


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    """The worker runs on uvloop where installed; both loops must behave alike."""
    if request.param == "asyncio":
        return asyncio.run
    import uvloop  # a dependency on every platform the workers run on

    return uvloop.run  # type: ignore[no-any-return]


async def _deliver(lock: asyncio.Lock, log: list[str]) -> str:
    log.append("start")
    try:
        async with lock:
            log.append("delivered")
            return "done"
    finally:
        log.append("finally")


def test_a_hand_over_that_does_not_wait_finishes_at_once(run: Callable[..., Any]) -> None:
    async def main() -> list[str]:
        log: list[str] = []
        assert start_eagerly(_deliver(asyncio.Lock(), log)) is None
        return log

    assert run(main()) == ["start", "delivered", "finally"]


def test_a_hand_over_that_waits_finishes_when_it_can(run: Callable[..., Any]) -> None:
    async def main() -> tuple[str, list[str], list[str]]:
        lock, log = asyncio.Lock(), []
        await lock.acquire()
        rest = start_eagerly(_deliver(lock, log))
        assert rest is not None
        before = list(log)
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0.01)
        lock.release()
        return await asyncio.wait_for(task, 2), before, log

    result, before, log = run(main())
    assert result == "done"
    assert before == ["start"]  # it ran up to the held lock, not beyond
    assert log == ["start", "delivered", "finally"]


def test_a_cancelled_hand_over_unwinds_and_leaves_no_waiter(run: Callable[..., Any]) -> None:
    async def main() -> tuple[list[str], bool]:
        lock, log = asyncio.Lock(), []
        await lock.acquire()
        rest = start_eagerly(_deliver(lock, log))
        assert rest is not None
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        lock.release()
        await asyncio.sleep(0)
        return log, lock.locked()

    log, locked = run(main())
    assert log == ["start", "finally"]  # never delivered, its finally ran
    assert not locked  # the cancelled waiter did not take the lock after the release


def test_errors_of_a_hand_over_propagate(run: Callable[..., Any]) -> None:
    async def fails_at_once() -> None:
        raise ValueError("bad record")

    async def fails_later(event: asyncio.Event) -> None:
        await event.wait()
        raise KeyError("later")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad record"):
            start_eagerly(fails_at_once())
        event = asyncio.Event()
        rest = start_eagerly(fails_later(event))
        assert rest is not None
        task = asyncio.ensure_future(rest)
        event.set()
        with pytest.raises(KeyError):
            await task

    run(main())

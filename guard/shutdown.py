"""Stop a long-running command on SIGTERM or SIGINT, the one way every command does it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["stop_on_signals"]


@contextmanager
def stop_on_signals(
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> Iterator[threading.Event]:
    """An event set by the first of ``signals``; the previous handlers come back on exit.

    >>> with stop_on_signals() as stop:
    ...     stop.is_set()
    False
    """
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _on_signal) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""Shared pieces of the orchestrator tests: flags, a settable clock, a gated executor."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from guard.schemas import Flag, SweepCheck
from guard.sweeps.executors import SimulatedSweepExecutor
from guard.sweeps.webhook import SIGNATURE_HEADER, verify_signature

NODES = [f"node-{i:03d}" for i in range(32)]
SECRET = b"hook-secret"


def flag(
    node: str | None,
    fid: str,
    ts: float,
    severity: str = "critical",
    category: str = "straggler",
    gpu: int | None = 3,
    window_s: float | None = None,
) -> Flag:
    return Flag(
        id=fid,
        ts=ts,
        node=node,
        job="job-a",
        gpu=gpu,
        detector="peer_straggler",
        category=category,  # type: ignore[arg-type]
        severity=severity,  # type: ignore[arg-type]
        score=2.5,
        window_s=window_s,
    )


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_767_226_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class GatedExecutor:
    """The simulated executor, but each sweep waits until the test opens the gate."""

    def __init__(self, inner: SimulatedSweepExecutor) -> None:
        self.inner = inner
        self.sweep_kinds = inner.sweep_kinds
        self.gate = threading.Event()
        self.started: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        with self._lock:
            self.started.append((node, sweep))
        self.gate.wait(60)
        return self.inner.run(node, sweep, peers, now)


def wait_until(predicate: Callable[[], Any], timeout_s: float = 60.0, tick: Any = None) -> Any:
    """Poll until ``predicate()`` is truthy (calling ``tick`` between polls); fail after
    ``timeout_s``, which bounds a hang and says nothing about speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        if tick is not None:
            tick()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s:g} s")
        time.sleep(0.05)


class Receiver:
    """Answers 401 to a bad signature, 503 to the first ``fail_first`` attempts, then the
    next of ``script`` (status, headers) while there is one, then 200 to validly signed
    bodies (kept in ``accepted``, their paths in ``paths``)."""

    def __init__(self, fail_first: int = 1) -> None:
        self.fail_first = fail_first
        self.script: list[tuple[int, dict[str, str]]] = []
        self.attempts: list[float] = []
        self.accepted: list[Any] = []
        self.paths: list[str] = []
        self.raw: list[tuple[bytes, str]] = []  # (body, signature header) as received
        self.bad_signatures = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.attempts.append(time.monotonic())
                receiver.raw.append((body, self.headers.get(SIGNATURE_HEADER, "")))
                extra: dict[str, str] = {}
                if not verify_signature(SECRET, body, self.headers.get(SIGNATURE_HEADER)):
                    receiver.bad_signatures += 1
                    self.send_response(401)
                elif len(receiver.attempts) <= receiver.fail_first:
                    self.send_response(503)
                elif receiver.script:
                    status, extra = receiver.script.pop(0)
                    self.send_response(status)
                else:
                    receiver.accepted.append(json.loads(body))
                    receiver.paths.append(self.path)
                    self.send_response(200)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

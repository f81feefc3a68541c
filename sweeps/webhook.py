"""Webhook on node-state changes: Alertmanager-v4-shaped JSON, signed, retried, never blocking.

Each state change becomes one alert (``firing`` while the node is out of the healthy state,
``resolved`` when it is healthy again) in the body Alertmanager's webhook receiver sends,
so existing receivers (PagerDuty bridges, chat relays) understand it. The body is signed
with HMAC-SHA256 over the exact bytes sent: header ``X-Guard-Signature: sha256=<hex>``.

:class:`WebhookNotifier` queues notifications and delivers them from its own thread with
exponential backoff; when the queue is full the oldest is dropped, so a dead receiver can
never stall the state machine.

Example
-------
>>> body = b'{"version":"4"}'
>>> verify_signature(b"s3cret", body, sign(b"s3cret", body))
True
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import threading
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any

from guard.schemas import NodeState, stable_id

__all__ = [
    "SIGNATURE_HEADER",
    "WebhookNotifier",
    "alertmanager_payload",
    "sign",
    "verify_signature",
]

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Guard-Signature"
_ZERO_TIME = "0001-01-01T00:00:00Z"


def sign(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify_signature(secret: bytes, body: bytes, header: str | None) -> bool:
    return header is not None and hmac.compare_digest(sign(secret, body), header)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def alertmanager_payload(state: NodeState, external_url: str = "") -> dict[str, Any]:
    """One state change as an Alertmanager v4 webhook message."""
    status = "resolved" if state.state == "healthy" else "firing"
    labels = {"alertname": "GuardNodeHealth", "node": state.node, "state": state.state}
    severity = {"suspect": "warning", "healthy": "info"}.get(state.state, "critical")
    alert = {
        "status": status,
        "labels": {**labels, "severity": severity},
        "annotations": {
            "summary": f"node {state.node}: {state.prev or 'unknown'} -> {state.state}",
            "description": state.reason,
            "actor": state.actor,
        },
        "startsAt": _rfc3339(state.ts),
        "endsAt": _rfc3339(state.ts) if status == "resolved" else _ZERO_TIME,
        "generatorURL": external_url,
        "fingerprint": stable_id("GuardNodeHealth", state.node)[:16],
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="GuardNodeHealth", node="{state.node}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "guard",
        "groupLabels": {"alertname": "GuardNodeHealth", "node": state.node},
        "commonLabels": alert["labels"],
        "commonAnnotations": alert["annotations"],
        "externalURL": external_url,
        "alerts": [alert],
    }


class WebhookNotifier:
    """Delivers node-state webhooks from a background thread (``notify`` never blocks)."""

    def __init__(
        self,
        url: str,
        secret: str | bytes | None = None,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        max_queue: int = 1000,
    ) -> None:
        self.url = url
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._queue: collections.deque[NodeState] = collections.deque(maxlen=max_queue)
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    def start(self) -> WebhookNotifier:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="guard-webhook", daemon=True)
            self._thread.start()
        return self

    def notify(self, state: NodeState) -> None:
        with self._wake:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
                log.warning("webhook queue full: dropping the oldest notification")
            self._queue.append(state)
            self._wake.notify()

    def __call__(self, message: object) -> None:
        """As an orchestrator listener: notify on node states, ignore the rest."""
        if isinstance(message, NodeState):
            self.notify(message)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after delivering what is queued, waiting at most ``timeout_s``."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def pending(self) -> int:
        return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stop.is_set():
                    self._wake.wait()
                if not self._queue:
                    return
                state = self._queue.popleft()
            self._deliver(state)

    def _deliver(self, state: NodeState) -> bool:
        body = json.dumps(alertmanager_payload(state), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "guard-orchestrator"}
        if self.secret:
            headers[SIGNATURE_HEADER] = sign(self.secret, body)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    if 200 <= response.status < 300:
                        self.delivered += 1
                        return True
                    error = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                error = str(exc)
            if attempt == self.retries:
                break
            log.info("webhook attempt %d to %s failed (%s); retrying", attempt + 1, self.url, error)
            # Waiting on the stop event keeps shutdown prompt: after stop() retries go at once.
            self._stop.wait(delay)
            delay *= 2
        self.failed += 1
        log.warning(
            "webhook to %s gave up on %s -> %s: %s", self.url, state.node, state.state, error
        )
        return False

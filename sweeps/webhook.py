"""Node-health notifications: signed webhooks, or alerts posted to Alertmanager's API.

Each node that leaves the healthy state opens an *episode* that lasts until it is healthy
again. The episode is one alert whose identity never changes: labels
``{alertname="GuardNodeHealth", node, category}``, the category being that of the flag that
made the node suspect (``operator`` for an operator's request, ``unknown`` when the
orchestrator restarted mid-episode and the reason no longer names one). Everything that
changes — state, previous state, severity, reason, actor — travels in annotations;
``startsAt`` is the episode's start and is kept on every update; ``endsAt`` is set when the
node is healthy again (resolved); ``generatorURL`` is the node's Grafana view (a URL template
with ``{node}``).

Two modes (``orchestrator.webhook_mode``):

* ``webhook`` — one Alertmanager-v4 *webhook receiver* message per state change, to
  ``webhook_url``, so existing receivers (PagerDuty bridges, chat relays) understand it;
* ``alertmanager`` — the alert itself posted to ``<webhook_url>/api/v2/alerts`` (a JSON list,
  Alertmanager's API v2), and active alerts re-sent every ``webhook_resend_s``: Alertmanager
  ends an alert that is not re-sent within its ``resolve_timeout``.

With a secret, every request carries ``X-Guard-Signature: t=<unix time>,v1=<hex>``, the
HMAC-SHA256 of ``"<t>." + body``: a receiver that checks the signature and that ``t`` is
recent (:func:`verify_signature`) cannot be fed a captured request again later.

:class:`WebhookNotifier` delivers from its own thread: 5xx, 429 (after ``Retry-After``) and
network errors are retried with exponential backoff; any other 4xx is given up at once (the
request itself is wrong, sending it again will not help). When the queue is full the oldest
notification is dropped, so a dead receiver can never stall the state machine.

Example
-------
>>> body = b'{"version":"4"}'
>>> header = sign(b"s3cret", body, now=1767225600)
>>> header[:13]
't=1767225600,'
>>> verify_signature(b"s3cret", body, header, now=1767225660)
True
>>> verify_signature(b"s3cret", body, header, now=1767225600 + 3600)  # replayed an hour later
False
"""

from __future__ import annotations

import collections
import email.utils
import hashlib
import hmac
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from guard.schemas import CATEGORIES, NodeState, stable_id

from .metrics import webhook_delivery

__all__ = [
    "SIGNATURE_HEADER",
    "Episode",
    "WebhookNotifier",
    "alert",
    "alertmanager_payload",
    "episode_category",
    "sign",
    "verify_signature",
]

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Guard-Signature"
ALERTNAME = "GuardNodeHealth"
ALERTS_PATH = "/api/v2/alerts"
_ZERO_TIME = "0001-01-01T00:00:00Z"
#: Longest wait a Retry-After may impose, s: a receiver cannot park the notifier for hours.
MAX_RETRY_AFTER_S = 300.0
_FLAG_IN_REASON = re.compile(r"\b(?:info|warning|critical) ([a-z_]+) flag\b")


def _mac(secret: bytes, t: int, body: bytes) -> str:
    return hmac.new(secret, str(t).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: bytes, body: bytes, now: float | None = None) -> str:
    """The signature header value for ``body`` sent at ``now`` (default: the clock)."""
    t = int(time.time() if now is None else now)
    return f"t={t},v1={_mac(secret, t, body)}"


def verify_signature(
    secret: bytes,
    body: bytes,
    header: str | None,
    tolerance_s: float = 300.0,
    now: float | None = None,
) -> bool:
    """True when ``header`` signs ``body`` with ``secret`` and its time is within
    ``tolerance_s`` of ``now``. What a receiver runs (see docs/orchestrator.md)."""
    if not header:
        return False
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        t = int(fields.get("t", ""))
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    return hmac.compare_digest(_mac(secret, t, body), fields.get("v1", ""))


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def episode_category(state: NodeState) -> str:
    """The category an episode is filed under: the first flag category its reason names."""
    if state.actor.startswith("operator"):
        return "operator"
    for match in _FLAG_IN_REASON.finditer(state.reason):
        if match.group(1) in CATEGORIES:
            return match.group(1)
    return "unknown"


@dataclass
class Episode:
    """One node's time out of the healthy state: one alert, fixed labels."""

    node: str
    category: str
    starts_at: float
    last: NodeState


def alert(episode: Episode, generator_url: str = "") -> dict[str, Any]:
    """The episode as an Alertmanager alert (API v2 fields, plus ``status``)."""
    state = episode.last
    resolved = state.state == "healthy"
    return {
        "status": "resolved" if resolved else "firing",
        "labels": {"alertname": ALERTNAME, "node": episode.node, "category": episode.category},
        "annotations": {
            "state": state.state,
            "prev": state.prev or "",
            "severity": {"suspect": "warning", "healthy": "info"}.get(state.state, "critical"),
            "summary": f"node {state.node}: {state.prev or 'unknown'} -> {state.state}",
            "description": state.reason,
            "actor": state.actor,
        },
        "startsAt": _rfc3339(episode.starts_at),
        "endsAt": _rfc3339(state.ts) if resolved else _ZERO_TIME,
        "generatorURL": generator_url.replace("{node}", episode.node),
    }


def alertmanager_payload(episode: Episode, generator_url: str = "") -> dict[str, Any]:
    """The episode's latest change as an Alertmanager v4 webhook-receiver message."""
    body = alert(episode, generator_url)
    body["fingerprint"] = stable_id(ALERTNAME, episode.node, episode.category)[:16]
    group = {"alertname": ALERTNAME, "node": episode.node}
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{ALERTNAME}", node="{episode.node}"}}',
        "truncatedAlerts": 0,
        "status": body["status"],
        "receiver": "guard",
        "groupLabels": group,
        "commonLabels": body["labels"],
        "commonAnnotations": body["annotations"],
        "externalURL": "",
        "alerts": [body],
    }


def _retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class WebhookNotifier:
    """Delivers node-health notifications from a background thread (``notify`` never
    blocks). ``mode``: ``webhook`` or ``alertmanager`` (see the module doc)."""

    def __init__(
        self,
        url: str,
        secret: str | bytes | None = None,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        max_queue: int = 1000,
        mode: Literal["webhook", "alertmanager"] = "webhook",
        generator_url: str = "",
        resend_s: float = 60.0,
    ) -> None:
        self.mode = mode
        self.url = url
        if mode == "alertmanager" and not url.rstrip("/").endswith(ALERTS_PATH):
            self.url = url.rstrip("/") + ALERTS_PATH
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.generator_url = generator_url
        self.resend_s = resend_s
        self._queue: collections.deque[NodeState] = collections.deque(maxlen=max_queue)
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: open episodes by node (the delivery thread's own)
        self.episodes: dict[str, Episode] = {}
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.resent = 0

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
        resend_at = time.monotonic() + self.resend_s
        while True:
            with self._wake:
                while not self._queue and not self._stop.is_set():
                    if self.mode != "alertmanager":
                        self._wake.wait()
                        continue
                    remaining = resend_at - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wake.wait(remaining)
                if not self._queue and self._stop.is_set():
                    return
                state = self._queue.popleft() if self._queue else None
            if state is not None:
                self._deliver(self._episode(state))
                continue
            resend_at = time.monotonic() + self.resend_s
            if self.episodes:  # Alertmanager ends alerts that are not sent again
                self._post([alert(e, self.generator_url) for e in self.episodes.values()])
                self.resent += 1

    def _episode(self, state: NodeState) -> Episode:
        episode = self.episodes.get(state.node)
        if episode is None:
            episode = Episode(state.node, episode_category(state), state.ts, state)
        episode.last = state
        if state.state == "healthy":
            self.episodes.pop(state.node, None)
        else:
            self.episodes[state.node] = episode
        return episode

    def _deliver(self, episode: Episode) -> bool:
        if self.mode == "alertmanager":
            payload: Any = [alert(episode, self.generator_url)]
        else:
            payload = alertmanager_payload(episode, self.generator_url)
        start = time.monotonic()
        delivered = self._post(payload)
        webhook_delivery(delivered, time.monotonic() - start)
        if delivered:
            self.delivered += 1
            return True
        self.failed += 1
        state = episode.last
        log.warning("webhook to %s gave up on %s -> %s", self.url, state.node, state.state)
        return False

    def _post(self, payload: Any) -> bool:
        body = json.dumps(payload, separators=(",", ":")).encode()
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            error, wait = self._attempt(body)
            if error is None:
                return True
            if wait is None or attempt == self.retries:
                log.warning("webhook to %s failed: %s", self.url, error)
                return False
            wait = max(wait, delay)
            log.info("webhook attempt %d to %s failed (%s); again in %.3g s", attempt + 1,
                     self.url, error, wait)  # fmt: skip
            # Waiting on the stop event keeps shutdown prompt: after stop() retries go at once.
            self._stop.wait(wait)
            delay *= 2
        return False

    def _attempt(self, body: bytes) -> tuple[str | None, float | None]:
        """One POST: (None, None) when delivered, else (the error, the least wait before a
        retry, or None when retrying cannot help)."""
        headers = {"Content-Type": "application/json", "User-Agent": "guard-orchestrator"}
        if self.secret:
            headers[SIGNATURE_HEADER] = sign(self.secret, body)  # fresh time on every attempt
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                if 200 <= response.status < 300:
                    return None, None
                return f"HTTP {response.status}", 0.0
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
                return f"HTTP {exc.code}", min(after or 0.0, MAX_RETRY_AFTER_S)
            return f"HTTP {exc.code} (not retried: the receiver refused the request)", None
        except (urllib.error.URLError, OSError) as exc:
            return str(exc), 0.0

"""Node-health notifications: signed webhooks, or alerts posted to Alertmanager's API.

Each node that leaves the healthy state opens an *episode* that lasts until it is healthy
again: an alert with the labels ``{alertname="GuardNodeHealth", node, category, severity}``,
the category being that of the flag that made the node suspect (``operator`` for an
operator's request, ``unknown`` when the reason no longer names one), the severity
``warning`` while the node is suspect and ``critical`` once it is out of the pool — a label,
so that Alertmanager can route and inhibit by it. A severity change is a new alert (labels
are an alert's identity): the warning one is sent resolved, the critical one firing.
Everything else that changes — state, previous state, reason, actor — travels in
annotations; ``startsAt`` is the episode's start; ``endsAt`` is set when the node is healthy
again (resolved); ``generatorURL`` is the node's Grafana view (a URL template with ``{node}``).

Two modes (``orchestrator.webhook_mode``):

* ``webhook`` — one Alertmanager-v4 *webhook receiver* message per state change, to
  ``webhook_url``, so existing receivers (PagerDuty bridges, chat relays) understand it;
* ``alertmanager`` — the alerts themselves posted to ``<webhook_url>/api/v2/alerts`` (a JSON
  list, Alertmanager's API v2), and active alerts re-sent every ``webhook_resend_s``:
  Alertmanager ends an alert that is not re-sent within its ``resolve_timeout``.

Every notification goes to each of ``webhook_url`` and ``webhook_urls`` (an Alertmanager HA
cluster: to every peer, as Prometheus does; they deduplicate), at once; it counts delivered
when one of them took it. Requests carry a bearer token or basic auth when configured, and
HTTPS is verified against ``webhook_ca_file`` when given.

After a restart the orchestrator hands the notifier the open episodes it finds on the
node-state topic (:func:`open_episodes`, :meth:`WebhookNotifier.restore`), so a node that is
still out keeps its alert (same labels) and keeps being re-sent instead of resolving by
timeout. A node-state record carries no episode start: the rebuilt ``startsAt`` is the
episode's first state still on the topic, after compaction the node's latest. Alertmanager
keeps the earliest ``startsAt`` of an alert it still holds, so there the real start survives a
restart that re-sends within its ``resolve_timeout``; a webhook receiver sees the later one.

When too many recent sweeps failed and the orchestrator stops sweeping, one more alert fires,
``{alertname="GuardSweepsStopped", severity="critical"}`` (the failed share in its
description), and resolves when sweeping goes on (:meth:`WebhookNotifier.sweeps_stopped`).

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
>>> from guard.schemas import NodeState
>>> [e.node for e in open_episodes([
...     NodeState(ts=1, node="a", state="suspect", prev="healthy", reason="warning nic flag x"),
...     NodeState(ts=2, node="b", state="suspect", prev="healthy"),
...     NodeState(ts=3, node="b", state="healthy", prev="suspect"),
... ])]
['a']
"""

from __future__ import annotations

import base64
import collections
import email.utils
import hashlib
import hmac
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from guard.schemas import NodeState, stable_id

from .metrics import webhook_delivery
from .states import flag_kinds

__all__ = [
    "SIGNATURE_HEADER",
    "Episode",
    "StopEpisode",
    "WebhookNotifier",
    "alert",
    "alertmanager_payload",
    "episode_category",
    "open_episodes",
    "receiver_message",
    "severity_of",
    "sign",
    "stop_alert",
    "verify_signature",
]

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Guard-Signature"
ALERTNAME = "GuardNodeHealth"
STOP_ALERTNAME = "GuardSweepsStopped"
ALERTS_PATH = "/api/v2/alerts"
_ZERO_TIME = "0001-01-01T00:00:00Z"
#: Longest wait a Retry-After may impose, s: a receiver cannot park the notifier for hours.
MAX_RETRY_AFTER_S = 300.0


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
    kinds = flag_kinds(state.reason)
    if kinds:
        return kinds[0][1]
    return "operator" if " by operator" in state.reason else "unknown"


def severity_of(state: NodeState) -> str:
    """The severity label of a node state: warning while suspect, critical once out."""
    return "warning" if state.state in ("suspect", "healthy") else "critical"


@dataclass
class Episode:
    """One node's time out of the healthy state: one alert per severity, fixed labels."""

    node: str
    category: str
    starts_at: float
    last: NodeState
    severity: str = "warning"


def open_episodes(states: Iterable[NodeState]) -> list[Episode]:
    """The episodes still open after ``states`` (the node-state topic, in order): what a
    restarted notifier goes on sending. Operator requests are not states of Guard's."""
    episodes: dict[str, Episode] = {}
    for state in states:
        if state.actor.startswith("operator"):
            continue
        if state.state == "healthy":
            episodes.pop(state.node, None)
            continue
        episode = episodes.get(state.node)
        if episode is None:
            episode = episodes[state.node] = Episode(
                state.node, episode_category(state), state.ts, state
            )
        episode.last, episode.severity = state, severity_of(state)
    return list(episodes.values())


def alert(
    episode: Episode, generator_url: str = "", ended_at: float | None = None
) -> dict[str, Any]:
    """The episode as an Alertmanager alert (API v2 fields, plus ``status``); ``ended_at``:
    resolved then (the alert of a severity the episode left)."""
    state = episode.last
    if ended_at is None and state.state == "healthy":
        ended_at = state.ts
    labels = {"alertname": ALERTNAME, "node": episode.node, "category": episode.category}
    return {
        "status": "firing" if ended_at is None else "resolved",
        "labels": {**labels, "severity": episode.severity},
        "annotations": {
            "state": state.state,
            "prev": state.prev or "",
            "summary": f"node {state.node}: {state.prev or 'unknown'} -> {state.state}",
            "description": state.reason,
            "actor": state.actor,
        },
        "startsAt": _rfc3339(episode.starts_at),
        "endsAt": _ZERO_TIME if ended_at is None else _rfc3339(ended_at),
        "generatorURL": generator_url.replace("{node}", episode.node),
    }


@dataclass
class StopEpisode:
    """Guard's sweeping stopped (too many recent sweeps failed): one fleet-wide alert."""

    starts_at: float
    reason: str
    ended_at: float | None = None


def stop_alert(episode: StopEpisode) -> dict[str, Any]:
    """The stop as an Alertmanager alert (API v2 fields, plus ``status``)."""
    resolved = episode.ended_at is not None
    return {
        "status": "resolved" if resolved else "firing",
        "labels": {"alertname": STOP_ALERTNAME, "severity": "critical"},
        "annotations": {
            "summary": "Guard stopped cordoning and sweeping: too many sweeps failed",
            "description": f"{episode.reason}; a check that fails healthy nodes must not "
            "drain the fleet: look at the failing checks (guard node show NODE)",
        },
        "startsAt": _rfc3339(episode.starts_at),
        "endsAt": _rfc3339(episode.ended_at) if episode.ended_at is not None else _ZERO_TIME,
        "generatorURL": "",
    }


def alertmanager_payload(episode: Episode, generator_url: str = "") -> dict[str, Any]:
    """The episode's latest change as an Alertmanager v4 webhook-receiver message."""
    return receiver_message(
        [alert(episode, generator_url)], {"alertname": ALERTNAME, "node": episode.node}
    )


def receiver_message(alerts: list[dict[str, Any]], group: dict[str, str]) -> dict[str, Any]:
    """Alerts as one Alertmanager v4 webhook-receiver message grouped by ``group``."""
    for body in alerts:
        body["fingerprint"] = stable_id(*sorted(body["labels"].items()))[:16]
    grouped = ", ".join(f'{k}="{v}"' for k, v in group.items())
    common = dict(alerts[-1]["labels"])
    for body in alerts:
        common = {k: v for k, v in common.items() if body["labels"].get(k) == v}
    firing = any(body["status"] == "firing" for body in alerts)
    return {
        "version": "4",
        "groupKey": f"{{}}:{{{grouped}}}",
        "truncatedAlerts": 0,
        "status": "firing" if firing else "resolved",
        "receiver": "guard",
        "groupLabels": group,
        "commonLabels": common,
        "commonAnnotations": alerts[-1]["annotations"] if len(alerts) == 1 else {},
        "externalURL": "",
        "alerts": alerts,
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
    blocks). ``url``: one receiver or several (each gets every notification); ``mode``:
    ``webhook`` or ``alertmanager`` (see the module doc)."""

    def __init__(
        self,
        url: str | Sequence[str],
        secret: str | bytes | None = None,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        max_queue: int = 1000,
        mode: Literal["webhook", "alertmanager"] = "webhook",
        generator_url: str = "",
        resend_s: float = 60.0,
        *,
        bearer_token: str | None = None,
        basic_auth: tuple[str, str] | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.mode = mode
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("the webhook notifier needs at least one URL")
        if mode == "alertmanager":
            urls = [u if u.rstrip("/").endswith(ALERTS_PATH) else u.rstrip("/") + ALERTS_PATH
                    for u in urls]  # fmt: skip
        self.urls = urls
        self.url = urls[0]
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.generator_url = generator_url
        self.resend_s = resend_s
        self._auth: str | None = None
        if bearer_token:
            self._auth = f"Bearer {bearer_token}"
        elif basic_auth is not None:
            pair = f"{basic_auth[0]}:{basic_auth[1]}".encode()
            self._auth = "Basic " + base64.b64encode(pair).decode()
        self._tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._senders = (
            ThreadPoolExecutor(len(urls), thread_name_prefix="guard-webhook-post")
            if len(urls) > 1
            else None
        )
        self._queue: collections.deque[NodeState | StopEpisode | list[Episode]] = collections.deque(
            maxlen=max_queue
        )
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: open episodes by node (the delivery thread's own)
        self.episodes: dict[str, Episode] = {}
        #: the open stop of sweeping, if any (the delivery thread's own)
        self.stopped: StopEpisode | None = None
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.resent = 0

    def start(self) -> WebhookNotifier:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="guard-webhook", daemon=True)
            self._thread.start()
        return self

    def notify(self, state: NodeState | StopEpisode | list[Episode]) -> None:
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

    def restore(self, episodes: Iterable[Episode]) -> None:
        """Open episodes from before a restart (:func:`open_episodes`): kept and, in
        ``alertmanager`` mode, sent again at once and then with every re-send."""
        self.notify(list(episodes))

    def sweeps_stopped(self, stopped: bool, reason: str) -> None:
        """As an orchestrator stop listener: the fleet alert fires, or resolves."""
        now = time.time()
        self.notify(StopEpisode(now, reason, None if stopped else now))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after delivering what is queued, waiting at most ``timeout_s``."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)

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
                item = self._queue.popleft() if self._queue else None
            if isinstance(item, StopEpisode):
                self._deliver_stop(item)
            elif isinstance(item, NodeState):
                self._deliver(item)
            elif isinstance(item, list):
                self.episodes.update((e.node, e) for e in item)
                if item and self.mode == "alertmanager":
                    self._post([alert(e, self.generator_url) for e in item])
            else:
                resend_at = time.monotonic() + self.resend_s
                alerts = [alert(e, self.generator_url) for e in self.episodes.values()]
                if self.stopped is not None:
                    alerts.append(stop_alert(self.stopped))
                if alerts:  # Alertmanager ends alerts that are not sent again
                    self._post(alerts)
                    self.resent += 1

    def _deliver_stop(self, news: StopEpisode) -> None:
        if news.ended_at is None:
            self.stopped = news
        elif self.stopped is not None:
            news = StopEpisode(self.stopped.starts_at, self.stopped.reason, news.ended_at)
            self.stopped = None
        self._count(self._send([stop_alert(news)], {"alertname": STOP_ALERTNAME}))

    def _alerts(self, state: NodeState) -> list[dict[str, Any]]:
        """The alerts a state change sends: the episode's, after the alert of a severity it
        left (resolved: labels are an alert's identity)."""
        episode = self.episodes.get(state.node)
        out = []
        if episode is None:
            episode = Episode(state.node, episode_category(state), state.ts, state)
        elif state.state != "healthy" and severity_of(state) != episode.severity:
            out.append(alert(episode, self.generator_url, ended_at=state.ts))
        if state.state != "healthy":
            episode.severity = severity_of(state)
        episode.last = state
        if state.state == "healthy":
            self.episodes.pop(state.node, None)
        else:
            self.episodes[state.node] = episode
        out.append(alert(episode, self.generator_url))
        return out

    def _deliver(self, state: NodeState) -> bool:
        delivered = self._send(self._alerts(state), {"alertname": ALERTNAME, "node": state.node})
        if not self._count(delivered):
            log.warning("webhook to %s gave up on %s -> %s", self.url, state.node, state.state)
        return delivered

    def _send(self, alerts: list[dict[str, Any]], group: dict[str, str]) -> bool:
        payload = alerts if self.mode == "alertmanager" else receiver_message(alerts, group)
        start = time.monotonic()
        delivered = self._post(payload)
        webhook_delivery(delivered, time.monotonic() - start)
        return delivered

    def _count(self, delivered: bool) -> bool:
        if delivered:
            self.delivered += 1
        else:
            self.failed += 1
        return delivered

    def _post(self, payload: Any) -> bool:
        """POST to every URL at once; delivered when one of them took it."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        if self._senders is None:
            return self._post_one(self.url, body)
        futures = [self._senders.submit(self._post_one, url, body) for url in self.urls]
        return any([f.result() for f in futures])

    def _post_one(self, url: str, body: bytes) -> bool:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            error, wait = self._attempt(url, body)
            if error is None:
                return True
            if wait is None or attempt == self.retries:
                log.warning("webhook to %s failed: %s", url, error)
                return False
            wait = max(wait, delay)
            log.info("webhook attempt %d to %s failed (%s); again in %.3g s", attempt + 1,
                     url, error, wait)  # fmt: skip
            # Waiting on the stop event keeps shutdown prompt: after stop() retries go at once.
            self._stop.wait(wait)
            delay *= 2
        return False

    def _attempt(self, url: str, body: bytes) -> tuple[str | None, float | None]:
        """One POST: (None, None) when delivered, else (the error, the least wait before a
        retry, or None when retrying cannot help)."""
        headers = {"Content-Type": "application/json", "User-Agent": "guard-orchestrator"}
        if self.secret:
            headers[SIGNATURE_HEADER] = sign(self.secret, body)  # fresh time on every attempt
        if self._auth:
            headers["Authorization"] = self._auth
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout_s, context=self._tls
            ) as response:
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

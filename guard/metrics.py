"""Prometheus metrics of one Guard service: a registry, and ``/metrics`` + ``/healthz``.

A service keeps its own plain counters — the numbers its progress lines print — and
registers them here as callback families (a prometheus_client custom collector reads them
at scrape time): a progress line and a scrape read the same counters, and the hot paths
pay nothing for being observed. Consumer lag comes from librdkafka's statistics
(:meth:`Metrics.kafka_conf`) or is set by the service (faust).

``/healthz`` answers 200 while the service's loop beats (:meth:`Metrics.beat`) and 503 with
the reason once it has not for ``stale_s``; before the first beat, 200 ``starting`` for
``startup_s``.

>>> m = Metrics("streams")
>>> counts = {"gpu": 3}
>>> by_kind = lambda: {(kind,): n for kind, n in counts.items()}
>>> m.counter("guard_messages_total", "messages handled", by_kind, ("kind",))
>>> counts["gpu"] += 1
>>> m.value("guard_messages_total", kind="gpu")
4.0
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from guard.schemas import SchemaError

__all__ = ["Metrics", "MetricsServer", "dead_letter_reason"]

log = logging.getLogger("guard.metrics")

#: A family's value now: a number, or label values -> number for a labelled family.
Reading = float | Mapping[tuple[str, ...], float]


def dead_letter_reason(error: BaseException | str) -> str:
    """A short, bounded label for why a record went to the dead letters.

    >>> dead_letter_reason(SchemaError("Field required", kind="gpu", field="ts"))
    'invalid_field'
    >>> dead_letter_reason(SchemaError("not valid JSON: expected value", kind="gpu"))
    'not_json'
    >>> dead_letter_reason(SchemaError("message is 2000000 bytes; the limit is 1048576", "gpu"))
    'too_large'
    """
    if isinstance(error, SchemaError):
        if error.field:
            return "invalid_field"
        if error.reason.startswith("not valid JSON"):
            return "not_json"
        if error.reason.startswith("message is"):
            return "too_large"
        return "invalid_message"
    return error if isinstance(error, str) else type(error).__name__


@dataclass(frozen=True)
class _Family:
    name: str
    doc: str
    kind: str  # counter | gauge
    labels: tuple[str, ...]
    read: Callable[[], Reading]


class Metrics(Collector):
    """The metric families of one service process, in their own registry."""

    def __init__(self, service: str, stale_s: float = 60.0, startup_s: float = 300.0) -> None:
        self.service = service
        self.stale_s = stale_s
        self.startup_s = startup_s
        self.started = time.monotonic()
        self.last_beat: float | None = None
        self.lag: dict[tuple[str, str], float] = {}
        self._families: dict[str, _Family] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.gauge("guard_up", "1 while the service runs", lambda: {(service,): 1}, ("service",))
        self.gauge(
            "guard_consumer_lag",
            "records between a consumer's position and the partition's end",
            lambda: dict(self.lag),
            ("topic", "partition"),
        )

    # -- families ------------------------------------------------------------------------

    def counter(
        self, name: str, doc: str, read: Callable[[], Reading], labels: tuple[str, ...] = ()
    ) -> None:
        """A counter family whose value ``read()`` returns (a running total, never reset)."""
        self._add(_Family(name, doc, "counter", labels, read))

    def gauge(
        self, name: str, doc: str, read: Callable[[], Reading], labels: tuple[str, ...] = ()
    ) -> None:
        self._add(_Family(name, doc, "gauge", labels, read))

    def _add(self, family: _Family) -> None:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} is registered twice")
        self._families[family.name] = family

    def collect(self) -> Iterator[Metric]:
        for f in self._families.values():
            metric: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(f.name, f.doc, labels=f.labels)
                if f.kind == "counter"
                else GaugeMetricFamily(f.name, f.doc, labels=f.labels)
            )
            try:
                reading = f.read()
            except Exception as exc:  # one broken reading must not fail the whole scrape
                log.warning("metric %s could not be read: %s", f.name, exc)
                continue
            if isinstance(reading, Mapping):
                for values, number in list(reading.items()):
                    metric.add_metric([str(v) for v in values], float(number))
            else:
                metric.add_metric([], float(reading))
            yield metric

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's current value (tests, the demo), or None if it has none."""
        return self.registry.get_sample_value(name, labels)

    # -- Kafka consumer lag --------------------------------------------------------------

    def kafka_conf(self, interval_ms: int = 5000) -> dict[str, Any]:
        """librdkafka settings that feed ``guard_consumer_lag`` from a consumer's statistics."""
        return {"statistics.interval.ms": interval_ms, "stats_cb": self.on_kafka_stats}

    def on_kafka_stats(self, raw: str) -> None:
        try:
            topics = json.loads(raw).get("topics", {})
        except ValueError:
            return
        for topic, data in topics.items():
            for partition, p in data.get("partitions", {}).items():
                # The position (app_offset: next to consume) against the end; librdkafka's
                # own consumer_lag counts from the committed offset, unknown until a commit.
                end, at = p.get("hi_offset", -1), p.get("app_offset", -1)
                if at < 0:
                    at = p.get("committed_offset", -1)
                if partition != "-1" and end >= 0 and at >= 0:
                    self.lag[(topic, partition)] = max(0, end - at)

    # -- health ----------------------------------------------------------------------------

    def beat(self) -> None:
        """Called from the service's loop: it is making progress."""
        self.last_beat = time.monotonic()

    def health(self) -> tuple[bool, str]:
        now = time.monotonic()
        if self.last_beat is None:
            if now - self.started <= self.startup_s:
                return True, "starting"
            return False, f"no progress since the start {now - self.started:.0f} s ago"
        if now - self.last_beat > self.stale_s:
            return False, f"no progress for {now - self.last_beat:.0f} s"
        return True, "ok"

    def serve(self, port: int, host: str = "0.0.0.0", setting: str = "") -> MetricsServer | None:
        """``/metrics`` and ``/healthz`` on ``host:port`` from a thread; None when ``port`` is
        0 (off) or taken (logged: a clash must not stop the service)."""
        if port == 0:
            return None
        try:
            return MetricsServer(self, host, port).start()
        except OSError as exc:
            log.error(
                "metrics: cannot listen on %s:%d (%s); no /metrics for this %s. Give each "
                "process its own port%s, or 0 to turn it off",
                host,
                port,
                exc,
                self.service,
                f" ({setting})" if setting else "",
            )
            return None


class MetricsServer:
    """A small HTTP server for one :class:`Metrics`: ``/metrics`` and ``/healthz``."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="guard-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics on :%d (/metrics, /healthz)", self.port)
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    metrics: Metrics

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            healthy, why = self.metrics.health()
            self._answer(200 if healthy else 503, f"{why}\n".encode(), "text/plain")
        else:
            self._answer(404, b"try /metrics or /healthz\n", "text/plain")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass

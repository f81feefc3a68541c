"""Prometheus metrics of one Guard service: a registry, and ``/metrics`` + ``/healthz``.

A service keeps its own plain counters — the numbers its progress lines print — and
registers them here as callback families (a prometheus_client custom collector reads them
at scrape time): a progress line and a scrape read the same counters, and the hot paths
pay nothing for being observed. Durations are prometheus_client histograms, declared once
per process next to the code that observes them (:mod:`guard.streams.metrics`,
:mod:`guard.sweeps.metrics`) and added to a service's registry with :meth:`Metrics.include`.
Every registry also has the process, platform and garbage-collector collectors and
``guard_build_info{version}``. Consumer lag comes from librdkafka's statistics
(:meth:`Metrics.kafka_conf`; the group is the consumer's own, see :func:`guard.kafka.make_consumer`)
or is set by the service (faust).

The endpoint is prometheus_client's own HTTP server (content negotiation, gzip, OpenMetrics);
``/healthz`` is routed in front of its WSGI app: 200 while the service's loop beats
(:meth:`Metrics.beat`) and 503 with the reason once it has not for ``stale_s``; before the
first beat, 200 ``starting`` for ``startup_s``.

>>> m = Metrics("streams")
>>> counts = {"gpu": 3}
>>> by_kind = lambda: {(kind,): n for kind, n in counts.items()}
>>> m.counter("guard_streams_messages_total", "messages handled", by_kind, ("kind",))
>>> counts["gpu"] += 1
>>> m.value("guard_streams_messages_total", kind="gpu")
4.0
>>> m.value("guard_build_info", version=installed_version())
1.0
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Info,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from guard import installed_version
from guard.schemas import SchemaError

__all__ = ["DEAD_LETTER_REASONS", "LagFeed", "Metrics", "MetricsServer", "dead_letter_reason"]

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


#: What :func:`dead_letter_reason` answers for a bad message (other failures: their type).
DEAD_LETTER_REASONS = ("not_json", "invalid_field", "invalid_message", "too_large")


@dataclass(frozen=True)
class _Family:
    name: str
    doc: str
    kind: str  # counter | gauge
    labels: tuple[str, ...]
    read: Callable[[], Reading]
    zero: tuple[tuple[str, ...], ...] = ()


class Metrics(Collector):
    """The metric families of one service process, in their own registry."""

    def __init__(self, service: str, stale_s: float = 60.0, startup_s: float = 300.0) -> None:
        self.service = service
        self.stale_s = stale_s
        self.startup_s = startup_s
        self.started = time.monotonic()
        self.last_beat: float | None = None
        #: records behind, by (consumer group, topic, partition)
        self.lag: dict[tuple[str, ...], float] = {}
        self._families: dict[str, _Family] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.include(PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
        build = Info("guard_build", "the Guard release this process runs", registry=None)
        build.info({"version": installed_version()})
        self.include(build)
        self.gauge("guard_up", "1 while the service runs", lambda: {(service,): 1}, ("service",))
        self.gauge(
            "guard_healthy",
            "1 while /healthz answers 200 (the service's loop turns), else 0",
            lambda: float(self.health()[0]),
        )
        self.gauge(
            "guard_consumer_lag",
            "records between a consumer's position and the partition's end",
            lambda: dict(self.lag),
            ("group", "topic", "partition"),
        )

    # -- families ------------------------------------------------------------------------

    def counter(
        self,
        name: str,
        doc: str,
        read: Callable[[], Reading],
        labels: tuple[str, ...] = (),
        zero: Iterable[tuple[str, ...]] = (),
    ) -> None:
        """A counter family whose value ``read()`` returns (a running total, never reset).
        ``zero``: label values shown as 0 before their first count, so that ``rate()`` and
        ``increase()`` see that first count (a series born at 1 shows no increase)."""
        self._add(_Family(name, doc, "counter", labels, read, tuple(zero)))

    def gauge(
        self, name: str, doc: str, read: Callable[[], Reading], labels: tuple[str, ...] = ()
    ) -> None:
        self._add(_Family(name, doc, "gauge", labels, read))

    def include(self, *collectors: Collector) -> None:
        """Serve these prometheus_client collectors too (histograms declared per process,
        the process collector): each is registered in this service's registry."""
        for collector in collectors:
            self.registry.register(collector)

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
                numbers = {tuple(map(str, k)): float(n) for k, n in list(reading.items())}
                for values in f.zero:
                    numbers.setdefault(values, 0.0)
                for values, number in numbers.items():
                    metric.add_metric(list(values), number)
            else:
                metric.add_metric([], float(reading))
            yield metric

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's current value (tests, the demo), or None if it has none."""
        return self.registry.get_sample_value(name, labels)

    # -- Kafka consumer lag --------------------------------------------------------------

    def kafka_conf(self, interval_ms: int = 5000) -> dict[str, Any]:
        """librdkafka settings that feed ``guard_consumer_lag`` from a consumer's statistics
        (:func:`guard.kafka.make_consumer` names the group: ``stats_cb.for_group``)."""
        return {"statistics.interval.ms": interval_ms, "stats_cb": LagFeed(self)}

    def on_kafka_stats(self, raw: str, group: str = "") -> None:
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
                    self.lag[(group, topic, partition)] = max(0, end - at)

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
            httpd, thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            log.error(
                "metrics: cannot listen on %s:%d (%s); no /metrics for this %s. Give each "
                "process its own port (--metrics-port%s), or 0 to turn it off",
                host,
                port,
                exc,
                self.service,
                f" or {setting}" if setting else "",
            )
            return None
        app = httpd.get_app()
        assert app is not None  # start_http_server serves prometheus_client's app
        httpd.set_app(_with_health(app, self))
        server = MetricsServer(httpd, thread)
        log.info("metrics on :%d (/metrics, /healthz)", server.port)
        return server


class LagFeed:
    """librdkafka's ``stats_cb`` for one consumer: its lag, under its group's name."""

    def __init__(self, metrics: Metrics, group: str = "") -> None:
        self.metrics = metrics
        self.group = group

    def for_group(self, group: str) -> LagFeed:
        return LagFeed(self.metrics, group)

    def __call__(self, raw: str) -> None:
        self.metrics.on_kafka_stats(raw, self.group)


@dataclass(frozen=True)
class MetricsServer:
    """prometheus_client's HTTP server of one :class:`Metrics`, running on its thread."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _with_health(app: Callable[..., Iterable[bytes]], metrics: Metrics) -> Callable[..., Any]:
    """prometheus_client's WSGI app with ``/healthz`` in front of it."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return app(environ, start_response)
        healthy, why = metrics.health()
        status = "200 OK" if healthy else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{why}\n".encode()]

    return routed

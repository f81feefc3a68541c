"""Prometheus metrics: a running streams worker's /metrics and /healthz move with its work.

The worker is a real `guard streams` process on the session's broker; the scrape is plain
HTTP, parsed with prometheus_client's own text parser.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from guard import installed_version
from guard.agents.daemon import AgentDaemon, JobTracker
from guard.agents.metrics import observe_agent
from guard.agents.nic import NicCollector
from guard.agents.publisher import Publisher
from guard.config import Settings
from guard.kafka import make_producer, produce
from guard.metrics import Metrics
from guard.streams.metrics import observe_sink
from guard.streams.processing import parse_progress
from guard.streams.sink import ClickHouseSink
from guard.sweeps.executors import SimulatedSweepExecutor
from guard.sweeps.metrics import observe_orchestrator
from guard.sweeps.scheduler import DryRunScheduler
from guard.sweeps.service import KafkaOrchestrator

from ..agents.fake_sysfs import make_fake_sysfs
from ..streams.test_faust_app import gpu_round, streams_worker, wait_for
from ..streams.test_sink import _publish, _run_until
from ..sweeps.helpers import NODES, GatedExecutor, flag, wait_until
from ..sweeps.test_service import send, slow_gpu

SWEEPS = "guard_sweep_duration_seconds"
WEBHOOKS = "guard_webhook_delivery_duration_seconds"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value; {} while unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()


def publish_round(settings: Settings, t0: float, rounds: int, xid_at: int | None) -> int:
    producer = make_producer(settings)
    sent = 0
    for i in range(rounds):
        for node in ("node-a", "node-b", "node-c"):
            xid = 5 if (node == "node-b" and i == xid_at) else None
            for m in gpu_round(t0 + 10 * i, node, xid_gpu=xid):
                produce(producer, settings, m)
                sent += 1
    assert producer.flush(30) == 0
    return sent


@pytest.mark.parametrize("engine", ["native", "faust"])
def test_a_running_worker_serves_metrics_that_move_with_its_work(
    kafka_settings: Settings, tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = kafka_settings
    port = free_port()
    t0 = time.time() - 300
    first = publish_round(settings, t0, 6, xid_at=None)
    log = tmp_path / "worker.log"
    with streams_worker(settings, log, engine, GUARD_STREAMS_WEB_PORT=str(port)):
        records = ("guard_streams_records_total", ())
        wait_for(lambda: scrape(port).get(records) == first, log, 120)
        before = scrape(port)
        assert before[("guard_streams_messages_total", (("kind", "gpu"),))] == first
        assert before[("guard_up", (("service", "streams"),))] == 1
        # prometheus_client's process collector and the release this process runs
        assert before[("process_cpu_seconds_total", ())] > 0
        assert ("guard_build_info", (("version", installed_version()),)) in before
        flag_count = ("guard_flag_latency_seconds_count", (("engine", engine),))
        assert flag_count in before  # the series is there before the first flag
        wait_for(lambda: health(port) == (200, "ok"), log, 30)  # the loop beats

        more = publish_round(settings, t0 + 60, 6, xid_at=3)
        producer = make_producer(settings)
        producer.produce(settings.topic("gpu"), b"\xff not json", b"node-a")
        producer.produce(settings.topic("gpu"), b'{"kind": "gpu", "ts": "x"}', b"node-a")
        assert producer.flush(30) == 0
        total = first + more + 2

        def flagged() -> bool:
            got = scrape(port)
            return (
                got.get(records) == total
                and got.get(
                    ("guard_flags_total", (("category", "gpu_error"), ("severity", "critical"))), 0
                )
                >= 1
            )

        wait_for(flagged, log, 120)
        after = scrape(port)
        assert after[("guard_streams_messages_total", (("kind", "gpu"),))] == first + more
        # every flag sent is one latency observation of this engine: the Xid came ~4 min ago
        flags = sum(v for k, v in after.items() if k[0] == "guard_flags_total")
        assert after[flag_count] == flags >= 1
        latency = ("guard_flag_latency_seconds_sum", (("engine", engine),))
        assert after[latency] / after[flag_count] > 60
        assert after[("guard_dead_letters_total", (("reason", "not_json"),))] == 1
        assert after[("guard_dead_letters_total", (("reason", "invalid_field"),))] == 1
        assert after[("guard_findings_total", ())] > before.get(("guard_findings_total", ()), 0)
        assert ("guard_checkpoints_restored_total", ()) in after

        # consumer lag per partition of the gpu topic: there, and nothing left behind
        def caught_up() -> bool:
            gpu = settings.topic("gpu")
            lags = [
                v
                for (name, labels), v in scrape(port).items()
                if name == "guard_consumer_lag"
                and ("topic", gpu) in labels
                and ("group", f"streams-{settings.kafka.topic_prefix}") in labels  # the app id
            ]
            return len(lags) == settings.kafka.telemetry_partitions and not any(lags)

        wait_for(caught_up, log, 60)
        assert ("guard_checkpoints_refused_total", ()) in after

        # the progress line reads the same counters as the scrape
        def reported() -> dict[str, int]:
            lines = log.read_text(errors="replace").splitlines()
            reports = [r for r in map(parse_progress, lines) if r is not None]
            return reports[-1] if reports else {}

        # (a flag from a later tick can land between a line and a scrape: the next line has it)
        def agree() -> bool:
            line, now = reported(), scrape(port)
            flags = sum(v for k, v in now.items() if k[0] == "guard_flags_total")
            return line.get("telemetry") == total and line.get("flags") == flags

        wait_for(agree, log, 30)
        assert reported()["dead_letters"] == 2


def test_healthz_fails_when_the_loop_stops_beating() -> None:
    metrics = Metrics("sink", stale_s=0.2, startup_s=0.2)
    server = metrics.serve(free_port(), "127.0.0.1")
    assert server is not None
    try:
        assert health(server.port) == (200, "starting")
        time.sleep(0.3)
        code, why = health(server.port)
        assert code == 503 and "no progress since the start" in why
        assert scrape(server.port)[("guard_healthy", ())] == 0  # what the alert rule reads
        metrics.beat()
        assert health(server.port) == (200, "ok")
        assert scrape(server.port)[("guard_healthy", ())] == 1
        time.sleep(0.3)
        code, why = health(server.port)
        assert code == 503 and "no progress for" in why
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
    finally:
        server.close()


def test_labelled_counters_show_known_label_values_as_zero_before_the_first_count() -> None:
    """A series born at 1 shows Prometheus no increase: the first dead letter, flag or failed
    sweep would be invisible to rate(), increase() and the alerting rules."""
    metrics = Metrics("orchestrator")
    reasons: dict[tuple[str, ...], float] = {}
    zero = [("not_json",), ("invalid_field",)]
    metrics.counter("guard_dead_letters_total", "dead letters", lambda: reasons, ("reason",), zero)
    assert metrics.value("guard_dead_letters_total", reason="not_json") == 0
    reasons[("not_json",)] = 1
    reasons[("TypeError",)] = 2
    assert metrics.value("guard_dead_letters_total", reason="not_json") == 1
    assert metrics.value("guard_dead_letters_total", reason="TypeError") == 2
    assert metrics.value("guard_dead_letters_total", reason="invalid_field") == 0


def test_a_taken_port_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert Metrics("agent").serve(port, "127.0.0.1", "metrics.agent_port") is None
    assert "metrics.agent_port" in caplog.text and str(port) in caplog.text
    assert Metrics("agent").serve(0) is None  # 0: off


def test_sink_metrics_count_rows_by_table_and_dead_letters(
    kafka_settings: Settings, store: tuple[Any, Settings]
) -> None:
    client, settings = store
    settings.kafka = kafka_settings.kafka
    messages = [m for t in (0, 10) for m in gpu_round(time.time() - 60 + t, "node-a")]
    sent = len(messages)
    _publish(settings, messages, garbage=b'{"kind": "gpu", "ts": "soon"}')
    metrics = Metrics("sink")
    sink = ClickHouseSink(settings, client, group_id="sink-metrics", metrics=metrics)
    observe_sink(metrics, sink.stats)
    inserts = "guard_sink_insert_duration_seconds_count"
    before = metrics.value(inserts, result="ok") or 0  # histograms are the process's
    try:
        _run_until(sink, lambda: sink.stats.stored == sent and not sink.sealed)
        # librdkafka's statistics come every 5 s: the lag is the sink's group's
        _run_until(sink, lambda: any(g == "sink-metrics" for g, _, _ in metrics.lag))
    finally:
        sink.close()
    assert metrics.value("guard_sink_rows_total", table="gpu_samples") == sent
    assert metrics.value("guard_sink_records_total") == sent + 1
    assert metrics.value(inserts, result="ok") == before + sink.stats.batches
    assert metrics.value("guard_sink_insert_duration_seconds_sum", result="ok") > 0
    assert sink.stats.batches > 0
    assert {g for g, _, _ in metrics.lag} == {"sink-metrics"}
    assert metrics.value("guard_dead_letters_total", reason="invalid_field") == 1
    assert metrics.value("guard_sink_batches_total") == sink.stats.batches >= 1
    assert metrics.health() == (True, "ok")  # the loop beat


def test_orchestrator_metrics_follow_states_sweeps_and_webhook_failures(
    kafka_settings: Settings,
) -> None:
    s = kafka_settings
    s.orchestrator.webhook_url = f"http://127.0.0.1:{free_port()}/hook"  # nobody listens
    s.orchestrator.webhook_retries = 0
    s.orchestrator.max_cordoned_fraction = 2 / 32  # node-005 stays in repair, holding one place
    now = time.time()
    faulty = flag("node-005", "f-5", now - 2)
    send(s, faulty, flag("node-010", "f-10", now - 1), faulty, raw=b"\xff not a flag")
    metrics = Metrics("orchestrator")
    orch = KafkaOrchestrator(
        s,
        scheduler=DryRunScheduler(),
        executor=SimulatedSweepExecutor([slow_gpu("node-005")], seed=3),
        nodes=NODES,
        poll_s=0.05,
        metrics=metrics,
    )
    observe_orchestrator(metrics, orch)
    # read once the histograms are in this registry: they count every sweep of the process
    # (an earlier test's orchestrator too), so only the increase is this one's
    before = {
        (sweep, result): metrics.value(f"{SWEEPS}_count", sweep=sweep, result=result) or 0
        for sweep in ("single", "multi")
        for result in ("passed", "failed")
    }
    failed_webhooks = metrics.value(f"{WEBHOOKS}_count", result="failed") or 0
    orch.start()
    try:
        assert orch.ready.wait(60) and orch.error is None
        wait_until(lambda: metrics.value("guard_nodes", state="healthy") == 1)
        wait_until(lambda: metrics.value("guard_nodes", state="repair") == 1)
        wait_until(lambda: (metrics.value("guard_webhook_failures_total") or 0) >= 4)
    finally:
        orch.stop()
    value = metrics.value
    assert value("guard_sweeps_total", sweep="single", result="failed") == 1
    assert value("guard_sweeps_total", sweep="single", result="passed") == 1
    assert value("guard_sweeps_total", sweep="multi", result="passed") == 1
    assert value("guard_cordoned_nodes") == 1  # one released, one in repair (on the cap)
    assert value("guard_cordon_cap") == orch.core.policy.cordon_limit(len(NODES)) == 2
    assert value("guard_sweeps_stopped") == 0  # 3 sweeps, 1 failed: under both bounds
    assert value("guard_flags_received_total", outcome="duplicate") == 1
    assert value("guard_dead_letters_total", reason="not_json") == 1
    assert value("guard_node_transitions_total", state="cordoned") == 2
    assert value("guard_webhook_deliveries_total") == 0
    # a duration for each sweep and each delivery given up (the histograms are the process's)
    for (sweep, result), was in before.items():
        total = value("guard_sweeps_total", sweep=sweep, result=result) or 0
        assert value(f"{SWEEPS}_count", sweep=sweep, result=result) == was + total
    failures = value("guard_webhook_failures_total")
    assert value(f"{WEBHOOKS}_count", result="failed") == failed_webhooks + failures


def test_the_queued_gauge_counts_suspects_waiting_for_a_sweep_worker(
    kafka_settings: Settings,
) -> None:
    # One sweep worker, busy with node-005: node-010 waits qualified but not cordoned.
    s = kafka_settings
    s.orchestrator.sweep_workers = 1
    s.orchestrator.multi_sweep_peers = 0
    s.orchestrator.max_cordoned_fraction = 4 / 32  # room under the cap: only the worker holds
    now = time.time()
    send(s, flag("node-005", "q-5", now - 2), flag("node-010", "q-10", now - 1))
    metrics = Metrics("orchestrator")
    executor = GatedExecutor(SimulatedSweepExecutor([], seed=3))
    orch = KafkaOrchestrator(
        s, scheduler=DryRunScheduler(), executor=executor, nodes=NODES, poll_s=0.05
    )
    observe_orchestrator(metrics, orch)
    assert metrics.value("guard_sweeps_queued") == 0
    orch.start()
    try:
        assert orch.ready.wait(60) and orch.error is None
        wait_until(lambda: metrics.value("guard_sweeps_queued") == 1)
        assert executor.started == [("node-005", "single")]
        assert metrics.value("guard_nodes", state="suspect") == 1
        assert metrics.value("guard_nodes", state="sweeping") == 1
        assert metrics.value("guard_cordons_held_back") == 0
        executor.gate.set()  # node-005's sweep ends: node-010 takes the worker
        wait_until(lambda: metrics.value("guard_nodes", state="healthy") == 2)
        assert metrics.value("guard_sweeps_queued") == 0
    finally:
        executor.gate.set()
        orch.stop()
    assert executor.started == [("node-005", "single"), ("node-010", "single")]


def test_agent_metrics_count_published_kinds_and_the_spool(
    settings: Settings, tmp_path: Path
) -> None:
    settings.kafka.bootstrap = f"127.0.0.1:{free_port()}"  # nobody listens: all is spooled
    settings.agent.delivery_timeout_s = 1.0
    nic = NicCollector("node-a", str(make_fake_sysfs(tmp_path / "sys")))
    publisher = Publisher(settings, probe_s=0.5)
    daemon = AgentDaemon("node-a", publisher, [nic.sample], JobTracker("job-1"), None, 0.1)
    metrics = Metrics("agent")
    daemon.metrics = metrics
    observe_agent(metrics, daemon)
    try:
        published = sum(daemon.cycle() for _ in range(5))
        wait_until(lambda: publisher.state == "offline", tick=publisher.poll)
        wait_until(lambda: len(publisher.spool) == published, tick=publisher.poll)
    finally:
        publisher.close(timeout_s=1.0)
    assert metrics.value("guard_agent_messages_total", kind="nic") == published > 0
    assert metrics.value("guard_agent_cycles_total") == 5
    assert metrics.value("guard_agent_records_total", outcome="published") == published
    assert metrics.value("guard_agent_spool_records") == len(publisher.spool) == published
    assert metrics.value("guard_agent_spool_bytes") == publisher.spool.size_bytes > 0
    assert metrics.value("guard_agent_spool_dropped_total") == 0
    assert metrics.health() == (True, "ok")


def test_the_examples_in_the_metrics_docstrings_run() -> None:
    import doctest

    import guard.metrics

    result = doctest.testmod(guard.metrics)
    assert result.attempted >= 5 and result.failed == 0

"""A real Prometheus scrapes a short pipeline, and every PromQL query of the dashboards and
every alerting rule's expression is evaluated by it.

The pipeline is Guard's own services, each a `guard` process with its own ``--metrics-port``,
on the session's broker: a node agent (NICs from a fake sysfs tree, the hardware boundary),
a native streams worker, the sink (chDB) and the orchestrator (dry-run scheduler, sweeps
answered from the simulator's truth) with a webhook receiver. A simulated cluster with
faults is replayed into it, with one record that is not JSON. Prometheus is Debian's
(``prometheus``, installed by deploy/tools/debian-tool.sh when missing), scraping every
second. Each query of deploy/grafana/dashboards/guard.json must return at least one series
with a value over the run; each rule's expression must parse and evaluate.
"""

from __future__ import annotations

import http.server
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from guard.config import Settings
from guard.demo import worker_env
from guard.kafka import make_producer

from ..agents.fake_sysfs import make_fake_sysfs
from ..tools import debian_tool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "guard.json"
RULES = ROOT / "deploy" / "prometheus" / "guard-rules.yml"
GUARD = [sys.executable, "-m", "guard.cli"]
#: What Grafana makes of $__rate_interval at a 1 s scrape interval and a short range
#: (max(4 x scrape interval, interval + scrape interval)), rounded up.
RATE_INTERVAL = "15s"
SIM_NODES, SIM_S = 6, 240
#: Queries that rightly stay 0 in this run: nothing fails, no broker outage, no forged
#: checkpoint; the lag comes from librdkafka's statistics every 5 s and the replay's burst
#: may be consumed between two of them.
ZERO_IN_A_HEALTHY_RUN = (
    "guard_webhook_failures_total",
    "guard_agent_spool_bytes",
    "guard_checkpoints_refused_total",
    "guard_consumer_lag",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def service(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def webhook_receiver() -> Iterator[str]:
    """An HTTP endpoint that takes the orchestrator's notifications (200, body discarded)."""

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


class Prometheus:
    """Debian's prometheus on loopback, scraping ``targets`` (job -> port) every second."""

    def __init__(self, tmp: Path, targets: dict[str, int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for job, port in targets.items()
            ],
        }
        self.config = tmp / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.argv = [
            debian_tool("prometheus", "prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]

    def value(self, expr: str) -> float:
        """An instant query's single value (0 when it returns nothing)."""
        result = self.api("query", query=expr)["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False


def wait_until(check: Callable[[], bool], what: str, logs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}\n{tails}")


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def test_a_real_prometheus_scrapes_the_pipeline_and_answers_every_dashboard_query(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    settings = kafka_settings
    ports = {
        "guard-agent": free_port(),
        "guard-streams": free_port(),
        "guard-sink": free_port(),
        "guard-orchestrator": free_port(),
    }
    telemetry, truth = tmp_path / "telemetry.jsonl", tmp_path / "truth.json"
    start = int(time.time()) - SIM_S - 30
    simulated = subprocess.run(
        [
            *GUARD,
            "simulate",
            f"--nodes={SIM_NODES}",
            f"--duration={SIM_S}",
            f"--start-ts={start}",
            "--no-confounders",
            "--fault=slow_gpu:node=node-002:gpu=1:onset=20:slowdown=0.3:pattern=steady",
            "--fault=xid:node=node-004:onset=60",
            f"--out={telemetry}",
            f"--truth={truth}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    env = worker_env(
        settings,
        GUARD_STREAMS_APP_ID=f"streams-{settings.kafka.topic_prefix}",
        GUARD_STREAMS_PROGRESS_S="2",
    )
    logs = {name: tmp_path / f"{name}.log" for name in [*ports, "prometheus"]}
    sysfs = make_fake_sysfs(tmp_path / "sys")
    with ExitStack() as stack:
        hook = stack.enter_context(webhook_receiver())
        prometheus = Prometheus(tmp_path, ports)
        stack.enter_context(service(prometheus.argv, env, logs["prometheus"]))
        for name, argv in {
            "guard-agent": ["agent", "--gpu-source=none", f"--sysfs={sysfs}", "--node=node-nic"],
            "guard-streams": ["streams", "--engine=native"],
            "guard-sink": ["sink", "--group", f"sink-{settings.kafka.topic_prefix}"],
            "guard-orchestrator": ["orchestrator", f"--truth={truth}"],
        }.items():
            extra = {"GUARD_ORCHESTRATOR_WEBHOOK_URL": hook} if name == "guard-orchestrator" else {}
            stack.enter_context(
                service(
                    [*GUARD, *argv, f"--metrics-port={ports[name]}", "--log-level=info"],
                    {**env, **extra},
                    logs[name],
                )
            )
        every_log = list(logs.values())
        wait_until(prometheus.ready, "Prometheus ready", every_log, 60)
        wait_until(
            lambda: prometheus.value('sum(guard_healthy{job=~"guard-.*"})') == len(ports),
            "every service scraped and healthy",
            every_log,
            180,
        )
        began = time.time()

        replayed = subprocess.run(
            [*GUARD, "replay", str(telemetry), "--retime=keep", "--quiet"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert replayed.returncode == 0, replayed.stderr[-2000:]
        producer = make_producer(settings)
        producer.produce(settings.topic("gpu"), b"\xff not json", b"node-001")
        assert producer.flush(30) == 0

        for what in (
            "sum(guard_flag_latency_seconds_count)",
            "sum(guard_sink_insert_duration_seconds_count)",
            "sum(guard_dead_letters_total)",
            "sum(guard_sweep_duration_seconds_count)",
            "sum(guard_webhook_delivery_duration_seconds_count)",
            "sum(guard_agent_cycles_total)",
        ):
            wait_until(lambda what=what: prometheus.value(what) > 0, what, every_log, 240)
        time.sleep(5)  # a few more scrapes after the last change
        ended = time.time()

        empty, flat = [], []
        for title, expr in dashboard_queries():
            promql = expr.replace("$__rate_interval", RATE_INTERVAL)
            assert "$" not in promql, (title, promql)  # a variable this test does not know
            series = prometheus.api(
                "query_range", query=promql, start=str(began), end=str(ended), step="1"
            )["result"]
            values = [float(v) for s in series for _, v in s["values"]]
            values = [v for v in values if not math.isnan(v)]
            if not values:  # no series, or NaN only
                empty.append(f"{title}: {promql}")
            elif not any(values) and not any(q in promql for q in ZERO_IN_A_HEALTHY_RUN):
                flat.append(f"{title}: {promql}")  # e.g. a counter born at 1: no increase
        assert not empty, "queries without data:\n" + "\n".join(empty)
        assert not flat, "queries that stayed 0 through the run:\n" + "\n".join(flat)

        # every alerting rule loaded and evaluated without an error
        groups = prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert {r["name"] for r in rules} == {
            r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
        }
        assert all(r["health"] == "ok" for r in rules), [
            (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
        ]
        # nothing is down or stalled in a healthy run
        firing = [a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]]
        assert not {"GuardServiceDown", "GuardServiceStalled"} & set(firing), firing
        assert "guard_build_info" in prometheus.api("label/__name__/values")

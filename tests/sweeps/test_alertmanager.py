"""Alerts into a real Alertmanager (Debian's prometheus-alertmanager 0.25), read back from its
API v2: severity as a routing label, every peer of an HA pair, basic auth over HTTPS with a CA
file, and an orchestrator restart that keeps a cordoned node's alert firing.

Each test starts its own Alertmanager on loopback (clustering off); the package is installed by
deploy/tools/debian-tool.sh when missing, as the report tests get chromium.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from guard.broker import free_port
from guard.config import OrchestratorSettings, Settings
from guard.schemas import NodeState
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.scheduler import DryRunScheduler
from guard.sweeps.service import KafkaOrchestrator
from guard.sweeps.webhook import WebhookNotifier, open_episodes
from tests.sweeps.helpers import NODES, Clock, flag, wait_until
from tests.sweeps.live import send
from tests.tools import debian_tool


class Collector:
    """A plain HTTP receiver: Alertmanager's webhook notifications, and Guard's requests'
    Authorization headers."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.authorization: list[str | None] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.bodies.append(json.loads(body))
                collector.authorization.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Alertmanager:
    """``prometheus-alertmanager`` on a free loopback port, with ``config`` (YAML text) and
    an optional web config (TLS, basic auth)."""

    def __init__(self, workdir: Path, config: str, web_config: str | None = None) -> None:
        binary = debian_tool("prometheus-alertmanager", "prometheus-alertmanager")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "am.yml").write_text(config)
        self.port = free_port()
        argv = [
            binary,
            f"--config.file={workdir / 'am.yml'}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",  # no gossip: each instance on its own
        ]
        scheme = "http"
        if web_config is not None:
            (workdir / "web.yml").write_text(web_config)
            argv.append(f"--web.config.file={workdir / 'web.yml'}")
            scheme = "https" if "tls_server_config" in web_config else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = open(workdir / "alertmanager.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, context: ssl.SSLContext | None = None, auth: str | None = None) -> Any:
        request = urllib.request.Request(self.url + path)
        if auth:
            request.add_header("Authorization", auth)
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:
            return json.loads(answer.read() or b"null")

    def ready(self, **kwargs: Any) -> bool:
        try:
            self.get("/api/v2/status", **kwargs)
        except OSError:
            return False
        return True

    def alerts(self, **kwargs: Any) -> list[dict[str, Any]]:
        """Active alerts (API v2 lists no resolved ones)."""
        return list(self.get("/api/v2/alerts", **kwargs))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def routing_config(pager: str, resolve_timeout: str = "5m") -> str:
    """Critical alerts go to the pager (a webhook receiver); the rest to nobody."""
    return f"""
global:
  resolve_timeout: {resolve_timeout}
route:
  receiver: nobody
  group_by: [alertname, node]
  group_wait: 1s
  group_interval: 1s
  routes:
    - matchers: ['severity="critical"']
      receiver: pager
receivers:
  - name: nobody
  - name: pager
    webhook_configs:
      - url: {pager}/pager
        send_resolved: true
"""


@pytest.fixture
def pager() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def by_node(alerts: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {a["labels"]["node"]: a["labels"] for a in alerts if "node" in a["labels"]}


def test_both_alertmanagers_get_the_alerts_and_route_them_by_the_severity_label(
    tmp_path: Path, pager: Collector
) -> None:
    pair = [Alertmanager(tmp_path / f"am{i}", routing_config(pager.url)) for i in (1, 2)]
    hook = None
    try:
        for am in pair:
            wait_until(am.ready, timeout_s=30)
        hook = WebhookNotifier(
            [am.url for am in pair], mode="alertmanager", resend_s=1.0, backoff_s=0.05
        ).start()
        now = time.time()
        orch = Orchestrator(
            OrchestratorSettings(nodes=NODES, persist_flags=5, persistence_s=3600),
            scheduler=DryRunScheduler(),
            executor=None,  # no sweep: the cordoned node stays out, its alert stays firing
            publish=lambda message: None,
            listeners=[hook],
            inline_sweeps=True,
        )
        orch.handle_flag(flag("node-004", "t1", now - 1, category="thermal"))  # critical: out
        orch.handle_flag(flag("node-009", "w1", now - 1, severity="warning", category="nic"))
        orch.tick()
        assert (orch.state_of("node-004"), orch.state_of("node-009")) == ("cordoned", "suspect")
        want = {
            "node-004": {"alertname": "GuardNodeHealth", "node": "node-004",
                         "category": "thermal", "severity": "critical"},
            "node-009": {"alertname": "GuardNodeHealth", "node": "node-009",
                         "category": "nic", "severity": "warning"},
        }  # fmt: skip
        for am in pair:  # each peer got everything; node-004's warning alert was resolved
            wait_until(lambda am=am: by_node(am.alerts()) == want, timeout_s=30)
        # Alertmanager routed by the label: only the critical alert reached the pager.
        wait_until(lambda: pager.bodies, timeout_s=30)
        time.sleep(2.5)  # more group intervals: nothing else may come
        paged = {a["labels"]["node"] for body in pager.bodies for a in body["alerts"]}
        assert paged == {"node-004"}
        assert {a["labels"]["severity"] for b in pager.bodies for a in b["alerts"]} == {"critical"}

        # Too many failed sweeps: the fleet alert fires, pages, and resolves when sweeping goes on.
        why = "4 of the last 4 sweeps within 3600 s failed (over 50 %)"
        hook.sweeps_stopped(True, why)  # as the orchestrator's stop listener calls it
        for am in pair:
            wait_until(lambda am=am: any(a["labels"] == {"alertname": "GuardSweepsStopped",
                       "severity": "critical"} and why in a["annotations"]["description"]
                       for a in am.alerts()), timeout_s=30)  # fmt: skip

        def paged_stop(status: str) -> bool:
            return any(a["labels"]["alertname"] == "GuardSweepsStopped" and a["status"] == status
                       for body in pager.bodies for a in body["alerts"])  # fmt: skip

        wait_until(lambda: paged_stop("firing"), timeout_s=30)
        hook.sweeps_stopped(False, why)
        for am in pair:
            wait_until(lambda am=am: set(by_node(am.alerts())) == {"node-004", "node-009"}
                       and len(am.alerts()) == 2, timeout_s=30)  # fmt: skip
        wait_until(lambda: paged_stop("resolved"), timeout_s=30)
    finally:
        if hook is not None:
            hook.stop()
        for am in pair:
            am.close()


def _self_signed(workdir: Path) -> tuple[Path, Path]:
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def _bcrypt(password: str) -> str:
    with warnings.catch_warnings():  # crypt: deprecated, but libxcrypt's bcrypt is what we need
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))


def test_basic_auth_over_https_with_a_ca_file_and_a_bearer_token(
    tmp_path: Path, pager: Collector
) -> None:
    tmp_path.mkdir(exist_ok=True)
    cert, key = _self_signed(tmp_path)
    web = (
        f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
        f"basic_auth_users:\n  guard: '{_bcrypt('s3cret')}'\n"
    )
    am = Alertmanager(tmp_path / "am", routing_config(pager.url), web)
    trusted = ssl.create_default_context(cafile=str(cert))
    auth = "Basic " + base64.b64encode(b"guard:s3cret").decode()
    hooks: list[WebhookNotifier] = []
    try:
        wait_until(lambda: am.ready(context=trusted, auth=auth), timeout_s=30)
        state = NodeState(ts=time.time(), node="node-011", state="cordoned", prev="suspect",
                          reason="cordoned for sweep: critical gpu_error flag gpu1 from xid",
                          actor="orchestrator")  # fmt: skip
        good = WebhookNotifier(am.url, mode="alertmanager", basic_auth=("guard", "s3cret"),
                               ca_file=str(cert), retries=0)  # fmt: skip
        wrong = WebhookNotifier(am.url, mode="alertmanager", basic_auth=("guard", "nope"),
                                ca_file=str(cert), retries=3, backoff_s=0.05)  # fmt: skip
        untrusted = WebhookNotifier(am.url, mode="alertmanager", retries=0,
                                    basic_auth=("guard", "s3cret"))  # fmt: skip
        hooks = [h.start() for h in (good, wrong, untrusted)]
        for h in hooks:
            h.notify(state)
        wait_until(lambda: good.delivered == 1 and wrong.failed == 1 and untrusted.failed == 1)
        [got] = am.alerts(context=trusted, auth=auth)
        assert got["labels"] == {"alertname": "GuardNodeHealth", "node": "node-011",
                                 "category": "gpu_error", "severity": "critical"}  # fmt: skip
        with pytest.raises(urllib.error.HTTPError, match="401"):  # no credentials, no alerts
            am.alerts(context=trusted)

        # A bearer token (for a proxy in front of Alertmanager: it has no tokens itself).
        bearer = WebhookNotifier(pager.url + "/hook", bearer_token="t0ken").start()
        hooks.append(bearer)
        bearer.notify(state)
        wait_until(lambda: bearer.delivered == 1)
        assert pager.authorization == ["Bearer t0ken"]
    finally:
        for h in hooks:
            h.stop()
        am.close()


@pytest.mark.kafka
def test_a_restarted_orchestrator_keeps_a_cordoned_nodes_alert_firing(
    kafka_settings: Settings, tmp_path: Path, pager: Collector
) -> None:
    # Alertmanager resolves an alert nobody re-sends within 4 s; Guard re-sends every second,
    # to both peers of an HA pair (webhook_url and webhook_urls).
    config = routing_config(pager.url, resolve_timeout="4s")
    am, peer = (Alertmanager(tmp_path / name, config) for name in ("am", "peer"))
    s = kafka_settings
    s.orchestrator.webhook_url = am.url
    s.orchestrator.webhook_urls = [peer.url]
    s.orchestrator.webhook_mode = "alertmanager"
    s.orchestrator.webhook_resend_s = 1.0
    s.orchestrator.nodes = NODES

    def start() -> KafkaOrchestrator:
        orch = KafkaOrchestrator(s, scheduler=DryRunScheduler(), poll_s=0.05).start()
        assert orch.ready.wait(60) and orch.error is None
        return orch

    try:
        wait_until(lambda: am.ready() and peer.ready(), timeout_s=30)
        first = start()  # executor none: the flagged node is cordoned and stays cordoned
        try:
            send(s, flag("node-006", "t6", time.time() - 1, category="thermal"))
            wait_until(lambda: by_node(am.alerts()).get("node-006", {}).get("severity")
                       == "critical", timeout_s=60)  # fmt: skip
            [before] = am.alerts()
        finally:
            first.stop()
        second = start()
        try:
            assert second.webhook is not None
            wait_until(lambda: "node-006" in second.webhook.episodes)  # type: ignore[union-attr]
            time.sleep(9)  # twice the resolve timeout: only re-sending keeps it firing
            [after] = am.alerts()
            [on_peer] = peer.alerts()
        finally:
            second.stop()
    finally:
        am.close()
        peer.close()
    assert on_peer["labels"] == after["labels"] and on_peer["startsAt"] == after["startsAt"]
    assert after["labels"] == before["labels"]
    assert after["labels"]["category"] == "thermal"  # rebuilt, not "unknown"
    assert after["startsAt"] == before["startsAt"]  # the same episode
    assert after["status"]["state"] == "active"
    # the pager heard of it once, firing, and never of a resolution
    statuses = [a["status"] for body in pager.bodies for a in body["alerts"]]
    assert statuses and set(statuses) == {"firing"}


def test_after_compaction_alertmanager_keeps_the_episodes_real_start(tmp_path: Path) -> None:
    # A node-state record carries no episode start: rebuilt from a compacted topic (the node's
    # latest state only), Guard's alert starts at that state. Alertmanager merges an alert it
    # still holds and keeps the earliest startsAt, so the real start survives a restart that
    # re-sends within resolve_timeout.
    am = Alertmanager(tmp_path / "am", routing_config("http://127.0.0.1:9/none"))
    hooks: list[WebhookNotifier] = []
    try:
        wait_until(am.ready, timeout_s=30)
        start = time.time() - 600
        clock = Clock(start)
        states: list[NodeState] = []
        orch = Orchestrator(
            OrchestratorSettings(nodes=NODES),
            scheduler=DryRunScheduler(),
            executor=None,  # the node stays cordoned: the episode stays open
            publish=lambda message: None,
            listeners=[lambda m: states.append(m) if isinstance(m, NodeState) else None],
            clock=clock,
            inline_sweeps=True,
        )
        orch.handle_flag(flag("node-012", "c12", start - 1, category="thermal"))  # suspect
        clock.now = start + 300
        orch.tick()  # cordoned, five minutes into the episode
        assert [(s.state, s.ts) for s in states] == [
            ("suspect", start),
            ("cordoned", start + 300),
        ]
        first = WebhookNotifier(am.url, mode="alertmanager", retries=0).start()
        hooks.append(first)
        for state in states:
            first.notify(state)
        wait_until(lambda: first.delivered == 2)
        [before] = am.alerts()
        assert before["labels"]["severity"] == "critical"
        first.stop()

        compacted = open_episodes(states[-1:])  # what a restart reads after compaction
        [episode] = compacted
        assert episode.starts_at == start + 300  # not the episode's start: no record says it
        second = WebhookNotifier(am.url, mode="alertmanager", retries=0).start()
        hooks.append(second)
        second.restore(compacted)
        wait_until(lambda: am.alerts()[0]["updatedAt"] != before["updatedAt"], timeout_s=30)
        [after] = am.alerts()
    finally:
        for h in hooks:
            h.stop()
        am.close()
    assert after["labels"] == before["labels"]
    assert after["startsAt"] == before["startsAt"]  # Alertmanager kept the earlier start
    assert after["startsAt"].startswith(time.strftime("%Y-%m-%dT%H:%M", time.gmtime(start)))

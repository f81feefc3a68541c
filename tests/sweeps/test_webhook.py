"""Node-health notifications against a real local HTTP receiver that checks signatures."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from guard.config import OrchestratorSettings
from guard.schemas import NodeState
from guard.sweeps.executors import SimulatedSweepExecutor
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.scheduler import DryRunScheduler
from guard.sweeps.webhook import WebhookNotifier, open_episodes, sign, verify_signature
from tests.sweeps.helpers import NODES, SECRET, Clock, Receiver, flag, wait_until

T0 = 1_767_226_000.0
GRAFANA = "https://grafana.example/d/guard-node?var-node={node}"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail_first=1)
    yield r
    r.close()


def state(node: str, new: str, prev: str, ts: float = T0, reason: str = "") -> NodeState:
    return NodeState(ts=ts, node=node, state=new, prev=prev, reason=reason, actor="orchestrator")  # type: ignore[arg-type]


def run_orchestrator(hook: WebhookNotifier, node: str = "node-004") -> None:
    """A real orchestrator flags ``node`` thermal; its sweep passes and it goes back."""
    orch = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=SimulatedSweepExecutor([], seed=1),
        publish=lambda message: None,
        clock=Clock(T0),
        listeners=[hook],
        inline_sweeps=True,
    )
    assert orch.handle_flag(flag(node, "f1", T0 - 1, category="thermal")) == "qualified"
    orch.tick()


def test_one_episode_is_an_alert_per_severity_with_fixed_labels_start_and_an_end(
    receiver: Receiver,
) -> None:
    hook = WebhookNotifier(
        receiver.url, SECRET.decode(), retries=3, backoff_s=0.05, generator_url=GRAFANA
    ).start()
    try:
        run_orchestrator(hook)
        wait_until(lambda: hook.pending() == 0 and len(receiver.accepted) >= 4)
    finally:
        hook.stop()
    assert receiver.bad_signatures == 0 and hook.failed == 0
    assert len(receiver.attempts) == len(receiver.accepted) + 1  # the first got a 503
    alerts = [a for m in receiver.accepted for a in m["alerts"]]
    # The severity is a label: going out of the pool resolves the warning alert and fires a
    # critical one (labels are an alert's identity in Alertmanager).
    assert [(a["annotations"]["state"], a["labels"]["severity"], a["status"]) for a in alerts] == [
        ("suspect", "warning", "firing"),
        ("suspect", "warning", "resolved"),
        ("cordoned", "critical", "firing"),
        ("sweeping", "critical", "firing"),
        ("healthy", "critical", "resolved"),
    ]
    assert [len(m["alerts"]) for m in receiver.accepted] == [1, 2, 1, 1]
    labels = {"alertname": "GuardNodeHealth", "node": "node-004", "category": "thermal"}
    assert all({k: a["labels"][k] for k in labels} == labels for a in alerts)
    assert len({a["fingerprint"] for a in alerts}) == 2  # one per severity
    assert {a["startsAt"] for a in alerts} == {"2026-01-01T00:06:40Z"}
    firing = [a for a in alerts if a["status"] == "firing"]
    assert all(a["endsAt"] == "0001-01-01T00:00:00Z" for a in firing)
    assert alerts[1]["endsAt"] == alerts[-1]["endsAt"] != "0001-01-01T00:00:00Z"
    assert {a["generatorURL"] for a in alerts} == {
        "https://grafana.example/d/guard-node?var-node=node-004"
    }
    assert "thermal flag" in alerts[0]["annotations"]["description"]
    first = receiver.accepted[0]
    for key in ("version", "groupKey", "receiver", "groupLabels", "commonLabels"):
        assert key in first


def test_a_captured_request_cannot_be_replayed_or_altered(receiver: Receiver) -> None:
    receiver.fail_first = 0
    hook = WebhookNotifier(receiver.url, SECRET).start()
    try:
        hook.notify(state("node-1", "cordoned", "suspect"))
        wait_until(lambda: receiver.accepted)
    finally:
        hook.stop()
    body, header = receiver.raw[0]
    assert header.startswith("t=") and ",v1=" in header
    assert verify_signature(SECRET, body, header)
    assert not verify_signature(SECRET, body, header, now=time.time() + 3600)  # replayed later
    assert not verify_signature(SECRET, body.replace(b"cordoned", b"healthy"), header)
    assert not verify_signature(SECRET, body, sign(SECRET, body, now=time.time() - 600))
    assert not verify_signature(SECRET, body, "sha256=" + header.split("v1=")[1])  # old format


def test_only_5xx_429_and_network_errors_are_retried(receiver: Receiver) -> None:
    receiver.fail_first = 0
    receiver.script = [(429, {"Retry-After": "1"}), (500, {}), (400, {})]
    hook = WebhookNotifier(receiver.url, SECRET, retries=5, backoff_s=0.01).start()
    try:
        hook.notify(state("node-1", "suspect", "healthy"))  # 429, 500, then 400: given up
        wait_until(lambda: hook.failed == 1)
        hook.notify(state("node-2", "suspect", "healthy"))  # delivered at once
        wait_until(lambda: hook.delivered == 1)
    finally:
        hook.stop()
    assert len(receiver.attempts) == 4
    assert receiver.attempts[1] - receiver.attempts[0] >= 0.95  # Retry-After: 1 honoured
    assert [m["alerts"][0]["labels"]["node"] for m in receiver.accepted] == ["node-2"]


def test_a_wrong_secret_is_refused_and_not_retried(receiver: Receiver) -> None:
    receiver.fail_first = 0
    hook = WebhookNotifier(receiver.url, "not-the-secret", retries=3, backoff_s=0.01).start()
    try:
        hook.notify(state("node-2", "repair", "failed"))
        wait_until(lambda: hook.failed == 1)
    finally:
        hook.stop()
    assert receiver.bad_signatures == 1 and receiver.accepted == []


def test_alertmanager_mode_posts_alerts_and_resends_the_active_ones(receiver: Receiver) -> None:
    receiver.fail_first = 0
    base = receiver.url.removesuffix("/hook")
    hook = WebhookNotifier(
        base, SECRET, mode="alertmanager", generator_url=GRAFANA, resend_s=0.3
    ).start()
    try:
        hook.notify(state("node-7", "suspect", "healthy", reason="warning nic flag mlx5_0"))
        hook.notify(state("node-7", "cordoned", "suspect", ts=T0 + 5))
        wait_until(lambda: hook.resent >= 2)
        hook.notify(state("node-7", "healthy", "sweeping", ts=T0 + 60))
        wait_until(lambda: hook.pending() == 0 and hook.delivered == 3)
        resent = hook.resent
        time.sleep(0.7)  # resolved: nothing active is sent again
    finally:
        hook.stop()
    assert hook.resent == resent
    assert set(receiver.paths) == {"/api/v2/alerts"}
    posted = [a for body in receiver.accepted for a in body]
    assert all(isinstance(body, list) for body in receiver.accepted)
    labels = {"alertname": "GuardNodeHealth", "node": "node-7", "category": "nic"}
    assert all(a["labels"] == {**labels, "severity": a["labels"]["severity"]} for a in posted)
    assert {a["startsAt"] for a in posted} == {"2026-01-01T00:06:40Z"}
    assert (posted[1]["labels"]["severity"], posted[1]["endsAt"]) == (
        "warning",
        "2026-01-01T00:06:45Z",  # the warning alert ends when the node goes out
    )
    assert posted[-1]["endsAt"] == "2026-01-01T00:07:40Z"
    assert {a["labels"]["severity"] for a in posted[2:]} == {"critical"}  # only it is resent
    assert all(a["endsAt"] == "0001-01-01T00:00:00Z" for a in posted[2:-1])
    assert posted[-1]["generatorURL"].endswith("var-node=node-7")
    assert [a["annotations"]["state"] for a in posted][-1] == "healthy"


def test_notify_never_blocks_on_a_dead_receiver() -> None:
    # A port nobody listens on, a long backoff and a tiny queue: notify still returns at once.
    hook = WebhookNotifier("http://127.0.0.1:9/hook", "s", retries=5, backoff_s=30, max_queue=2)
    hook.start()
    try:
        for i in range(10):
            hook.notify(state(f"node-{i}", "suspect", "healthy"))
        assert hook.pending() <= 2
        assert hook.dropped >= 7
    finally:
        hook.stop(timeout_s=2)


def test_the_verification_snippet_in_the_docs_accepts_and_refuses_like_guard() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "orchestrator.md").read_text()
    section = doc.split("## Webhook", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(snippet, scope)
    verify = scope["verify"]
    body = b'{"version":"4"}'
    assert verify(SECRET, body, sign(SECRET, body))  # type: ignore[operator]
    assert not verify(SECRET, body + b" ", sign(SECRET, body))  # type: ignore[operator]
    assert not verify(SECRET, body, sign(SECRET, body, now=time.time() - 3600))  # type: ignore[operator]
    assert not verify(b"other", body, sign(SECRET, body))  # type: ignore[operator]


def test_an_episode_rebuilt_from_a_compacted_topic_keeps_its_category() -> None:
    # Compaction leaves each node's last state only; that state must still name the flag.
    out: list = []
    orch = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=None,  # cordoned, and it stays so: the episode is open
        publish=out.append,
        clock=Clock(1_767_226_000.0),
        inline_sweeps=True,
    )
    orch.handle_flag(flag("node-004", "l4", 1_767_226_000.0 - 1, category="link"))
    orch.tick()
    orch.handle_operator(NodeState(ts=1.0, node="node-004", state="repair", actor="operator:ann"))
    orch.handle_operator(NodeState(ts=1.0, node="node-009", state="repair", actor="operator"))
    orch.handle_flag(flag("node-007", "t7", 1_767_226_000.0 - 1, category="thermal"))
    # node-007 waits under the cap of 1; node-004 is in repair by an operator
    last = {m.node: m for m in out if isinstance(m, NodeState)}
    assert {n: m.state for n, m in last.items()} == {
        "node-004": "repair",
        "node-009": "repair",
        "node-007": "suspect",
    }
    episodes = {e.node: e.category for e in open_episodes(last.values())}
    assert episodes == {"node-004": "link", "node-009": "operator", "node-007": "thermal"}

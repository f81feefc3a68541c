"""The state-change webhook against a real local HTTP receiver that checks signatures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from guard.schemas import NodeState
from guard.sweeps.webhook import WebhookNotifier, alertmanager_payload
from tests.sweeps.helpers import SECRET, Receiver, wait_until


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail_first=1)
    yield r
    r.close()


def state(node: str, new: str, prev: str, ts: float = 1_767_226_000.0) -> NodeState:
    return NodeState(ts=ts, node=node, state=new, prev=prev, reason="because", actor="orchestrator")  # type: ignore[arg-type]


def test_delivers_signed_alertmanager_messages_and_retries_a_failed_attempt(
    receiver: Receiver,
) -> None:
    hook = WebhookNotifier(receiver.url, SECRET.decode(), retries=3, backoff_s=0.05).start()
    try:
        hook.notify(state("node-1", "cordoned", "suspect"))
        hook.notify(state("node-1", "healthy", "sweeping"))
        wait_until(lambda: len(receiver.accepted) == 2)
    finally:
        hook.stop()
    assert len(receiver.attempts) == 3 and receiver.bad_signatures == 0
    assert hook.delivered == 2 and hook.failed == 0
    firing, resolved = receiver.accepted
    assert firing["version"] == "4" and firing["status"] == "firing"
    assert firing["alerts"][0]["labels"] == {
        "alertname": "GuardNodeHealth",
        "node": "node-1",
        "state": "cordoned",
        "severity": "critical",
    }
    assert firing["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z"
    assert firing["alerts"][0]["startsAt"] == "2026-01-01T00:06:40Z"
    assert resolved["status"] == "resolved" and resolved["alerts"][0]["status"] == "resolved"
    assert firing["alerts"][0]["fingerprint"] == resolved["alerts"][0]["fingerprint"]
    for key in ("groupKey", "receiver", "groupLabels", "commonLabels", "externalURL"):
        assert key in firing


def test_a_wrong_secret_is_refused_and_given_up_after_the_retries(receiver: Receiver) -> None:
    receiver.fail_first = 0
    hook = WebhookNotifier(receiver.url, "not-the-secret", retries=2, backoff_s=0.01).start()
    try:
        hook.notify(state("node-2", "repair", "failed"))
        wait_until(lambda: hook.failed == 1)
    finally:
        hook.stop()
    assert receiver.bad_signatures == 3 and receiver.accepted == []


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


def test_payload_shape_for_every_state() -> None:
    for new in ("suspect", "cordoned", "sweeping", "failed", "repair", "healthy"):
        payload = alertmanager_payload(state("n", new, "suspect"))
        assert payload["alerts"][0]["labels"]["state"] == new
        assert payload["status"] == ("resolved" if new == "healthy" else "firing")

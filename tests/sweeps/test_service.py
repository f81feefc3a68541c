"""The orchestrator on a real broker: flags in, states and sweeps out, restarts, operators."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from guard.cli import main
from guard.config import Settings
from guard.kafka import DLQ_ERROR_HEADER, make_consumer
from guard.schemas import GuardMessage, NodeState, SweepResult
from guard.sweeps.executors import SimulatedFault, SimulatedSweepExecutor
from guard.sweeps.scheduler import DryRunScheduler
from guard.sweeps.service import (
    KafkaOrchestrator,
    _read_to_end,
    read_sweeps,
)
from tests.sweeps.helpers import NODES, SECRET, GatedExecutor, Receiver, flag, wait_until
from tests.sweeps.live import kill_mid_sweep, send, states_on_topic

pytestmark = pytest.mark.kafka


def slow_gpu(node: str) -> SimulatedFault:
    return SimulatedFault(node, "slow_gpu", onset=time.time() - 3600, gpu=3, slowdown=0.2)


def start(settings: Settings, executor: object, events: list[GuardMessage]) -> KafkaOrchestrator:
    orch = KafkaOrchestrator(
        settings,
        scheduler=DryRunScheduler(),
        executor=executor,  # type: ignore[arg-type]
        nodes=NODES,
        listeners=[events.append],
        poll_s=0.05,
    ).start()
    assert orch.ready.wait(60) and orch.error is None
    return orch


def test_flags_become_states_and_sweeps_on_kafka_and_operators_are_heard(
    kafka_settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    s = kafka_settings
    # Two of the 32 nodes may be out at once: node-005, in repair, keeps its place under the
    # cap, and node-010 gets the other.
    s.orchestrator.max_cordoned_fraction = 2 / 32
    now = time.time()
    faulty = flag("node-005", "f-5", now - 2)
    send(
        s,
        faulty,
        flag("node-010", "f-10", now - 1),  # a false flag: passes both sweeps
        flag("node-011", "i-11", now - 1, severity="info"),
        flag(None, "job", now - 1, category="imbalance", gpu=None),
        faulty,  # delivered twice
        raw=b"\xff not a flag",
    )
    events: list[GuardMessage] = []
    orch = start(s, SimulatedSweepExecutor([slow_gpu("node-005")], seed=3), events)
    try:
        wait_until(lambda: states_on_topic(s) == {"node-005": "repair", "node-010": "healthy"})
        assert orch.core.stats["flags_duplicate"] == 1
        assert orch.core.stats["flags_observation"] == 2

        sweeps = read_sweeps(s)
        assert [(x.node, x.sweep, x.passed) for x in sweeps] == [
            ("node-005", "single", False),
            ("node-010", "single", True),
            ("node-010", "multi", True),
        ]
        assert [m for m in events if isinstance(m, SweepResult)] == sweeps

        [dead] = list(_read_to_end(s, s.topic("dlq"), 30))
        assert dead.value() == b"\xff not a flag"
        assert b"flag message" in dict(dead.headers())[DLQ_ERROR_HEADER]

        # The operator's CLI, in this process, through the topic.
        monkeypatch.setenv("GUARD_KAFKA_BOOTSTRAP", s.kafka.bootstrap)
        monkeypatch.setenv("GUARD_KAFKA_TOPIC_PREFIX", s.kafka.topic_prefix)
        capsys.readouterr()
        code = main(
            [
                "node",
                "release",
                "node-005",
                "--reason",
                "GPU reseated",
                "--user",
                "ann",
                "--wait",
                "30",
            ]
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert "node-005: repair -> healthy (released by operator:ann: GPU reseated)" in out
        assert main(["node", "repair", "node-012", "--user", "bo", "--wait", "30"]) == 0
        capsys.readouterr()

        assert main(["node", "list", "--json"]) == 0
        listed = {row["node"]: row for row in json.loads(capsys.readouterr().out)}
        assert {n: r["state"] for n, r in listed.items()} == {
            "node-005": "healthy",
            "node-010": "healthy",
            "node-012": "repair",
        }
        assert all(r["pending"] is None for r in listed.values())
        assert main(["node", "show", "node-005"]) == 0
        shown = capsys.readouterr().out
        assert "FAIL gemm_tflops_gpu3" in shown and "released by operator:ann" in shown
        assert main(["node", "show", "node-005", "--json"]) == 0
        detail = json.loads(capsys.readouterr().out)
        assert [h["state"] for h in detail["history"] if h["actor"] == "orchestrator"] == [
            "suspect",
            "cordoned",
            "sweeping",
            "failed",
            "repair",
            "healthy",
        ]
        assert [h["actor"] for h in detail["history"]].count("operator:ann") == 1
        assert [x["passed"] for x in detail["sweeps"]] == [False]
    finally:
        orch.stop()
    assert orch.error is None
    # Every flag's offset was committed: a restart does not see them again.
    consumer = make_consumer(s, s.orchestrator.group_id)
    try:
        topic = s.topic("remediation")
        committed = consumer.committed(
            [TopicPartition(topic, p) for p in range(s.kafka.control_partitions)], timeout=30
        )
        assert sum(max(tp.offset, 0) for tp in committed) == 6
    finally:
        consumer.close()


def test_a_restarted_orchestrator_resumes_an_interrupted_sweep(kafka_settings: Settings) -> None:
    s = kafka_settings
    receiver = Receiver(fail_first=1)  # every state change also goes to a signed webhook
    s.orchestrator.webhook_url = receiver.url
    s.orchestrator.webhook_secret = SECRET.decode()  # type: ignore[assignment]
    s.orchestrator.webhook_backoff_s = 0.05
    now = time.time()
    faults = [slow_gpu("node-005")]
    gated = GatedExecutor(SimulatedSweepExecutor(faults))
    first_events: list[GuardMessage] = []
    first = start(s, gated, first_events)
    try:
        send(s, flag("node-005", "f-5", now - 2), flag("node-010", "f-10", now - 1))
        wait_until(lambda: gated.started == [("node-005", "single")])
        wait_until(lambda: states_on_topic(s) == {"node-005": "sweeping", "node-010": "suspect"})
    finally:
        first.stop()  # the sweep never returns: as good as killed mid-sweep
        gated.gate.set()

    events: list[GuardMessage] = []
    # Restarted with a cap of two: node-005, in repair, keeps one place (one of 32 would hold
    # node-010 back until someone releases node-005) and node-010 gets the other.
    s.orchestrator.max_cordoned_fraction = 2 / 32
    second = start(s, SimulatedSweepExecutor(faults), events)
    try:
        wait_until(lambda: states_on_topic(s) == {"node-005": "repair", "node-010": "healthy"})
        resumed = [m for m in events if isinstance(m, NodeState) and m.node == "node-005"]
        assert [m.state for m in resumed] == ["sweeping", "failed", "repair"]
        assert "restarted" in resumed[0].reason
        # The same flag again (a producer retry, a replay): nothing happens to node-010.
        before = len(events)
        send(s, flag("node-010", "f-10", now - 1))
        wait_until(lambda: second.core.stats["flags_duplicate"] + second.core.stats["flags_stale"])
        assert len(events) == before
    finally:
        second.stop()
        receiver.close()
    assert second.core.stats["recovered_nodes"] == 2
    published = [m for m in first_events + events if isinstance(m, NodeState)]
    hooked = [
        (a["alerts"][-1]["labels"]["node"], a["alerts"][-1]["annotations"]["state"])
        for a in receiver.accepted
    ]
    assert hooked == [(m.node, m.state) for m in published]
    assert receiver.bad_signatures == 0 and len(receiver.attempts) == len(hooked) + 1


def test_guard_orchestrator_killed_mid_sweep_resumes_from_the_topic(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    killed = kill_mid_sweep(kafka_settings, tmp_path)  # also a chaos scenario (benchmarks/)
    assert killed.returncode == 0, killed.output
    history = killed.history
    assert [h.state for h in history] == [
        "suspect",
        "cordoned",
        "sweeping",  # first life, killed
        "sweeping",
        "failed",
        "repair",  # second life
    ]
    assert "restarted after an orchestrator restart" in history[3].reason
    assert "nic_symbol_errors" in history[4].reason
    assert "node-020 sweeping -> failed" in killed.output

"""The agent daemon end to end: collectors + training client → a real broker."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from guard.agents.client import GuardClient
from guard.agents.daemon import AgentDaemon, ClientListener, JobTracker
from guard.agents.nic import NicCollector
from guard.agents.nvml import NvmlCollector
from guard.agents.publisher import Publisher
from guard.cli import main
from guard.config import Settings
from guard.schemas import expand, parse_message

from .fake_sysfs import make_fake_sysfs
from .nvml_standin import NvmlStandIn
from .test_publisher import consume_topics


def test_job_discovery_prefers_explicit_then_slurm_then_clients() -> None:
    assert JobTracker("explicit", {"SLURM_JOB_ID": "42"}).current() == "explicit"
    assert JobTracker(None, {"SLURM_JOB_ID": "42"}).current() == "42"
    tracker = JobTracker(None, {})
    assert tracker.current() is None
    tracker.report("from-client", now=100.0)
    assert tracker.current(now=150.0) == "from-client"
    assert tracker.current(now=100.0 + 301) is None  # the job ended: stop labelling


@pytest.mark.kafka
def test_agent_publishes_gpus_nics_and_client_timings(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    nvml = NvmlStandIn()
    gpus = NvmlCollector("node-7", nvml=nvml)
    nics = NicCollector("node-7", make_fake_sysfs(tmp_path / "sys"))
    listener = ClientListener(tmp_path / "agent.sock", "node-7").start()
    publisher = Publisher(kafka_settings)
    daemon = AgentDaemon(
        "node-7", publisher, [gpus.sample, nics.sample], JobTracker(None, {}), listener
    )
    client = GuardClient(job="llm-9", rank=3, gpu=3, socket_path=str(tmp_path / "agent.sock"))
    try:
        daemon.cycle(ts=1767225600.0)  # no job known yet
        for step in range(5):
            assert client.step(step=step, step_s=2.0, compute_s=1.4, dp_rank=3)
        deadline = time.monotonic() + 10
        while listener.messages.qsize() < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        daemon.forward_clients()  # the client told us the job
        nvml.advance()
        daemon.cycle(ts=1767225601.0)
        publisher.flush(30)
    finally:
        listener.stop()
        gpus.close()
        nics.close()
        publisher.close()
    gpu = consume_topics(kafka_settings, ["gpu"], 16)
    nic = consume_topics(kafka_settings, ["nic"], 18)
    steps = consume_topics(kafka_settings, ["steps"], 5)
    assert len(gpu) == 16 and len(nic) == 18 and len(steps) == 5
    assert Counter(m.job for m in gpu) == {None: 8, "llm-9": 8}
    assert {(m.node, m.job, m.rank) for m in steps} == {("node-7", "llm-9", 3)}
    assert daemon.status()["client_received"] == 5


@pytest.mark.kafka
def test_guard_agent_simulate_publishes_to_the_broker(
    kafka_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("GUARD_KAFKA_BOOTSTRAP", kafka_settings.kafka.bootstrap)
    monkeypatch.setenv("GUARD_KAFKA_TOPIC_PREFIX", kafka_settings.kafka.topic_prefix)
    monkeypatch.setenv("GUARD_HOME", str(tmp_path / "home"))
    truth = tmp_path / "truth.json"
    code = main(
        [
            "agent",
            "--simulate",
            "--speed",
            "0",
            "--nodes",
            "3",
            "--duration",
            "20",
            "--seed",
            "4",
            "--truth",
            str(truth),
        ]
    )
    assert code == 0
    summary = capsys.readouterr().err
    published = int(summary.split("guard agent --simulate: ", 1)[1].split(" messages")[0])
    sent = int(summary.split(" messages in ", 1)[1].split(" records")[0])
    records = consume_topics(kafka_settings, ["gpu", "nic", "steps", "collectives"], sent)
    assert len(records) == sent
    samples = [s for m in records for s in expand(m)]
    # batch records by default (agent.batch_records): one a node and kind per cycle
    assert {"gpu_batch", "nic_batch"} <= {m.kind for m in records}
    assert len(samples) == published > 3 * 8 * 2 * 10
    assert {m.node for m in samples if m.kind == "gpu"} == {"node-000", "node-001", "node-002"}
    assert Counter(m.kind for m in samples).keys() == {"gpu", "nic", "step", "collective"}
    assert json.loads(truth.read_text())["nodes"] == ["node-000", "node-001", "node-002"]


def test_guard_agent_once_dry_run_samples_dcgm_and_sysfs(
    settings: Settings, tmp_path: Path, exporter: str, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    sysfs = make_fake_sysfs(tmp_path / "sys")
    code = main(
        [
            "agent",
            "--once",
            "--dry-run",
            "--node",
            "h100-07",
            "--job",
            "llm-2",
            "--gpu-source",
            "dcgm",
            "--dcgm-url",
            exporter,
            "--sysfs",
            str(sysfs),
            "--socket",
            str(tmp_path / "agent.sock"),
        ]
    )
    assert code == 0
    lines = [line for line in capfdbinary.readouterr().out.splitlines() if line.startswith(b"{")]
    records = [parse_message(line) for line in lines]
    messages = [s for m in records for s in expand(m)]
    kinds = Counter(m.kind for m in messages)
    assert Counter(m.kind for m in records) == {"gpu_batch": 1, "nic_batch": 1}  # the default
    assert kinds == {"gpu": 2, "nic": 9}
    assert {m.job for m in messages} == {"llm-2"} and {m.node for m in messages} == {"h100-07"}


def test_an_exporter_pod_does_not_rename_the_nodes_gpus(
    settings: Settings,
    tmp_path: Path,
    pod_exporter: str,
    capfdbinary: pytest.CaptureFixture[bytes],
) -> None:
    """dcgm-exporter as a DaemonSet labels its host with its pod's name: the agent's GPU
    records carry the node it was given, as its NIC records do."""
    code = main(
        [
            "agent",
            "--once",
            "--dry-run",
            "--node",
            "h100-11",
            "--gpu-source",
            "dcgm",
            "--dcgm-url",
            pod_exporter,
            "--sysfs",
            str(make_fake_sysfs(tmp_path / "sys")),
            "--socket",
            str(tmp_path / "agent.sock"),
        ]
    )
    assert code == 0
    lines = [line for line in capfdbinary.readouterr().out.splitlines() if line.startswith(b"{")]
    messages = [s for line in lines for s in expand(parse_message(line))]
    assert sorted(m.gpu for m in messages if m.kind == "gpu") == [0, 1, 2, 3]
    assert {m.kind for m in messages} == {"gpu", "nic"}
    assert {m.node for m in messages} == {"h100-11"}

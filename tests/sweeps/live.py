"""A live ``guard orchestrator`` process on a real broker, shared by the orchestrator tests
and the chaos suite (``benchmarks/chaos.py``): its truth file, start, the flags it is sent,
the node states it publishes, and the SIGKILL-mid-sweep run itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.kafka import make_producer, produce
from guard.schemas import GuardMessage, NodeState
from guard.sweeps.service import read_node_states

from .helpers import flag, wait_until


def send(settings: Settings, *messages: GuardMessage, raw: bytes | None = None) -> None:
    producer = make_producer(settings)
    for message in messages:
        produce(producer, settings, message)
    if raw is not None:
        producer.produce(settings.topic("remediation"), raw, b"node-x")
    assert producer.flush(30) == 0


def states_on_topic(settings: Settings) -> dict[str, str]:
    return {
        node: view.state.state
        for node, view in read_node_states(settings).items()
        if view.state is not None
    }


def write_truth(path: Path, nodes: list[str], faults: list[dict[str, Any]], now: float) -> Path:
    """A simulator TRUTH.json for ``nodes`` with ``faults`` (the simulated executor's world)."""
    truth = {
        "version": 1,
        "seed": 5,
        "start_ts": now - 3600,
        "end_ts": now + 3600,
        "nodes": nodes,
        "gpus_per_node": 8,
        "jobs": [],
        "confounders": [],
        "faults": faults,
    }
    path.write_text(json.dumps(truth))
    return path


def nic_fault(node: str, now: float) -> dict[str, Any]:
    return {
        "id": f"f-{node}",
        "node": node,
        "gpu": None,
        "device": "mlx5_3",
        "kind": "degraded_nic",
        "category": "nic",
        "onset": now - 600,
        "end": None,
        "slowdown": 0.4,
        "pattern": "steady",
        "detail": {},
    }


def start_orchestrator(
    settings: Settings,
    truth: Path,
    delay: float,
    workdir: Path,
    stdout: Any = subprocess.PIPE,
    **env_overrides: str,
) -> subprocess.Popen[bytes]:
    """``guard orchestrator --truth`` (simulated executor, sweeps taking ``delay`` s); its
    output to ``stdout`` (a pipe: read it, or the orchestrator stalls once it is full)."""
    s = settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    env.update(
        GUARD_KAFKA_BOOTSTRAP=s.kafka.bootstrap,
        GUARD_KAFKA_TOPIC_PREFIX=s.kafka.topic_prefix,
        GUARD_HOME=str(workdir / "home"),
        GUARD_METRICS_ORCHESTRATOR_PORT="0",
    )
    env.update(env_overrides)
    command = [sys.executable, "-m", "guard.cli", "orchestrator", "--truth", str(truth)]
    return subprocess.Popen(
        [*command, "--sweep-delay", str(delay), "--log-level", "warning"],
        env=env,
        cwd=workdir,
        stdout=stdout,
        stderr=subprocess.STDOUT,
    )


@dataclass
class KilledMidSweep:
    """What a SIGKILL mid-sweep and a restart left: the node's history, the second life's
    output and exit status, and how long the restarted one took to finish the sweep."""

    node: str
    history: list[NodeState]
    output: str
    returncode: int | None
    restart_to_done_s: float


def kill_mid_sweep(settings: Settings, workdir: Path, node: str = "node-020") -> KilledMidSweep:
    """Flag ``node`` (a degraded NIC in the truth) into a live orchestrator whose sweeps take
    10 minutes; SIGKILL it once the node is sweeping; start a new one (sweeps instant) and
    wait until the node is in repair."""
    from .helpers import NODES

    now = time.time()
    truth = write_truth(workdir / "truth.json", NODES, [nic_fault(node, now)], now)
    proc = start_orchestrator(settings, truth, 600, workdir)
    try:
        send(settings, flag(node, f"nic-{node}", now - 1, category="nic", gpu=None))
        wait_until(lambda: states_on_topic(settings).get(node) == "sweeping", timeout_s=90)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    restarted = time.monotonic()
    proc = start_orchestrator(settings, truth, 0, workdir)
    try:
        wait_until(lambda: states_on_topic(settings).get(node) == "repair", timeout_s=90)
        done_s = time.monotonic() - restarted
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    history = read_node_states(settings, keep_history=True)[node].history
    return KilledMidSweep(node, history, output, proc.returncode, done_s)

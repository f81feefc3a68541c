"""The agent's node name: config, else NODE_NAME, else SLURMD_NODENAME, else the host name."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from guard.cli import main
from guard.config import Settings, node_name
from guard.schemas import parse_message

from .fake_sysfs import make_fake_sysfs


def test_node_name_precedence() -> None:
    env = {"NODE_NAME": "k8s-gpu-3", "SLURMD_NODENAME": "slurm-gpu-3"}
    assert node_name("cfg-gpu-3", env) == "cfg-gpu-3"
    assert node_name(None, env) == "k8s-gpu-3"
    assert node_name(None, {"NODE_NAME": " ", "SLURMD_NODENAME": "slurm-gpu-3"}) == "slurm-gpu-3"
    assert node_name(None, {}) == socket.gethostname()


@pytest.mark.parametrize(
    ("env", "option", "expected"),
    [
        ({"NODE_NAME": "k8s-node-9", "SLURMD_NODENAME": "sn-9"}, None, "k8s-node-9"),
        ({"SLURMD_NODENAME": "sn-9"}, None, "sn-9"),
        ({"NODE_NAME": "k8s-node-9"}, "from-cli", "from-cli"),
        ({}, None, socket.gethostname()),
    ],
)
def test_agent_samples_carry_the_resolved_node_name(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfdbinary: pytest.CaptureFixture[bytes],
    env: dict[str, str],
    option: str | None,
    expected: str,
) -> None:
    for name in ("NODE_NAME", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sysfs = make_fake_sysfs(tmp_path / "sys")
    argv = ["agent", "--once", "--dry-run", "--gpu-source", "none", "--sysfs", str(sysfs)]
    argv += ["--socket", str(tmp_path / "agent.sock")]
    if option:
        argv += ["--node", option]
    assert main(argv) == 0
    lines = [line for line in capfdbinary.readouterr().out.splitlines() if line.startswith(b"{")]
    nodes = {parse_message(line).node for line in lines}
    assert lines and nodes == {expected}


def test_the_examples_in_node_names_docstring_run() -> None:
    import doctest

    import guard.config

    result = doctest.testmod(guard.config)
    assert result.attempted >= 2 and result.failed == 0

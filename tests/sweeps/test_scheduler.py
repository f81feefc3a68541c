"""Scheduler adapters: a failing ``scontrol`` (the real Slurm is in test_slurm.py) and a
stand-in Kubernetes API server (test_kubernetes.py has the full one)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from guard.config import Settings
from guard.sweeps.scheduler import SchedulerError, make_scheduler
from guard.sweeps.slurm import SlurmCli, SlurmScheduler

# --- Slurm ----------------------------------------------------------------------------------

FAKE_SCONTROL = """#!{python}
import json, os, sys
log = os.environ["FAKE_SCONTROL_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_SCONTROL_FAIL"):
    sys.stderr.write("slurm_update error: Invalid node name specified\\n")
    sys.exit(1)
if sys.argv[1:3] == ["show", "nodes"]:
    print("NodeName=gpu-001 Arch=x86_64 State=IDLE")
    print("NodeName=gpu-002 Arch=x86_64 State=ALLOCATED")
"""


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    return log


def test_make_scheduler_builds_slurm_with_its_settings(settings: Settings) -> None:
    settings.orchestrator.scheduler = "slurm"
    settings.orchestrator.slurm_node_map = {"gpu-001": "sl-gpu-001"}
    settings.orchestrator.slurm_user = "guard"
    slurm = make_scheduler(settings)
    assert isinstance(slurm, SlurmScheduler)
    assert slurm.names.slurm("gpu-001") == "sl-gpu-001"
    assert slurm.names.agent("sl-gpu-001") == "gpu-001"
    assert slurm.names.slurm("gpu-002") == "gpu-002"
    assert slurm.user == "guard"


def test_a_scontrol_failure_is_a_scheduler_error(
    fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SCONTROL_FAIL", "1")
    with pytest.raises(SchedulerError, match="exited 1: slurm_update error: Invalid node name"):
        SlurmScheduler().cordon("nope", "x")
    # it read the node before changing anything, and changed nothing
    assert [json.loads(x) for x in fake_scontrol.read_text().splitlines()] == [
        ["show", "node", "-o", "nope"]
    ]
    assert SlurmScheduler().inventory() is None
    with pytest.raises(SchedulerError, match="No such file"):
        SlurmScheduler(SlurmCli("/nonexistent/scontrol")).uncordon("gpu-001")

"""The ``[detectors]`` section: TOML and GUARD_DETECTORS_* reach every engine, bad ones fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.cli import main
from guard.config import load_settings
from guard.detectors.core import MessageFeed
from guard.schemas import GpuSample, encode
from guard.streams.processing import engine_config_of

TOML = """
[detectors]
peer_anomaly = false
ignore_xids = [94]
[detectors.args.thermal]
peer_delta_c = 12
[detectors.args.peer_straggler]
min_peers = 6
"""


def _xid_flags(engine: MessageFeed, xids: dict[int, int]) -> list[tuple[int, str]]:
    flags = []
    for t in range(4):
        for g in range(8):
            xid = xids.get(g) if t == 2 else None
            flags += engine.update(GpuSample(ts=100.0 + t + 0.01 * g, node="n1", gpu=g, xid=xid))
    flags += engine.flush()
    return [(f.evidence["xid"], f.severity) for f in flags if f.detector == "gpu_errors"]


def test_the_section_reaches_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "guard.toml"
    config.write_text(TOML)
    monkeypatch.setenv("GUARD_DETECTORS_TICK_S", "2.5")
    cfg = engine_config_of(load_settings(config))
    assert (cfg.tick_s, cfg.peer_anomaly) == (2.5, False)
    engine = MessageFeed(cfg)
    node, job = engine.node("n1"), engine.job("j1")
    assert node.thermal.peer_delta_c == 12 and node.anomaly is None and job.anomaly is None
    assert job.stragglers is not None and job.stragglers.min_peers == 6
    # 94 ignored, 13 (application) an observation, 48 (DBE) a claim
    assert _xid_flags(engine, {1: 94, 2: 13, 3: 48}) == [(13, "info"), (48, "critical")]


def test_application_xids_can_be_made_claims_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARD_DETECTORS_INFO_XIDS", "[]")
    engine = MessageFeed(engine_config_of(load_settings()))
    assert _xid_flags(engine, {2: 13}) == [(13, "critical")]
    assert engine.node("n1").anomaly is not None  # the river models are on by default


def test_a_misspelt_detector_setting_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "guard.toml"
    config.write_text("[detectors.args.thermal]\npeer_delta = 12\n")
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_bytes(encode(GpuSample(ts=1.0, node="n1", gpu=0, temp_c=50.0)) + b"\n")
    code = main(["--config", str(config), "backtest", str(telemetry), "--out", str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert code != 0
    assert "detectors.args.thermal: no setting 'peer_delta'" in err and "peer_delta_c" in err
    assert "[detectors]" in err


def test_config_show_prints_the_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show"]) == 0
    detectors = json.loads(capsys.readouterr().out)["detectors"]
    assert detectors["peer_anomaly"] is True and detectors["info_xids"] == [13, 31, 43, 45]


def test_the_demo_passes_the_section_to_its_streams_workers() -> None:
    """The demo's ``guard streams`` subprocesses get only the GUARD_* variables it sets: the
    [detectors] section must be among them."""
    import subprocess
    import sys

    from guard.demo.pipeline import worker_env

    settings = load_settings(
        None, detectors={"peer_anomaly": False, "args": {"thermal": {"limit_c": 88}}}
    )
    done = subprocess.run(
        [sys.executable, "-m", "guard.cli", "config", "show"],
        env=worker_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    shown = json.loads(done.stdout)["detectors"]
    assert shown == settings.detectors.model_dump()
    assert shown["peer_anomaly"] is False and shown["args"] == {"thermal": {"limit_c": 88}}

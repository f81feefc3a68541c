"""A fixed simulated cluster gives the same telemetry, flags and scores as when last recorded.

The fixture was recorded before the restructure and re-recorded for issue 9, which changed
the simulator and the detectors on purpose (tests/data/backtest-regression/README.md):
the simulator's output must hash the same, the backtest's flags must be byte-equal and the
evaluation's figures equal.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "backtest-regression"
TELEMETRY_SHA256 = "b66da7bd5cb7266bb955865979be7925449537ab83ca68dc08f9eb1e51771ff0"
SIMULATE = [
    "simulate", "--nodes", "8", "--duration", "900", "--seed", "11", "--random-faults", "6",
    "--fault", "slow_gpu:node=node-003:gpu=2:onset=300",
    "--fault", "degraded_nic:node=node-005:onset=200", "--workers", "1",
]  # fmt: skip


def _guard(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "guard.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_backtest_of_a_fixed_simulation_matches_the_recorded_flags(tmp_path: Path) -> None:
    telemetry, truth, flags = tmp_path / "t.jsonl", tmp_path / "truth.json", tmp_path / "f.jsonl"
    _guard(*SIMULATE, "--out", str(telemetry), "--truth", str(truth))
    assert hashlib.sha256(telemetry.read_bytes()).hexdigest() == TELEMETRY_SHA256
    assert json.loads(truth.read_text()) == json.loads((FIXTURE / "truth.json").read_text())

    _guard("backtest", str(telemetry), "--out", str(flags))
    assert flags.read_bytes() == (FIXTURE / "flags.jsonl").read_bytes()

    scores = json.loads(_guard("eval", "--truth", str(truth), "--flags", str(flags), "--json"))
    assert scores == json.loads((FIXTURE / "eval.json").read_text())

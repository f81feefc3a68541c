"""Real, public datasets for the detectors: Alibaba PAI step times and the NAB benchmark.

Loaders turn the files (``../shared/data``; copies in ``tests/data``) into Guard's messages
or plain series; :func:`nab_score` scores alarm times the way NAB does. Files in, figures
out: no Kafka, no simulator.
"""

from __future__ import annotations

import csv
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guard.schemas import StepTiming

__all__ = ["PAI_EPOCH", "nab_score", "nab_series", "nab_windows", "pai_step_timings"]

PAI_EPOCH = 1_600_000_000.0  # PAI times are seconds since the job started; any epoch will do


def pai_step_timings(path: str | Path, job: str) -> list[StepTiming]:
    """Alibaba PAI mini-batch times as ``StepTiming`` messages, in time order.

    Each ``time`` is one step; worker *w* is rank *w* on node ``worker-w``; the normalised
    mini-batch time (0-1000), in thousandths, is both the rank's ``compute_s`` and its
    ``step_s`` (the trace gives each worker's own mini-batch time, not a synchronised wall
    time, so a step-time alert rule sees the same differences the peer detector sees).
    """
    by_time: dict[int, dict[int, float]] = {}
    with Path(path).open(newline="") as fh:
        for row in csv.DictReader(fh):
            by_time.setdefault(int(row["time"]), {})[int(row["worker"])] = float(
                row["batch_time_norm"]
            )
    messages = []
    for step, t in enumerate(sorted(by_time)):
        for worker, value in sorted(by_time[t].items()):
            messages.append(
                StepTiming(
                    ts=PAI_EPOCH + t,
                    node=f"worker-{worker}",
                    job=job,
                    rank=worker,
                    gpu=0,
                    step=step,
                    step_s=value / 1000.0,
                    compute_s=value / 1000.0,
                )
            )
    return messages


def nab_series(path: str | Path) -> list[tuple[float, float]]:
    """A NAB CSV as ``(epoch seconds, value)`` pairs (NAB timestamps are naive; read as UTC)."""
    out = []
    with Path(path).open(newline="") as fh:
        for row in csv.DictReader(fh):
            when = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=UTC)
            out.append((when.timestamp(), float(row["value"])))
    return out


def nab_windows(path: str | Path, key: str) -> list[tuple[float, float]]:
    """Labelled anomaly windows of one NAB series from ``combined_windows.json``."""

    def epoch(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()

    raw = json.loads(Path(path).read_text())[key]
    return [(epoch(a), epoch(b)) for a, b in raw]


def nab_score(alarms: list[float], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """NAB-style scoring (standard profile: TP 1, FP -0.11, FN -1) of alarm times.

    The first alarm in a window earns ``2 / (1 + exp(5 y)) - 1`` where ``y`` is its position
    relative to the window's end (-1 at the start, 0 at the end): early is better; later alarms
    in the same window neither earn nor cost. An alarm outside every window costs 0.11. A
    window without an alarm costs 1. The normalised score is 100 for perfect detection and 0
    for a detector that never alarms.
    """
    raw = 0.0
    inside = 0
    hit = [False] * len(windows)
    for ts in sorted(alarms):
        for i, (a, b) in enumerate(windows):
            if a <= ts <= b:
                inside += 1
                if not hit[i]:
                    hit[i] = True
                    y = (ts - b) / (b - a) if b > a else 0.0
                    raw += 2.0 / (1.0 + math.exp(5.0 * y)) - 1.0
                break
        else:
            raw -= 0.11
    raw -= sum(1 for h in hit if not h)
    perfect = len(windows) * (2.0 / (1.0 + math.exp(-5.0)) - 1.0)
    null = -float(len(windows))
    return {
        "alarms": len(alarms),
        "inside": inside,
        "outside": len(alarms) - inside,
        "windows_hit": sum(hit),
        "windows": len(windows),
        "nab_score": round(100.0 * (raw - null) / (perfect - null), 1) if windows else None,
    }

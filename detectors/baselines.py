"""The two baselines Guard is measured against, on the same input, with the same flag output.

* :class:`StaticRulesBaseline` — alert rules as a dcgm-exporter user writes them: GPU
  temperature above 85 C, any Xid, a DBE increase, a ``link_downed`` increase, and a rank's
  step time above 1.2x the job's median for that step. Every rule fires on each sample that
  matches (an alert per evaluation, deduplicated per component and minute as Alertmanager
  would group it).
* :class:`NvrxBaseline` — NVIDIA Resiliency Extension style: per job and step, each rank's
  relative performance score ``median / compute_s`` (``step_s`` when no ``compute_s``); a
  score below 0.75 flags the rank's node.

They are deliberately simple: they are what Guard has to beat.

Example
-------
>>> from guard.schemas import GpuSample
>>> from guard.detectors.baselines import StaticRulesBaseline
>>> rules = StaticRulesBaseline()
>>> [f.evidence["rule"] for f in rules.update(GpuSample(ts=1.0, node="n", gpu=0, temp_c=88.0))]
['temp_c > 85']

"""

from __future__ import annotations

from typing import Any

from guard.schemas import Flag, GpuSample, GuardMessage, NicSample, StepTiming, stable_id

from .robust import median

__all__ = ["NvrxBaseline", "StaticRulesBaseline"]


def _flag(
    detector: str, category: str, severity: str, msg: GuardMessage, group_s: float, **kw: Any
) -> Flag:
    component = kw.get("gpu", kw.get("rank", kw.get("device")))
    bucket = int(msg.ts // group_s)
    evidence = kw.pop("evidence")
    return Flag(
        ts=msg.ts,
        node=msg.node,
        job=msg.job,
        id=stable_id(detector, category, msg.node, component, evidence.get("rule"), bucket),
        detector=detector,
        category=category,
        severity=severity,
        score=1.0,
        evidence=evidence,
        **kw,
    )


class _StepGroups:
    """Steps of one job, closed two steps later: ``{step: [(message, value)]}``."""

    def __init__(self) -> None:
        self.pending: dict[int, list[tuple[StepTiming, float]]] = {}

    def add(self, msg: StepTiming, value: float) -> list[list[tuple[StepTiming, float]]]:
        self.pending.setdefault(msg.step, []).append((msg, value))
        done = [s for s in self.pending if s <= msg.step - 2]
        return [self.pending.pop(s) for s in sorted(done)]

    def flush(self) -> list[list[tuple[StepTiming, float]]]:
        return [self.pending.pop(s) for s in sorted(self.pending)]


class _StepBaseline:
    """What both baselines share: per-job step groups judged when closed, and no clock."""

    name = "step_baseline"

    def __init__(self, group_s: float) -> None:
        self.group_s = group_s
        self.steps: dict[str, _StepGroups] = {}

    def tick(self, now: float) -> list[Flag]:
        return []  # steps close on later steps' messages, not on time

    def flush(self) -> list[Flag]:
        out: list[Flag] = []
        for groups in self.steps.values():
            for rows in groups.flush():
                out += self._judge(rows)
        return out

    def _add_step(self, msg: StepTiming, value: float) -> list[Flag]:
        groups = self.steps.setdefault(msg.job, _StepGroups())
        out: list[Flag] = []
        for rows in groups.add(msg, value):
            out += self._judge(rows)
        return out

    def _judge(self, rows: list[tuple[StepTiming, float]]) -> list[Flag]:
        raise NotImplementedError


class StaticRulesBaseline(_StepBaseline):
    """Threshold alert rules over dcgm-exporter style metrics and step times."""

    name = "static_rules"

    def __init__(
        self, temp_c: float = 85.0, step_ratio: float = 1.2, group_s: float = 60.0
    ) -> None:
        super().__init__(group_s)
        self.temp_c = temp_c
        self.step_ratio = step_ratio
        self.dbe: dict[tuple[str, int], int] = {}
        self.downed: dict[tuple[str, str, int], int] = {}

    def update(self, msg: GuardMessage) -> list[Flag]:
        if isinstance(msg, GpuSample):
            return self._gpu(msg)
        if isinstance(msg, NicSample):
            return self._nic(msg)
        if isinstance(msg, StepTiming):
            return self._add_step(msg, msg.step_s)
        return []

    def _gpu(self, msg: GpuSample) -> list[Flag]:
        """The exporter's GPU alert rules: hot, an Xid, a double-bit ECC error more."""
        out: list[Flag] = []
        g = self.group_s
        if msg.temp_c is not None and msg.temp_c > self.temp_c:
            out.append(
                _flag(
                    self.name,
                    "thermal",
                    "warning",
                    msg,
                    g,
                    gpu=msg.gpu,
                    evidence={"rule": "temp_c > 85", "temp_c": msg.temp_c},
                )
            )
        if msg.xid is not None:
            out.append(
                _flag(
                    self.name,
                    "gpu_error",
                    "critical",
                    msg,
                    g,
                    gpu=msg.gpu,
                    evidence={"rule": "xid", "xid": msg.xid},
                )
            )
        if msg.ecc_dbe_total is not None:
            key = (msg.node, msg.gpu)
            before = self.dbe.get(key)
            self.dbe[key] = msg.ecc_dbe_total
            if before is not None and msg.ecc_dbe_total > before:
                out.append(
                    _flag(
                        self.name,
                        "gpu_error",
                        "critical",
                        msg,
                        g,
                        gpu=msg.gpu,
                        evidence={"rule": "dbe increase"},
                    )
                )
        return out

    def _nic(self, msg: NicSample) -> list[Flag]:
        """The exporter's link rule: the port's link went down once more."""
        out: list[Flag] = []
        g = self.group_s
        value = msg.counters.get("link_downed")
        if value is not None:
            nkey = (msg.node, msg.device, msg.port)
            before = self.downed.get(nkey)
            self.downed[nkey] = value
            if before is not None and value > before:
                out.append(
                    _flag(
                        self.name,
                        "link",
                        "warning",
                        msg,
                        g,
                        device=msg.device,
                        evidence={"rule": "link_downed increase"},
                    )
                )
        return out

    def _judge(self, rows: list[tuple[StepTiming, float]]) -> list[Flag]:
        center = median([v for _, v in rows])
        return [
            _flag(
                self.name,
                "straggler",
                "warning",
                m,
                self.group_s,
                rank=m.rank,
                evidence={"rule": "step_s > 1.2x job median", "ratio": round(v / center, 3)},
            )
            for m, v in rows
            if center > 0 and v > self.step_ratio * center
        ]


class NvrxBaseline(_StepBaseline):
    """Relative performance score per rank and step; below ``threshold`` flags the node."""

    name = "nvrx_relative"

    def __init__(self, threshold: float = 0.75, group_s: float = 60.0) -> None:
        super().__init__(group_s)
        self.threshold = threshold

    def update(self, msg: GuardMessage) -> list[Flag]:
        if not isinstance(msg, StepTiming):
            return []
        return self._add_step(msg, msg.compute_s if msg.compute_s is not None else msg.step_s)

    def _judge(self, rows: list[tuple[StepTiming, float]]) -> list[Flag]:
        center = median([v for _, v in rows])
        out: list[Flag] = []
        for m, v in rows:
            score = center / v if v > 0 else 1.0
            if score < self.threshold:
                out.append(
                    _flag(
                        self.name,
                        "straggler",
                        "warning",
                        m,
                        self.group_s,
                        rank=m.rank,
                        evidence={
                            "rule": "relative score < 0.75",
                            "relative_score": round(score, 3),
                        },
                    )
                )
        return out

"""The advice producer's planning clock: event time, wall time for a backlog, job ends."""

from __future__ import annotations

from guard.config import FabricSettings
from guard.streams.advisor import Advisor

from .test_advice_sink import _ring_step

NODES = [f"node-{i:02d}" for i in range(16)]
T0 = 1_767_225_600.0


def _advisor() -> Advisor:
    return Advisor(FabricSettings(nodes_per_leaf=4, spines=4, advise_every_s=30, job_idle_s=120))


def test_a_backlog_read_out_of_event_time_order_is_planned_on_the_wall_clock() -> None:
    advisor = _advisor()
    for t in range(0, 300, 10):  # job-b's partition first, to the end of the run
        for m in _ring_step("job-b", NODES[1::2], T0 + t, None):
            advisor.update(m)
    assert [a.job for a in advisor.due(wall=0.0)] == ["job-b"]
    for t in range(0, 300, 10):  # then job-a's: older than the watermark
        for m in _ring_step("job-a", NODES[0::2], T0 + t, None):
            advisor.update(m)
    assert advisor.due(wall=10.0) == []  # neither clock has moved on enough
    # planned together: job-b's plan may change with job-a's flows beside it
    assert "job-a" in [a.job for a in advisor.due(wall=31.0)]
    assert advisor.plans == 2


def test_a_silent_job_is_forgotten_and_its_advice_sent_again_if_it_returns() -> None:
    advisor = _advisor()
    for m in _ring_step("job-a", NODES[0::2], T0, None):
        advisor.update(m)
    assert [a.job for a in advisor.due()] == ["job-a"]
    for t in range(0, 400, 10):
        for m in _ring_step("job-b", NODES[1::2], T0 + t, None):
            advisor.update(m)
        advisor.due()
    assert advisor.patterns.jobs() == ["job-b"]  # job-a silent for 400 s > job_idle_s
    sent = []
    for t in range(400, 440, 10):  # it returns: planned again within advise_every_s
        for m in _ring_step("job-a", NODES[0::2], T0 + t, None):
            advisor.update(m)
        sent += [a.job for a in advisor.due()]
    assert "job-a" in sent

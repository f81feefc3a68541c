"""The advice producer's planning clock: event time, wall time for a backlog, job ends."""

from __future__ import annotations

from guard.config import FabricSettings
from guard.planning.advice import JobPatterns
from guard.schemas import Advice, NicSample
from guard.schemas.topology import infer_topology
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


def _nic_samples(t: float, waits: dict[str, int]) -> list[NicSample]:
    """Rail 0 of every node; ``waits``: the node's port_xmit_wait counter at ``t``."""
    return [
        NicSample(ts=t, node=node, job="job-a" if i % 2 == 0 else "job-b", device="mlx5_0",
                  port=1, counters={"port_xmit_wait": waits[node]})
        for i, node in enumerate(NODES)
    ]  # fmt: skip


def test_the_hot_spot_detector_feeds_the_plan_and_advice_follows_the_hot_set() -> None:
    # four pods of four nodes; one uplink of pod0's rail-0 leaf runs at a quarter
    topology = infer_topology(NODES, rails=8, nodes_per_leaf=4, spines=4).with_capacity(
        {"pod0-rail0->spine0": 0.25}
    )
    fabric = FabricSettings(nodes_per_leaf=4, spines=4, advise_every_s=30, job_idle_s=10_000)
    advisor = Advisor(fabric, topology)
    advisor.patterns = JobPatterns(default_bytes=1e9)
    counters = dict.fromkeys(NODES, 0)
    sent: list[Advice] = []

    def run(t0: int, t1: int, hot: bool) -> None:
        for t in range(t0, t1, 10):
            for node in NODES:  # pod0's NICs wait 20x the others while the leaf is hot
                counters[node] += 10 * (200_000 if hot and node in NODES[:4] else 10_000)
            for m in _ring_step("job-a", NODES[0::2], T0 + t, None):
                advisor.update(m)
            for m in _ring_step("job-b", NODES[1::2], T0 + t, None):
                advisor.update(m)
            for m in _nic_samples(T0 + t, counters):
                advisor.update(m)
            sent.extend(advisor.due())

    def drains(advice: list[Advice]) -> set[str]:
        return {a.target for adv in advice for a in adv.actions if a.action == "drain_uplink"}

    run(0, 200, hot=False)
    assert sent and not advisor.hot_leaves and not drains(sent)  # the file alone drains nothing
    quiet = len(sent)
    run(200, 500, hot=True)  # three 60 s windows hot in a row: the detector reports the leaf
    assert advisor.hot_leaves == {"pod0-rail0"}
    assert drains(sent[quiet:]) == {"pod0-rail0->spine0"}
    assert all("detected hot pod0-rail0" in a.hot_links for a in sent[quiet:])
    hot = len(sent)
    run(500, 800, hot=False)  # it cools, the detector withdraws it: advice without the drain
    assert not advisor.hot_leaves
    assert sent[hot:] and not drains(sent[hot:])


def test_a_plan_made_before_a_jobs_collectives_were_read_is_redone_without_resending() -> None:
    """The steps topic read before the collectives one: the first plan has each job's nodes
    but the default all-reduce size; the collectives read within ``advise_every_s`` wait for
    the next plan, which plans again on the complete input and sends nothing when the advice
    is the same (what made ``test_advice_sink``'s plan count vary with the read order)."""
    advisor = _advisor()
    rings = {"job-a": NODES[0::2], "job-b": NODES[1::2][::-1]}
    records = [
        m
        for t in range(0, 200, 10)
        for job, ring in rings.items()
        for m in _ring_step(job, ring, T0 + t, None)
    ]
    for m in records:
        if m.kind == "step":
            advisor.update(m)
    first = advisor.due(wall=0.0)
    assert sorted(a.job for a in first) == ["job-a", "job-b"] and advisor.plans == 1
    for m in records:
        if m.kind == "collective":
            advisor.update(m)
    assert advisor.due(wall=1.0) == [] and advisor.plans == 1  # not due yet
    for t in range(200, 400, 10):
        for job, ring in rings.items():
            for m in _ring_step(job, ring, T0 + t, None):
                advisor.update(m)
    assert advisor.due(wall=2.0) == [] and advisor.plans == 2  # planned again: same advice


def test_a_backlog_at_assignment_is_read_to_its_end_before_the_first_plan() -> None:
    """The partitions assigned with records unread hold planning back until each is read to
    where it ended at assignment (the steps topic read to its end and the collectives one not
    begun is half a job); records produced later do not hold it back; a revoked partition
    no longer does."""
    from guard.streams.advisor import Backlog

    backlog = Backlog()
    backlog.assigned(
        {("steps", 0): (0, 100), ("collectives", 0): (20, 50), ("nic", 1): (5, 5)}
    )  # the NIC partition holds nothing unread
    assert backlog.behind and set(backlog.ends) == {("steps", 0), ("collectives", 0)}
    backlog.read({("steps", 0): 100, ("collectives", 0): -1001})  # not read from yet
    assert backlog.behind and set(backlog.ends) == {("collectives", 0)}
    backlog.read({("collectives", 0): 49})
    assert backlog.behind
    backlog.read({("collectives", 0): 50})
    assert not backlog.behind
    backlog.assigned({("steps", 1): (0, 10)})  # a rebalance
    backlog.revoked([("steps", 1)])
    assert not backlog.behind

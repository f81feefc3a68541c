"""The job stream as columns: a poll's step and collective records of a job at once.

The core hands a job's records of one poll to its detectors as columns; how many records a
poll holds (one, a node's share of a step, thousands) must not change what they find, and
the single-sample verbs (``update``) are the same columns of one row.
"""

from __future__ import annotations

import numpy as np

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.agents.simulator.config import FaultSpec
from guard.detectors.core import DetectionCore, encode_findings
from guard.detectors.engine import JobDetectors
from guard.detectors.findings import Finding
from guard.detectors.job_columns import CollectiveColumns, StepColumns, runs_of
from guard.schemas import StepTiming, batch_messages, encode
from guard.schemas.sample_decoder import decode_structs


def _job_records(seed: int) -> list[tuple[int, str, bytes]]:
    config = SimConfig(
        nodes=6,
        duration_s=420,
        seed=seed,
        random_faults=0,
        faults=[
            FaultSpec(
                kind="slow_gpu", node="node-002", gpu=3, onset_s=120, slowdown=0.1, pattern="steady"
            ),
            FaultSpec(kind="degraded_nic", node="node-004", onset_s=200),
        ],
    )
    messages = [m for m in ClusterSimulator(config).messages() if m.kind in ("step", "collective")]
    return [(0, m.kind.removesuffix("_batch"), encode(m)) for m in batch_messages(messages)]


def _found(records: list[tuple[int, str, bytes]], poll: int) -> list[tuple[object, ...]]:
    core = DetectionCore()
    found = []
    for i in range(0, len(records), poll):
        found += core.step(records[i : i + poll], wall=0.0).findings
    found += core.flush()
    return sorted(
        (f.detector, f.category, f.node, f.rank, f.clear, f.since, f.ts, f.score)
        for f in found
        if isinstance(f, Finding)
    )


def test_what_the_job_detectors_find_does_not_depend_on_the_poll_size() -> None:
    records = _job_records(seed=4)
    one_by_one = _found(records, 1)
    assert any(c == "straggler" and n == "node-002" for _, c, n, *_ in one_by_one)
    for poll in (7, 64, len(records)):
        assert _found(records, poll) == one_by_one


def test_the_core_flags_the_straggler_through_fusion_from_columns() -> None:
    core = DetectionCore()
    records = _job_records(seed=5)
    flags = []
    pending: list[tuple[int, bytes, bytes]] = []
    for i in range(0, len(records), 200):
        out = core.step(records[i : i + 200], pending, wall=0.0)
        flags += out.flags
        pending = encode_findings(out.findings)
    flags += core.step((), pending, wall=0.0).flags
    assert {f.node for f in flags if f.category == "straggler"} == {"node-002"}


def test_columns_of_structs_and_of_models_are_the_same() -> None:
    records = _job_records(seed=6)
    step_batch = next(v for _, k, v in records if k == "step" and b"step_batch" in v)
    coll_batch = next(v for _, k, v in records if k == "collective" and b"collective_batch" in v)
    from guard.schemas import decode

    for raw, kind, columns in (
        (step_batch, "step", StepColumns),
        (coll_batch, "collective", CollectiveColumns),
    ):
        _, head, entries = decode_structs(raw, kind)
        fast = columns.of_records([(head, entries)])
        samples = decode(raw, kind).samples()
        slow = columns.of_records([(s, [s]) for s in samples])
        for name in ("rank", "ts", "node"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
        assert fast.runs == [(0, len(entries))] and len(slow.runs) == 1


def test_a_rank_that_moves_to_another_node_starts_afresh_and_a_missing_compute_is_skipped() -> None:
    job = JobDetectors("j")
    det = job.stragglers
    assert det is not None

    def step(rank: int, node: str, compute: float | None) -> StepTiming:
        return StepTiming(
            ts=1.0, node=node, job="j", rank=rank, step=0, step_s=1.0, compute_s=compute
        )

    job.update(step(3, "a", 1.0))
    job.update(step(4, "a", None))
    assert det.ranks[3][0] == "a" and det.pending[0] == {3: 1.0}
    job.update(step(3, "b", 1.0))
    assert det.ranks[3][0] == "b"
    runs = runs_of(np.array([1, 1, 2, 2, 1]), np.array([0, 0, 0, 1, 1]))
    assert runs == [(0, 2), (2, 3), (3, 4), (4, 5)]

"""The columnar GPU rules (issue 25) against the per-round rules they replaced.

The same samples, handed to the columns in steps of any size and interleaved over two nodes,
must give exactly the findings (every field, the evidence included, in the same order per
node) that the per-sample engine gave, kept in :mod:`tests.detectors.reference_gpu`. The
sibling CUSUM's claims (``raised_by: cusum``) came after it and are not in the reference;
tests/detectors/test_sibling_cusum.py has theirs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.detectors.engine import NodeDetectors
from guard.detectors.findings import Finding
from guard.detectors.gpu_round import GpuColumns
from guard.detectors.gpu_step import update_gpus
from guard.schemas import GpuSample, encode
from guard.schemas.batches import _make_batch
from guard.schemas.sample_decoder import decode_structs

from .reference_gpu import ReferenceGpuNode

T0 = 1_767_225_600.0
NODES = ("n1", "n2")


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


SAMPLE = st.fixed_dictionaries(
    {
        "node": st.sampled_from(NODES),
        "gpu": st.integers(0, 4),
        "dt": st.sampled_from([0.0, 0.001, 0.4, 1.0, 1.0, 1.0]),
        "job": st.sampled_from([None, "job-a", "job-a", "job-b"]),
        "temp_c": _maybe(st.sampled_from([55.0, 62.0, 63.5, 75.0, 86.0, 89.0, 91.0, 98.0])),
        "temp_slowdown_c": _maybe(st.just(87.0)),
        "power_w": _maybe(st.sampled_from([0.0, 300.0, 450.0, 600.0, 610.0, 690.0])),
        "power_limit_w": _maybe(st.sampled_from([500.0, 700.0, 700.0])),
        "sm_clock_mhz": _maybe(st.sampled_from([0.0, 1200.0, 1850.0, 1980.0, 1980.0])),
        "util_pct": _maybe(st.sampled_from([0.0, 40.0, 60.0, 97.0, 98.0])),
        "clock_event_reasons": _maybe(st.sampled_from([0, 0, 0x1, 0x4, 0x8, 0x20, 0x40, 0x80])),
        "xid": _maybe(st.sampled_from([13, 48, 79, 79])),
        "ecc_dbe_total": _maybe(st.sampled_from([0, 0, 1, 3])),
    }
)


def _samples(draws: list[dict[str, Any]]) -> list[GpuSample]:
    ts = T0
    out = []
    for d in draws:
        ts += d.pop("dt")
        out.append(GpuSample(ts=ts, **d))
    return out


def _runs(step: list[GpuSample]) -> list[list[GpuSample]]:
    """The step's samples as runs that one batch record can carry: one node and job each."""
    runs: list[list[GpuSample]] = []
    for s in step:
        if runs and (runs[-1][0].node, runs[-1][0].job) == (s.node, s.job):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _key(f: Finding) -> tuple[Any, ...]:
    return (
        f.detector,
        f.category,
        f.severity,
        f.node,
        f.ts,
        f.since,
        f.score,
        f.job,
        f.gpu,
        f.evidence,
        f.clear,
    )


@settings(max_examples=300, deadline=None)
@given(
    draws=st.lists(SAMPLE, min_size=1, max_size=80),
    per_step=st.integers(1, 40),
    records=st.sampled_from(["samples", "single", "batched"]),
)
def test_columnar_gpu_rules_give_the_reference_findings(
    draws: list[dict[str, Any]], per_step: int, records: str
) -> None:
    """``records``: the columns come from the samples' own fields (absent fields None), or
    from encoded records through the core's decoder (absent fields absent): single records,
    or a step's runs of one node's samples as batch records."""
    samples = _samples(draws)
    references = {n: ReferenceGpuNode(n) for n in NODES}
    expected: dict[str, list[Finding]] = {n: [] for n in NODES}
    steps = [samples[i : i + per_step] for i in range(0, len(samples), per_step)]
    for step in steps:
        for s in step:
            expected[s.node] += references[s.node].update(s)
    for n in NODES:
        expected[n] += references[n].flush()

    nodes = {n: NodeDetectors(n) for n in NODES}
    for n in nodes.values():
        n.anomaly = None  # the river feed is not part of the reference
    got: dict[str, list[Finding]] = {n: [] for n in NODES}
    for step in steps:
        present = [n for n in NODES if any(s.node == n for s in step)]
        owner = np.array([present.index(s.node) for s in step], dtype=np.intp)
        if records == "samples":
            cols = GpuColumns.of_samples(step)
        else:
            runs = _runs(step) if records == "batched" else [[s] for s in step]
            encoded = [encode(_make_batch(run)) for run in runs]  # type: ignore[arg-type]
            cols = GpuColumns.of_structs([decode_structs(e, "gpu")[1:] for e in encoded])
        for f in update_gpus([nodes[n] for n in present], owner, cols):
            got[f.node].append(f)  # type: ignore[index]
    for n in NODES:
        got[n] += nodes[n].flush()

    for n in NODES:
        held = [f for f in got[n] if f.evidence.get("raised_by") != "cusum"]  # not in the reference
        assert [_key(f) for f in held] == [_key(f) for f in expected[n]]


def test_a_lost_gpu_is_found_by_tick_on_the_columns_state() -> None:
    node = NodeDetectors("n1")
    for t in range(5):
        for g in range(8):
            if g == 3 and t > 1:
                continue  # GPU 3 falls silent after t = 1 s; its siblings keep reporting
            node.update(GpuSample(ts=T0 + t, node="n1", job="j", gpu=g, temp_c=60.0))
    assert node.tick(T0 + 30) == []
    [lost] = node.tick(T0 + 62)
    assert (lost.gpu, lost.evidence["error"], lost.since, lost.job) == (3, "lost_gpu", T0 + 1, "j")
    assert node.tick(T0 + 70) == []  # claimed once

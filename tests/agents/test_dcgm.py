"""dcgm-exporter parsing: both host label spellings, sentinels dropped, bad lines reported."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from guard.agents.dcgm import fetch_dcgm, parse_dcgm_metrics
from guard.schemas import encode, parse_message

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "dcgm" / "h100_node.prom"
TS = 1767225600.0


def test_parses_every_mapped_field_and_drops_the_sentinels() -> None:
    samples, problems = parse_dcgm_metrics(FIXTURE.read_text(), "fallback", TS, "job-3")
    by_gpu = {s.gpu: s for s in samples}
    assert sorted(by_gpu) == [0, 1] and {s.node for s in samples} == {"h100-07"}
    g0 = by_gpu[0]
    assert (g0.temp_c, g0.power_w, g0.power_limit_w) == (58, 655.21, 700)
    assert (g0.sm_clock_mhz, g0.mem_clock_mhz, g0.util_pct) == (1980, 2619, 100)
    assert g0.mem_util_pct == 41  # from the lower-case `hostname` label: same host
    assert (g0.ecc_sbe_total, g0.ecc_dbe_total, g0.pcie_replay_total) == (3, 0, 12)
    assert g0.xid is None and g0.uuid.endswith("a00") and g0.job == "job-3"
    g1 = by_gpu[1]
    assert g1.temp_c is None and g1.power_w is None and g1.util_pct is None
    assert g1.pcie_replay_total is None
    assert (g1.xid, g1.clock_event_reasons, g1.ecc_dbe_total) == (79, 32, 1)
    assert len(problems) == 2 and "line" in problems[0]
    for sample in samples:
        assert parse_message(encode(sample)) == sample


def test_without_a_host_label_the_agents_node_is_used() -> None:
    samples, _ = parse_dcgm_metrics('DCGM_FI_DEV_GPU_TEMP{gpu="2"} 44\n', "node-9", TS)
    assert [(s.node, s.gpu, s.temp_c) for s in samples] == [("node-9", 2, 44)]


@given(st.text(max_size=400))
def test_garbage_never_raises(text: str) -> None:
    samples, problems = parse_dcgm_metrics(text, "node-1", TS)
    assert isinstance(samples, list) and isinstance(problems, list)


def test_scrapes_a_live_endpoint_and_survives_a_dead_one(exporter: str) -> None:
    assert len(fetch_dcgm(exporter, "node-1", TS)) == 2
    dead = exporter.rsplit(":", 1)[0] + ":9/metrics"
    assert fetch_dcgm(dead, "node-1", TS, timeout_s=0.5) == []

"""dcgm-exporter parsing: the agent's node on every record whatever the exporter's host label
says, sentinels dropped, bad lines reported; the sticky Xid gauge published once per change,
never at start-up."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from guard.agents.dcgm import DCGM_FIELDS, DcgmCollector, fetch_dcgm, parse_dcgm_metrics
from guard.detectors.core import MessageFeed
from guard.schemas import GpuSample, encode, parse_message

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "dcgm" / "h100_node.prom"
POD_FIXTURE = FIXTURE.with_name("h100_k8s_pod.prom")  # the exporter as a Kubernetes pod
TS = 1767225600.0


def test_parses_every_mapped_field_and_drops_the_sentinels() -> None:
    samples, problems = parse_dcgm_metrics(FIXTURE.read_text(), "h100-07", TS, "job-3")
    by_gpu = {s.gpu: s for s in samples}
    assert sorted(by_gpu) == [0, 1] and {s.node for s in samples} == {"h100-07"}
    g0 = by_gpu[0]
    assert (g0.temp_c, g0.power_w, g0.power_limit_w) == (58, 655.21, 700)
    assert (g0.sm_clock_mhz, g0.mem_clock_mhz, g0.util_pct) == (1980, 2619, 100)
    assert g0.mem_util_pct == 41  # a line with the lower-case `hostname` label: same GPU
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


def test_the_exporters_host_label_never_renames_the_node() -> None:
    """Under Kubernetes dcgm-exporter's Hostname is its own pod's name: the records still
    carry the agent's node, the one its NIC records, step timings and cordons use."""
    text = POD_FIXTURE.read_text()
    assert 'Hostname="nvidia-dcgm-exporter-cwbcm"' in text  # the recorded pod's label
    samples, problems = parse_dcgm_metrics(text, "h100-11", TS, "llm-2")
    assert problems == []
    assert [(s.node, s.gpu) for s in samples] == [("h100-11", g) for g in range(4)]
    g2 = samples[2]
    assert (g2.temp_c, g2.sm_clock_mhz, g2.clock_event_reasons, g2.pcie_replay_total) == (
        83,
        1755,
        32,
        4,
    )
    # a host label that disagrees with the agent (a node's exporter read under another name)
    renamed = FIXTURE.read_text().replace('"h100-07"', '"h100-99"')
    assert {s.node for s in parse_dcgm_metrics(renamed, "h100-07", TS)[0]} == {"h100-07"}


@given(st.text(max_size=400))
def test_garbage_never_raises(text: str) -> None:
    samples, problems = parse_dcgm_metrics(text, "node-1", TS)
    assert isinstance(samples, list) and isinstance(problems, list)


def test_scrapes_a_live_endpoint_and_survives_a_dead_one(exporter: str) -> None:
    assert len(fetch_dcgm(exporter, "node-1", TS)) == 2
    dead = exporter.rsplit(":", 1)[0] + ":9/metrics"
    assert fetch_dcgm(dead, "node-1", TS, timeout_s=0.5) == []


def _refreshed(text: str, temp_c: int, xid: int) -> str:
    """The fixture as the exporter serves it after its next collect: GPU 0's temperature and
    last Xid changed (the value lines of GPU 0 end with ``} <value>``)."""
    new = {"DCGM_FI_DEV_GPU_TEMP{": temp_c, "DCGM_FI_DEV_XID_ERRORS{": xid}
    out = []
    for line in text.splitlines():
        metric = line.split("{", 1)[0] + "{"
        gpu0 = 'gpu="0"' in line and metric in new
        out.append(line.rsplit(" ", 1)[0] + f" {new[metric]}" if gpu0 else line)
    return "\n".join(out) + "\n"


def test_the_sticky_xid_gauge_is_published_once_per_change_and_never_at_start_up() -> None:
    text = FIXTURE.read_text()
    dcgm = DcgmCollector("http://unused", "fallback")

    def scrape(body: str, ts: float) -> list[GpuSample]:
        return dcgm.events(parse_dcgm_metrics(body, "fallback", ts, "job-3")[0])

    # start-up: GPU 1's gauge still holds Xid 79 from before the agent ran: a baseline
    first = scrape(text, TS)
    assert [(s.gpu, s.xid) for s in first] == [(0, None), (1, None)]
    assert first[1].ecc_dbe_total == 1 and first[1].clock_event_reasons == 32  # rest kept
    # the exporter has not refreshed (it collects every 30 s): nothing is published again
    assert scrape(text, TS + 1) == [] and dcgm.stale_scrapes == 1
    # next collect: GPU 0 reports Xid 48 -> one event, on GPU 0 only
    text = _refreshed(text, 59, 48)
    assert [(s.gpu, s.temp_c, s.xid) for s in scrape(text, TS + 30)] == [
        (0, 59, 48),
        (1, None, None),
    ]
    # the gauge keeps 48; readings move on: the Xid is not published as new again
    text = _refreshed(text, 60, 48)
    assert [s.xid for s in scrape(text, TS + 60)] == [None, None]
    # a different Xid later is a new event; so is 48 after the gauge went back to 0
    text = _refreshed(text, 61, 0)
    assert [s.xid for s in scrape(text, TS + 90)] == [None, None]
    text = _refreshed(text, 62, 48)
    assert [s.xid for s in scrape(text, TS + 120)] == [48, None]
    assert dcgm.xid_changes == 2


def test_what_the_collector_publishes_makes_no_start_up_claim() -> None:
    """The detector sees the collector's samples: the old Xid 79 never becomes a flag, the
    new Xid 48 becomes exactly one critical flag."""
    text = FIXTURE.read_text()
    dcgm = DcgmCollector("http://unused", "fallback")
    engine = MessageFeed()
    flags = []
    for i, body in enumerate([text, text, _refreshed(text, 59, 48), _refreshed(text, 60, 48)]):
        for sample in dcgm.events(parse_dcgm_metrics(body, "fallback", TS + 30 * i)[0]):
            flags += engine.update(sample)
    flags += engine.flush()
    # (the fixture's GPU 1 holds the SW-thermal bit: a thermal claim that is not this test's)
    claims = [
        (f.gpu, f.evidence["xid"])
        for f in flags
        if f.severity != "info" and f.category == "gpu_error"
    ]
    assert claims == [(0, 48)]


def test_the_collector_scrapes_a_live_exporter(exporter: str) -> None:
    dcgm = DcgmCollector(exporter, "node-1", timeout_s=2.0)
    first = dcgm.sample(TS, "job-1")
    assert [(s.node, s.gpu, s.xid) for s in first] == [("node-1", 0, None), ("node-1", 1, None)]
    assert dcgm.sample(TS + 1, "job-1") == []  # the same exposition again: stale


def test_the_shipped_counters_file_asks_for_every_field_the_agent_reads() -> None:
    """deploy/dcgm/counters.csv: dcgm-exporter's format (field, type, help), only fields the
    agent maps, and every GpuSample field of DCGM_FIELDS covered by one of them."""
    csv = FIXTURE.parents[3] / "deploy" / "dcgm" / "counters.csv"
    rows = [
        [part.strip() for part in line.split(",", 2)]
        for line in csv.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(len(row) == 3 and row[1] in ("gauge", "counter") and row[2] for row in rows)
    fields = [row[0] for row in rows]
    assert len(fields) == len(set(fields)) and set(fields) <= set(DCGM_FIELDS)
    assert {DCGM_FIELDS[f] for f in fields} == set(DCGM_FIELDS.values())

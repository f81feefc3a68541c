"""Node telemetry rules (thermal, power, clocks, GPU errors, NICs) on hand-built samples."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from guard.detectors.engine import NodeDetectors
from guard.detectors.findings import Finding
from guard.detectors.gpu_errors import GpuErrorDetector
from guard.detectors.nic import NicDetector
from guard.schemas import GpuSample, NicSample

T0 = 1_767_225_600.0
HEALTHY: dict[str, Any] = {
    "temp_c": 62.0,
    "power_w": 600.0,
    "power_limit_w": 700.0,
    "sm_clock_mhz": 1980.0,
    "util_pct": 98.0,
    "clock_event_reasons": 0,
    "ecc_dbe_total": 0,
}


def gpu_run(change: Callable[[int, int], dict[str, Any]], seconds: int = 60) -> list[Finding]:
    """Eight GPUs sampled every second; ``change(t, gpu)`` overrides healthy values."""
    node = NodeDetectors("n1")
    found: list[Finding] = []
    for t in range(seconds):
        for g in range(8):
            values = {**HEALTHY, "temp_c": 60.0 + g % 4, **change(t, g)}
            found += node.update(
                GpuSample(ts=T0 + t + 0.01 * g, node="n1", job="j", gpu=g, **values)
            )
        found += node.tick(T0 + t + 0.5)
    return found + node.flush()


def claims(found: list[Finding]) -> list[tuple[str, int | None]]:
    return [(f.category, f.gpu) for f in found if f.severity != "info" and not f.clear]


def test_healthy_node_gives_no_flag() -> None:
    assert gpu_run(lambda t, g: {}) == []


def test_hot_gpu_is_thermal_and_throttle_bits_count() -> None:
    found = gpu_run(
        lambda t, g: {"temp_c": 88.0, "clock_event_reasons": 0x20} if (g == 5 and t >= 20) else {}
    )
    assert claims(found) == [("thermal", 5)]
    hit = next(f for f in found if f.category == "thermal")
    assert hit.ts - T0 <= 23 and hit.evidence["above_peers_c"] >= 20


def test_hot_node_or_rack_below_the_limit_is_not_a_gpu_fault() -> None:
    assert claims(gpu_run(lambda t, g: {"temp_c": 74.0 + g % 4})) == []


def infos(found: list[Finding]) -> list[tuple[str, int | None]]:
    return [(f.category, f.gpu) for f in found if f.severity == "info" and not f.clear]


def test_gpu_hot_from_its_airflow_position_at_full_clocks_is_info_not_a_claim() -> None:
    # 12 C above its siblings, full clocks, full power, no reason bit, far from slowdown
    found = gpu_run(lambda t, g: {"temp_c": 74.0, "temp_slowdown_c": 87.0} if g == 7 else {})
    assert claims(found) == []
    assert infos(found) == [("thermal", 7)]


def test_hot_gpu_with_impact_is_a_claim_that_names_the_impact() -> None:
    cases = {
        "sm_clock_deficit": {"temp_c": 76.0, "sm_clock_mhz": 1860.0},
        "power_deficit": {"temp_c": 76.0, "power_w": 450.0},
        "near_slowdown_temp": {"temp_c": 86.0, "temp_slowdown_c": 87.0},
        "reason_bits": {"temp_c": 76.0, "clock_event_reasons": 0x8},
    }
    for impact, values in cases.items():
        found = gpu_run(lambda t, g, v=values: v if (g == 4 and t >= 10) else {})
        thermal = [f for f in found if f.category == "thermal" and f.severity == "warning"]
        assert [f.gpu for f in thermal] == [4], impact
        assert thermal[0].evidence["impact"] == impact


def test_near_slowdown_uses_the_gpus_own_threshold() -> None:
    # 86 C, 12 C above siblings: near a slowdown threshold of 87 C, far from one of 95 C
    near = gpu_run(lambda t, g: {"temp_c": 86.0, "temp_slowdown_c": 87.0} if g == 2 else {})
    far = gpu_run(lambda t, g: {"temp_c": 86.0, "temp_slowdown_c": 95.0} if g == 2 else {})
    assert claims(near) == [("thermal", 2)] and claims(far) == []


def test_hot_gpu_drawing_a_little_less_at_full_clocks_is_not_a_claim() -> None:
    # 12 C above its siblings and 10 % below their power, at full clocks: silicon, not a fault
    found = gpu_run(lambda t, g: {"temp_c": 74.0, "power_w": 540.0} if g == 4 else {})
    assert claims(found) == [] and infos(found) == [("thermal", 4)]


def test_power_limit_below_siblings_without_impact_is_info() -> None:
    # capped to 600 W but drawing 590 W at full clocks without the power-cap bit: no slowdown
    found = gpu_run(
        lambda t, g: {"power_limit_w": 600.0, "power_w": 590.0} if (g == 1 and t >= 5) else {}
    )
    assert claims(found) == [] and infos(found) == [("power", 1)]


def test_one_hot_sample_is_not_thermal() -> None:
    assert claims(gpu_run(lambda t, g: {"temp_c": 95.0} if (g == 1 and t == 30) else {})) == []


def test_power_capped_gpu_is_power() -> None:
    found = gpu_run(
        lambda t, g: (
            {
                "power_limit_w": 450.0,
                "power_w": 448.0,
                "clock_event_reasons": 0x4,
                "sm_clock_mhz": 1800.0,
            }
            if (g == 2 and t >= 10)
            else {}
        )
    )
    assert claims(found)[0] == ("power", 2)


def test_power_brake_is_power() -> None:
    found = gpu_run(
        lambda t, g: (
            {"power_w": 330.0, "clock_event_reasons": 0x88, "sm_clock_mhz": 1500.0}
            if (g == 6 and t >= 10)
            else {}
        )
    )
    assert claims(found)[0] == ("power", 6)


def test_healthy_gpus_touching_their_power_limit_now_and_then_are_not_flagged() -> None:
    found = gpu_run(
        lambda t, g: (
            {"clock_event_reasons": 0x4, "sm_clock_mhz": 1920.0} if (t * 8 + g) % 37 == 0 else {}
        )
    )
    assert claims(found) == []


def test_low_clock_under_load_is_clock_but_idle_is_not() -> None:
    found = gpu_run(lambda t, g: {"sm_clock_mhz": 1400.0} if (g == 3 and t >= 10) else {})
    assert claims(found) == [("clock", 3)]
    idle = gpu_run(
        lambda t, g: (
            {"sm_clock_mhz": 345.0, "util_pct": 0.0, "clock_event_reasons": 0x1} if g == 3 else {}
        )
    )
    assert claims(idle) == []


def test_xid_and_dbe_are_critical_at_once() -> None:
    found = gpu_run(
        lambda t, g: (
            ({"xid": 79} if t == 30 else {})
            if g == 4
            else ({"ecc_dbe_total": 1} if (g == 1 and t >= 40) else {})
        )
    )
    crit = [(f.gpu, f.evidence["error"], f.severity) for f in found]
    assert crit == [(4, "xid", "critical"), (1, "ecc_dbe", "critical")]
    assert found[0].evidence["lost_gpu"] is True


def test_dbe_counter_reset_is_not_an_error() -> None:
    found = gpu_run(lambda t, g: {"ecc_dbe_total": 5 if t < 30 else 0})
    assert found == []


def test_gpu_that_goes_silent_while_siblings_report_is_lost() -> None:
    det = GpuErrorDetector("n1", lost_after_s=10.0)
    found: list[Finding] = []
    for t in range(40):
        for g in range(8):
            if g == 7 and t >= 15:
                continue
            found += det.update(GpuSample(ts=T0 + t, node="n1", gpu=g))
        found += det.tick(T0 + t + 0.5)
    assert [(f.gpu, f.evidence["error"]) for f in found] == [(7, "lost_gpu")]


def test_whole_node_telemetry_gap_is_not_a_lost_gpu() -> None:
    found = gpu_run(lambda t, g: {}, seconds=20)
    node = NodeDetectors("n1")
    for t in list(range(10)) + list(range(130, 140)):  # two minutes without any sample
        for g in range(8):
            found += node.update(GpuSample(ts=T0 + t, node="n1", gpu=g, **HEALTHY))
        found += node.tick(T0 + t + 0.5)
    for t in range(10, 130):
        found += node.tick(T0 + t)
    assert found == []


# --- NICs -----------------------------------------------------------------------------------


def nic_run(
    counters: Callable[[int, int], dict[str, int]],
    seconds: int = 60,
    extra: Callable[[int, int], dict[str, Any]] = lambda t, d: {},
) -> list[Finding]:
    det = NicDetector()
    found: list[Finding] = []
    for t in range(seconds):
        for d in range(4):
            fields = {"link_up": True, "speed_gbps": 400.0, **extra(t, d)}
            found += det.update(
                NicSample(
                    ts=T0 + t,
                    node="n1",
                    device=f"mlx5_{d}",
                    port=1,
                    counters=counters(t, d),
                    **fields,
                )
            )
    return found


def base(t: int) -> dict[str, int]:
    return {
        "port_xmit_data": 10**9 * t,
        "port_xmit_wait": 2000 * t,
        "np_ecn_marked_roce_packets": 3 * t,
        "symbol_error": 0,
        "link_downed": 1,
    }


def test_healthy_nics_give_nothing() -> None:
    assert nic_run(lambda t, d: base(t)) == []


def test_a_rare_symbol_error_is_not_a_degraded_nic() -> None:
    assert nic_run(lambda t, d: {**base(t), "symbol_error": 1 if t >= 30 else 0}) == []


def test_physical_errors_and_retransmits_are_a_degraded_nic() -> None:
    found = nic_run(
        lambda t, d: (
            {**base(t), "symbol_error": 8 * max(0, t - 20), "out_of_sequence": 4 * max(0, t - 20)}
            if d == 2
            else base(t)
        )
    )
    assert [(f.category, f.device, f.severity) for f in found] == [("nic", "mlx5_2", "warning")]
    assert found[0].ts - T0 <= 23


def test_link_downed_increment_is_a_link_flap_at_once() -> None:
    found = nic_run(
        lambda t, d: {**base(t), "link_downed": 2 if (d == 1 and t >= 30) else 1},
        extra=lambda t, d: {"link_up": not (d == 1 and 30 <= t < 32)},
    )
    assert next((f.category, f.device, f.ts - T0) for f in found) == ("link", "mlx5_1", 30.0)
    assert {f.category for f in found} == {"link"}


def test_counter_reset_after_an_agent_restart_is_not_an_error() -> None:
    def counters(t: int, d: int) -> dict[str, int]:
        c = base(t if t < 30 else t - 30)
        c["symbol_error"] = 5 if t < 30 else 0
        c["link_downed"] = 3 if t < 30 else 0
        return c

    assert nic_run(counters) == []


def test_reduced_link_speed_is_a_degraded_nic() -> None:
    found = nic_run(
        lambda t, d: base(t),
        extra=lambda t, d: {"speed_gbps": 200.0 if (d == 3 and t >= 10) else 400.0},
    )
    assert [(f.category, f.device, f.evidence["signal"]) for f in found] == [
        ("nic", "mlx5_3", "speed")
    ]


def test_fabric_congestion_without_errors_is_info_only() -> None:
    def counters(t: int, d: int) -> dict[str, int]:
        c = base(t)
        hot = max(0, t - 20)
        c["np_ecn_marked_roce_packets"] += 600 * hot
        c["port_xmit_wait"] += 80_000 * hot
        return c

    found = nic_run(counters)
    assert [(f.severity, f.evidence["observation"], f.device) for f in found] == [
        ("info", "congestion", None)
    ]


def test_duplicate_and_out_of_order_samples_are_ignored() -> None:
    det = NicDetector()
    msgs = [
        NicSample(ts=T0 + t, node="n1", device="mlx5_0", port=1, counters=base(t))
        for t in (0, 1, 2, 2, 1, 3, 4)
    ]
    assert [f for m in msgs for f in det.update(m)] == []


# --- counter arithmetic, property-based ----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 10**6), st.booleans()),  # (healthy traffic, counter reset?)
        min_size=3,
        max_size=40,
    )
)
def test_resets_and_traffic_without_errors_never_give_a_claim(
    steps: list[tuple[int, bool]],
) -> None:
    det = NicDetector()
    data, wait, errors = 0, 0, 7  # a constant error count: no new errors ever
    found: list[Finding] = []
    for t, (traffic, reset) in enumerate(steps):
        if reset:
            data, wait, errors = 0, 0, 0  # driver reload / agent restart: everything from zero
        data += traffic
        wait += traffic // 100
        counters = {
            "port_xmit_data": data,
            "port_xmit_wait": wait,
            "symbol_error": errors,
            "out_of_sequence": errors,
            "link_downed": errors,
        }
        found += det.update(
            NicSample(
                ts=T0 + t,
                node="n1",
                device="mlx5_0",
                port=1,
                counters=counters,
                link_up=True,
                speed_gbps=400.0,
            )
        )
    assert [f for f in found if f.severity != "info"] == []


@settings(max_examples=60, deadline=None)
@given(
    bursts=st.lists(st.integers(0, 50), min_size=6, max_size=30),
    reset_at=st.integers(0, 29),
)
def test_only_an_increase_of_the_counter_reads_as_errors(bursts: list[int], reset_at: int) -> None:
    det = NicDetector(raise_after=1, within=1, clear_after=1000)
    total = 0
    observed: list[int] = []
    raised_at = None
    for t, burst in enumerate(bursts):
        if t == reset_at:
            total = 0  # a reset: the counter starts again from zero
        total += burst
        observed.append(total)
        found = det.update(
            NicSample(
                ts=T0 + t, node="n1", device="mlx5_0", port=1, counters={"symbol_error": total}
            )
        )
        if found and raised_at is None:
            raised_at = t
    # one second apart, phys_per_s = 0.5: any increase of the counter is an error burst; a
    # decrease (a reset) never is, and neither is the first sample after it
    increases = [t for t in range(1, len(observed)) if observed[t] > observed[t - 1]]
    assert raised_at == (increases[0] if increases else None)


_COUNTER_NAMES = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "out_of_sequence",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
    "link_downed",
    "port_xmit_wait",
    "port_xmit_data",
)


@settings(max_examples=80, deadline=None)
@given(
    samples=st.lists(
        st.dictionaries(st.sampled_from(_COUNTER_NAMES), st.integers(0, 10**4), max_size=9),
        min_size=2,
        max_size=12,
    ),
    repeat=st.integers(1, 4),
)
def test_counter_increases_per_group_match_a_per_name_reference(
    samples: list[dict[str, int]], repeat: int
) -> None:
    """Counters that appear, vanish, reset or move: the xmit-wait and mark increases the
    columns give are the sums of each watched counter's rises (a fall is a reset: it adds
    nothing), one sample per step or all in one step, and a checkpoint keeps the counters."""
    import numpy as np

    from guard.detectors.nic import WATCHED, NicColumns, update_nics

    def reference(now: dict[str, int], before: dict[str, int], names: tuple[str, ...]) -> int:
        return sum(
            now[n] - before[n] for n in names if n in now and n in before and now[n] > before[n]
        )

    seen: list[dict[str, int]] = []
    # each drawn counter set held for ``repeat`` samples (the common case), values moving
    for i, drawn in enumerate(s for s in samples for _ in range(repeat)):
        seen.append({k: v + i * (len(k) % 3) for k, v in drawn.items()})
    messages = [
        NicSample(ts=T0 + i, node="n1", device="mlx5_0", port=1, counters=c)
        for i, c in enumerate(seen)
    ]
    pairs = list(itertools.pairwise(seen))
    marks = ("np_ecn_marked_roce_packets", "rp_cnp_handled")
    expected = [
        (reference(now, before, ("port_xmit_wait",)), reference(now, before, marks))
        for before, now in pairs
    ]
    one_by_one = NicDetector()
    steps = [
        update_nics([one_by_one], np.zeros(1, np.intp), NicColumns.of_samples([m]))[1]
        for m in messages
    ]
    assert [(int(s.wait[0]), int(s.marks[0])) for s in steps[1:]] == expected
    assert [bool(s.valid[0]) for s in steps] == [False] + [True] * len(pairs)
    together = NicDetector()
    _, inc = update_nics(
        [together], np.zeros(len(messages), np.intp), NicColumns.of_samples(messages)
    )
    assert list(zip(inc.wait[1:].tolist(), inc.marks[1:].tolist(), strict=True)) == expected
    restored = pickle.loads(pickle.dumps(together))
    watched = {k: v for k, v in seen[-1].items() if k in WATCHED}
    assert restored.counters("mlx5_0", 1) == watched


# --- the columnar NIC rules against the per-sample reference --------------------------------

_DIFF_COUNTERS = (
    "symbol_error",
    "out_of_sequence",
    "link_downed",
    "port_xmit_wait",
    "np_ecn_marked_roce_packets",
)


@settings(max_examples=120, deadline=None)
@given(
    script=st.lists(
        st.tuples(
            st.integers(0, 2),  # port
            st.integers(-1, 3),  # time step (0: the same instant again, -1: older)
            st.sampled_from(["ok", "errors", "flap", "down", "slow", "reset", "missing"]),
        ),
        min_size=4,
        max_size=60,
    ),
    per_step=st.integers(1, 12),
)
def test_columnar_nic_rules_give_the_reference_claims(
    script: list[tuple[int, int, str]], per_step: int
) -> None:
    """Random port histories (errors, flaps, a port down, a slow link, resets, counters
    missing, duplicates and late samples), fed one sample at a time to the per-sample
    reference and in steps of ``per_step`` samples to the columnar rules: the same claims,
    at the same times, with the same evidence (the congestion observation is left out: it
    reads the round's ports after the round, by design)."""
    import numpy as np

    from guard.detectors.nic import NicColumns, update_nics

    from .reference_nic import NicDetector as Reference

    totals = {p: dict.fromkeys(_DIFF_COUNTERS, 0) for p in range(3)}
    clock = {p: T0 for p in range(3)}
    samples = []
    for port, dt, event in script:
        c = totals[port]
        if event == "reset":
            c.update(dict.fromkeys(_DIFF_COUNTERS, 0))
        c["port_xmit_wait"] += 500
        c["symbol_error"] += 40 if event == "errors" else 0
        c["out_of_sequence"] += 9 if event == "errors" else 0
        c["link_downed"] += 1 if event == "flap" else 0
        clock[port] += dt
        counters = {k: v for k, v in c.items() if not (event == "missing" and k == "symbol_error")}
        samples.append(
            NicSample(
                ts=clock[port], node="n1" if port < 2 else "n2", job="j",
                device=f"mlx5_{port}", port=1,
                counters=counters, link_up=event != "down",
                speed_gbps=200.0 if event == "slow" else 400.0,
            )
        )  # fmt: skip
    references = {"n1": Reference(), "n2": Reference()}  # two nodes: ports 0, 1 and port 2
    expected = [f for s in samples for f in references[s.node].update(s)]
    columnar = {"n1": NicDetector(), "n2": NicDetector()}
    got: list[Finding] = []
    for i in range(0, len(samples), per_step):
        part = samples[i : i + per_step]
        nodes = sorted({s.node for s in part})
        owner = np.array([nodes.index(s.node) for s in part], np.intp)
        got += update_nics([columnar[n] for n in nodes], owner, NicColumns.of_samples(part))[0]

    def claims(found: list[Finding]) -> list[tuple[object, ...]]:
        return sorted(
            (
                f.ts,
                f.node,
                f.device,
                f.category,
                f.severity,
                f.since,
                f.clear,
                sorted(f.evidence.items()),
            )
            for f in found
            if f.evidence.get("signal") != "congestion"
        )

    assert claims(got) == claims(expected)


def _gpu_claim_jobs(nic_lag: int) -> list[tuple[str, int | None, str | None]]:
    """The GPU claims of a node whose GPU samples name job ``a`` until t=20 and no job
    after (its agent lost it), while another source labels its NIC samples job ``b`` from
    t=20; GPU 5 runs hot and throttles from t=30. ``nic_lag``: the NIC records come that
    many steps after their time (negative: before)."""
    from guard.detectors.core import DetectionCore
    from guard.schemas import encode

    steps: list[list[tuple[int, str | None, bytes]]] = [[] for _ in range(60 + abs(nic_lag))]
    lead = max(0, -nic_lag)
    for t in range(60):
        for g in range(8):
            hot = {"temp_c": 88.0, "clock_event_reasons": 0x20} if (g == 5 and t >= 30) else {}
            sample = GpuSample(
                ts=T0 + t + 0.01 * g, node="n1", job="a" if t < 20 else None, gpu=g,
                **{**HEALTHY, "temp_c": 60.0 + g % 4, **hot},
            )  # fmt: skip
            steps[t + lead].append((0, "gpu", encode(sample)))
        nic = NicSample(
            ts=T0 + t + 0.5, node="n1", job="a" if t < 20 else "b", device="mlx5_0", port=1,
            speed_gbps=400.0, link_up=True, counters={"symbol_error": 0},
        )  # fmt: skip
        steps[t + lead + nic_lag].append((0, "nic", encode(nic)))
    core = DetectionCore()
    found: list[Any] = []
    for t, records in enumerate(steps):
        out = core.step(records, (), wall=T0 + t)
        assert not out.bad
        found += out.findings
    found += core.flush()
    return [
        (f.category, f.gpu, f.job)
        for f in found
        if isinstance(f, Finding) and f.gpu is not None and f.severity != "info" and not f.clear
    ]


def test_a_gpu_claims_job_is_its_gpu_samples_whichever_topic_came_first() -> None:
    """A GPU round without a job belongs to the job the node's GPU samples last named. The
    node's NIC samples' job does not enter: which topic a worker read last would decide (it
    did: NIC records read with the GPU ones gave the claim job ``b``, 15 steps behind ``a``)."""
    expected = [("thermal", 5, "a")]
    assert _gpu_claim_jobs(0) == expected
    for lag in (15, -5):
        assert _gpu_claim_jobs(lag) == expected, lag
